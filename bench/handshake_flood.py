"""Outsider connection floods against a secured PeerServer: how long a legitimate peer takes to connect, with gRPC's
default TLS-handshake deadline (120 s) and with ``net.handshake_timeout_s`` (2 s), side by side in one run.

Floods (plain TCP connections from this host that never send a byte, no certificate needed):
- ``held``: N connections opened once and held;
- ``reconnecting``: N connections kept open, each reopened as soon as the server closes it.
The legitimate peer is the project's EdgeSender with a fleet certificate; the time is from its start to its stream
being up (capped at ``--cap-s``). Also printed: the server's ``tls_handshake`` refusal counter (connections that
never authenticated).

Usage: python bench/handshake_flood.py [--connections 300] [--cap-s 15] [--repeats 2]
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import resource
import tempfile
import time
from pathlib import Path

from peer.net.client import EdgeSender
from peer.net.config import NetConfig
from peer.net.server import PeerServer
from peer.security import ca
from peer.security.credentials import TransportSecurity
from tests.test_net_support import FLEET, make_gate

GRPC_DEFAULT_HANDSHAKE_S = 120.0


async def flood(port: int, n: int, reconnect: bool, stop: asyncio.Event) -> None:
    """Hold ``n`` idle connections to ``port`` until ``stop``; reopen closed ones when ``reconnect``."""
    conns: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    opened = False
    while not stop.is_set():
        conns = [c for c in conns if not c[1].is_closing() and not c[0].at_eof()]
        if reconnect or not opened:
            while len(conns) < n:
                try:
                    conns.append(await asyncio.open_connection("127.0.0.1", port))
                except OSError:
                    break
            opened = True
        await asyncio.sleep(0.01)
    for _, writer in conns:
        writer.close()


async def one_case(pki: Path, handshake_s: float, n: int, reconnect: bool, cap_s: float) -> tuple[float, int]:
    """(seconds until the legitimate peer's stream is up or ``cap_s``, tls_handshake counter)."""
    config = NetConfig(handshake_timeout_s=handshake_s, backoff_base_s=0.05, backoff_max_s=0.2)
    server = PeerServer(make_gate("peer-a", "sgp"), config, security=TransportSecurity.from_dir(pki / "peer-a", FLEET))
    port = await server.start("127.0.0.1:0")
    stop = asyncio.Event()
    attacker = asyncio.ensure_future(flood(port, n, reconnect, stop))
    await asyncio.sleep(1.0)  # the flood holds its slots
    edge = EdgeSender(make_gate("peer-b", "sgp"), "peer-a", f"127.0.0.1:{port}", config,
                      security=TransportSecurity.from_dir(pki / "peer-b", FLEET))
    started = time.monotonic()
    edge.start()
    while not edge.ready and time.monotonic() - started < cap_s:
        await asyncio.sleep(0.02)
    took = time.monotonic() - started
    counted = server.snapshot().refused.get("tls_handshake", 0)
    stop.set()
    await attacker
    await edge.close()
    await server.stop(0)
    return took, counted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connections", type=int, default=300)
    parser.add_argument("--cap-s", type=float, default=15.0)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    pki = Path(tempfile.mkdtemp(prefix="handshake-flood-"))
    ca.init_ca(pki / "ca", FLEET)
    for name in ("peer-a", "peer-b"):
        ca.issue(pki / "ca", name, pki / name)
    print(f"{platform.processor() or platform.machine()}, {args.connections} outsider connections, "
          f"net.max_connections {NetConfig().max_connections}, cap {args.cap_s:g} s")
    print(f"{'flood':<13} {'handshake deadline':>18} {'peer connected after (s)':>26} {'tls_handshake':>14}")
    for reconnect in (False, True):
        for handshake_s in (GRPC_DEFAULT_HANDSHAKE_S, NetConfig().handshake_timeout_s):
            for _ in range(args.repeats):
                took, counted = asyncio.run(one_case(pki, handshake_s, args.connections, reconnect, args.cap_s))
                shown = f">= {args.cap_s:g} (capped)" if took >= args.cap_s else f"{took:.2f}"
                print(f"{'reconnecting' if reconnect else 'held':<13} {handshake_s:>17g}s {shown:>26} {counted:>14}")


if __name__ == "__main__":
    main()
