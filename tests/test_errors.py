"""One error root: every exception class lpdl-peer defines derives from peer.errors.PeerError and carries a
machine-readable ``reason``, keeping its name, message and standard-library base."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import peer
from peer.compress.errors import PayloadError
from peer.config import ConfigError, GossipSpec
from peer.errors import PeerError
from peer.export.errors import ExportError
from peer.gossip.engine import GossipInputError
from peer.net.outbound import Refused, StreamBroken
from peer.net.proto.lpdl.v1 import peer_pb2 as pb


def project_exceptions() -> list[type[BaseException]]:
    """Every exception class defined in a peer module (all of them imported)."""
    found: dict[str, type[BaseException]] = {}
    for info in pkgutil.walk_packages(peer.__path__, "peer."):
        if ".proto" in info.name or info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if issubclass(obj, BaseException) and obj.__module__ == info.name:
                found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return list(found.values())


def test_every_project_error_derives_from_the_root() -> None:
    classes = project_exceptions()
    assert len(classes) >= 20, [c.__name__ for c in classes]
    outside = [f"{c.__module__}.{c.__qualname__}" for c in classes if not issubclass(c, PeerError)]
    assert not outside, f"not derived from PeerError: {outside}"
    codes = {c.__name__: c.default_reason for c in classes if issubclass(c, PeerError)}
    assert all(code and code == code.lower() and " " not in code for code in codes.values()), codes


def test_one_except_clause_reads_the_reason_of_any_of_them() -> None:
    caught: list[tuple[str, str, str]] = []
    for raise_it in (lambda: GossipSpec(algorithm="push"),
                     lambda: (_ for _ in ()).throw(GossipInputError("stale_seq", "seq 3 is stale")),
                     lambda: (_ for _ in ()).throw(Refused(pb.Refusal(code=pb.REFUSAL_FINGERPRINT, reason="",
                                                                     message="other model"))),
                     lambda: (_ for _ in ()).throw(PayloadError("truncated varint"))):
        with pytest.raises(PeerError) as info:
            raise_it()
        caught.append((type(info.value).__name__, info.value.reason, str(info.value)))
    assert caught[0][:2] == ("ConfigError", "config") and "gossip.algorithm" in caught[0][2]
    assert caught[1] == ("GossipInputError", "stale_seq", "seq 3 is stale")
    assert caught[2][:2] == ("Refused", "REFUSAL_FINGERPRINT") and "other model" in caught[2][2]
    assert caught[3] == ("PayloadError", "bad_payload", "truncated varint")


def test_names_and_standard_bases_still_work() -> None:
    assert issubclass(ConfigError, ValueError) and issubclass(PayloadError, ValueError)
    assert issubclass(ExportError, ValueError) and issubclass(Refused, StreamBroken)
    assert ExportError("no checkpoint in /x", reason="missing_state").reason == "missing_state"
    with pytest.raises(ValueError, match="gossip.compression"):
        GossipSpec(algorithm="sgp", compression=0.5)
