"""The library builds no server, client or discovery without an explicit security choice: leaving ``security`` out
is a TypeError from Python, passing None (or anything but a TransportSecurity) a TypeError that names the explicit
lab choice, ``TransportSecurity.insecure()``."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from peer.net.accounting import LinkAccounting
from peer.net.client import EdgeSender, fetch_model, identify
from peer.net.config import NetConfig
from peer.net.discovery import Discovery
from peer.net.server import PeerServer
from peer.net.transport import GrpcTransport
from tests.test_net_support import FINGERPRINT, INSECURE, make_gate

GATE = make_gate("peer-a")


def _transport(**kw: Any) -> GrpcTransport:
    loop = asyncio.new_event_loop()
    try:
        return GrpcTransport(GATE, NetConfig(), LinkAccounting(), loop, **kw)
    finally:
        loop.close()


BUILDERS: dict[str, Callable[..., object]] = {
    "PeerServer": lambda **kw: PeerServer(GATE, **kw),
    "EdgeSender": lambda **kw: EdgeSender(GATE, "peer-b", "127.0.0.1:1", **kw),
    "GrpcTransport": _transport,
    "Discovery": lambda **kw: Discovery(GATE.identity(), 1, mdns=False, **kw),
    "identify": lambda **kw: asyncio.run(identify("127.0.0.1:1", **kw)),
    "fetch_model": lambda **kw: asyncio.run(fetch_model("127.0.0.1:1", FINGERPRINT, **kw)),
}


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_missing_security_is_refused(name: str) -> None:
    with pytest.raises(TypeError, match="security"):
        BUILDERS[name]()


@pytest.mark.parametrize("name", sorted(BUILDERS))
@pytest.mark.parametrize("wrong", [None, "insecure", False])
def test_none_security_names_the_explicit_lab_choice(name: str, wrong: object) -> None:
    with pytest.raises(TypeError, match=r"TransportSecurity\.insecure\(\) explicitly") as err:
        BUILDERS[name](security=wrong)
    assert name in str(err.value)


@pytest.mark.parametrize("name", ["PeerServer", "EdgeSender", "GrpcTransport", "Discovery"])
def test_explicit_insecure_is_accepted(name: str) -> None:
    assert BUILDERS[name](security=INSECURE).security is INSECURE  # type: ignore[attr-defined]
