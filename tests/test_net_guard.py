"""Connections before authentication are cheap and bounded (issue 23, deliverable 5): idle TCP connections from a
host without a fleet certificate are closed at the TLS-handshake deadline (net.handshake_timeout_s), so they cannot
hold the server's connection slots (net.max_connections) that a legitimate peer needs. Real gRPC with mutual TLS
over 127.0.0.1 sockets; the outsider is plain sockets that connect and never speak."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from peer.daemon.gate import PeerGate
from peer.net.client import EdgeSender, identify
from peer.net.config import NetConfig
from peer.net.limits import CallerBuckets
from peer.net.server import PeerServer
from peer.security import ca
from peer.security.credentials import TransportSecurity
from tests.async_watchdog import run_watched
from tests.test_net_support import FLEET, LAYOUT, RecordingGate, make_gate

#: More idle connections than the server has slots (net.max_connections 256 by default).
OUTSIDER_CONNECTIONS = 300
#: How soon the legitimate peer must be connected, counted from its first attempt (seconds).
CONNECT_WITHIN_S = 5.0


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pki")
    ca.init_ca(root / "ca", FLEET)
    for name in ("peer-a", "peer-b"):
        ca.issue(root / "ca", name, root / name)
    return root


def idle_connections(port: int, n: int) -> list[socket.socket]:
    """``n`` TCP connections to ``port`` that never send a byte (no TLS ClientHello)."""
    conns = []
    for _ in range(n):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            sock.connect(("127.0.0.1", port))
        except BlockingIOError:
            pass
        conns.append(sock)
    return conns


def still_open(conns: list[socket.socket]) -> int:
    """How many of ``conns`` the server has not closed."""
    open_ = 0
    for sock in conns:
        try:
            open_ += sock.recv(1) != b""
        except BlockingIOError:
            open_ += 1
        except OSError:
            pass
    return open_


def test_idle_outsider_connections_do_not_lock_out_a_peer(pki: Path) -> None:
    config = NetConfig(backoff_base_s=0.05, backoff_max_s=0.2, connect_timeout_s=CONNECT_WITHIN_S)

    async def main() -> None:
        server = PeerServer(make_gate("peer-a", "sgp", seed=1), config,
                            security=TransportSecurity.from_dir(pki / "peer-a", FLEET))
        port = await server.start("127.0.0.1:0")
        outsiders = idle_connections(port, OUTSIDER_CONNECTIONS)
        edge = EdgeSender(make_gate("peer-b", "sgp", seed=2), "peer-a", f"127.0.0.1:{port}", config,
                          security=TransportSecurity.from_dir(pki / "peer-b", FLEET))
        try:
            await asyncio.sleep(0.5)  # the outsiders' connections are accepted and hold their slots
            started = time.monotonic()
            edge.start()
            while not edge.ready and time.monotonic() - started < CONNECT_WITHIN_S:
                await asyncio.sleep(0.02)
            took = time.monotonic() - started
            assert edge.ready, (f"a legitimate peer could not connect within {CONNECT_WITHIN_S} s while "
                                f"{OUTSIDER_CONNECTIONS} idle outsider connections were open (last error: "
                                f"{edge.last_error})")
            # the server closed the outsiders at the handshake deadline: none holds a slot any more
            assert still_open(outsiders) == 0, f"{still_open(outsiders)} idle connections still open after {took:.1f} s"
        finally:
            await edge.close()
            await server.stop(0)
            for sock in outsiders:
                sock.close()

    asyncio.run(main())


def test_a_revoked_peers_open_stream_is_cut_within_seconds(pki: Path, tmp_path: Path) -> None:
    """The insider keeps its Gossip stream open and sends an update every 50 ms; once ``revoked`` names it on the
    target, the stream ends within 5 s and nothing it sends is applied any more (its reconnects are refused)."""
    import shutil
    tls = tmp_path / "peer-a"
    shutil.copytree(pki / "peer-a", tls)
    config = NetConfig(backoff_base_s=0.05, backoff_max_s=0.2, connect_timeout_s=3.0, ack_timeout_s=5.0)
    target = make_gate("peer-a", "sgp", seed=1)
    insider = make_gate("mallory-dev", "sgp", seed=2, window=8)
    (pki / "ca" / "revoked").unlink(missing_ok=True)
    ca.issue(pki / "ca", "mallory-dev", tmp_path / "mallory-dev")

    async def main() -> None:
        server = PeerServer(target, config, security=TransportSecurity.from_dir(tls, FLEET))
        port = await server.start("127.0.0.1:0")
        edge = EdgeSender(insider, "peer-a", f"127.0.0.1:{port}", config,
                          security=TransportSecurity.from_dir(tmp_path / "mallory-dev", FLEET))
        edge.start()
        stop = asyncio.Event()

        async def send_forever() -> None:
            round_index = 0
            while not stop.is_set():
                if edge.ready:
                    for msg in insider.engine.send_round(["peer-a"], round_index):
                        edge.submit(msg)
                    round_index += 1
                await asyncio.sleep(0.05)

        sender = asyncio.ensure_future(send_forever())
        try:
            deadline = time.monotonic() + 10
            while len(target.applied) < 5 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert server.streaming_from("mallory-dev") and len(target.applied) >= 5, "the insider never streamed"
            (tls / "revoked").write_text("peer:mallory-dev\n")  # the operator's `ca revoke`, copied to the target
            revoked_at = time.monotonic()
            while server.streaming_from("mallory-dev") and time.monotonic() - revoked_at < 5.0:
                await asyncio.sleep(0.02)
            took = time.monotonic() - revoked_at
            assert not server.streaming_from("mallory-dev"), "the revoked peer's stream was still open after 5 s"
            applied_at_cut = len(target.applied)
            await asyncio.sleep(1.5)  # the insider keeps sending and reconnecting: all of it is refused
            assert len(target.applied) == applied_at_cut, "updates of a revoked peer were applied after the cut"
            assert server.counters.refused.get("revoked", 0) >= 1
            print(f"revoked stream cut after {took:.2f} s")
        finally:
            stop.set()
            await sender
            await edge.close()
            await server.stop(0)

    asyncio.run(main())


class EnginePeer:
    """What :class:`PeerGate` needs of a Peer, over a test engine (tests.test_net_support.RecordingGate)."""

    def __init__(self, inner: RecordingGate) -> None:
        self.inner = inner
        self.flat = SimpleNamespace(layout=LAYOUT)
        self.answer_hello, self.receive, self.hello_for = inner.answer_hello, inner.receive, inner.hello_for
        self.on_hello_reply, self.on_ack, self.in_flight_count = inner.on_hello_reply, inner.on_ack, \
            inner.in_flight_count

    def model_vector(self) -> torch.Tensor:
        return self.inner.engine.state.debiased()


def test_each_senders_update_rate_is_bounded(pki: Path, tmp_path: Path) -> None:
    """An insider that floods updates (200k were all applied on main) gets at most the burst plus the rate applied;
    the rest are refused with REFUSAL_LIMIT (counter update_rate) and stay in flight on its side."""
    ca.issue(pki / "ca", "flooder", tmp_path / "flooder")
    rate, burst = 20.0, 10
    config = NetConfig(backoff_base_s=0.02, backoff_max_s=0.1, connect_timeout_s=3.0, ack_timeout_s=5.0)
    inner = make_gate("peer-a", "sgp", seed=1)
    gate = PeerGate(EnginePeer(inner), inner.identity(), lambda: {}, ack_delay_cap_s=0.05,  # type: ignore[arg-type]
                    update_rates=CallerBuckets(rate, burst, max_callers=8))
    gate.accepting, gate.pacing = True, False
    insider = make_gate("flooder", "sgp", seed=2, window=32)

    async def main() -> float:
        server = PeerServer(gate, config, security=TransportSecurity.from_dir(pki / "peer-a", FLEET))
        port = await server.start("127.0.0.1:0")
        edge = EdgeSender(insider, "peer-a", f"127.0.0.1:{port}", config,
                          security=TransportSecurity.from_dir(tmp_path / "flooder", FLEET))
        edge.start()
        started = time.monotonic()
        try:
            round_index = 0
            # flood for 2 s at least, and on (up to 30 s) until the bound has refused something: a loaded machine
            # may send fewer than burst + rate x 2 s updates in the first 2 s
            while time.monotonic() - started < 2.0 or (server.counters.refused.get("update_rate", 0) < 1
                                                        and time.monotonic() - started < 30.0):
                if edge.ready:
                    for msg in insider.engine.send_round(["peer-a"], round_index):
                        edge.submit(msg)
                    round_index += 1
                await asyncio.sleep(0.001)
            assert server.counters.refused.get("update_rate", 0) >= 1, f"{round_index} rounds sent, none refused"
        finally:
            await edge.close()
            await server.stop(0)
        return time.monotonic() - started

    # hung once in a full CI run (never alone): a second bound prints what every task waits on
    elapsed = run_watched(asyncio.wait_for(main(), 90), dump_after_s=75)
    applied = len(inner.applied)
    assert 0 < applied <= burst + rate * elapsed + 1, (applied, elapsed)


def test_failed_tls_handshakes_are_counted(pki: Path) -> None:
    """Probing is visible: plain-text requests and idle connections to a TLS port show as the refusal counter
    tls_handshake; a legitimate peer's connection does not."""
    async def main() -> None:
        server = PeerServer(make_gate("peer-a", "sgp", seed=1), NetConfig(),
                            security=TransportSecurity.from_dir(pki / "peer-a", FLEET))
        port = await server.start("127.0.0.1:0")
        try:
            await identify(f"127.0.0.1:{port}", NetConfig(), security=TransportSecurity.from_dir(pki / "peer-b", FLEET),
                           peer_id="peer-a")
            assert server.snapshot().refused.get("tls_handshake", 0) == 0
            probes = idle_connections(port, 3)
            for sock in probes[:2]:
                sock.setblocking(True)
                sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            deadline = time.monotonic() + 5
            while server.snapshot().refused.get("tls_handshake", 0) < 3 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert server.snapshot().refused.get("tls_handshake", 0) == 3
            for sock in probes:
                sock.close()
        finally:
            await server.stop(0)

    asyncio.run(main())
