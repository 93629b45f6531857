"""What mutual TLS costs the Gossip transport: connection setup and per-update time, TLS vs insecure, side by side
in one run on loopback.

Handshake: a fresh channel to the real PeerServer up to a completed Identify call (TCP connect, HTTP/2 setup and,
with TLS, the mutual-TLS handshake with ECDSA P-256 fleet certificates and the server's caller check), median over
``--connects`` connections. Per update: the real EdgeSender -> PeerServer path (chunking, strict reassembly, the
window of in-flight updates, cumulative Acks; a gate that does no tensor work, bench/grpc_throughput.py's
NullGate) for a typical compressed update and a large one; microseconds per update, median of ``--repeats``.
The cases alternate TLS / insecure so background load hits both alike.

Usage: PYTHONPATH=. python bench/tls.py [--connects 40] [--updates 400] [--repeats 3]
Prints both columns and the TLS / insecure ratio of each.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

from bench.grpc_throughput import NullGate, stream_seconds
from peer.config import GossipSpec
from peer.net.client import identify
from peer.net.config import NetConfig
from peer.net.server import PeerServer
from peer.security import ca
from peer.security.credentials import TransportSecurity

FLEET = "bench"


def make_pki(root: Path) -> dict[str, TransportSecurity]:
    """A fleet CA and two device certificates (receiver bench-rx, sender bench-tx)."""
    ca.init_ca(root / "ca", FLEET)
    out = {}
    for name in ("bench-rx", "bench-tx"):
        ca.issue(root / "ca", name, root / name)
        out[name] = TransportSecurity.from_dir(root / name, FLEET)
    return out


async def connect_s(port: int, security: TransportSecurity, config: NetConfig, n: int) -> float:
    """Median seconds from a new channel to a completed Identify (one connection each)."""
    times = []
    for _ in range(n):
        started = time.perf_counter()
        answer = await identify(f"127.0.0.1:{port}", config, security=security, peer_id="bench-rx")
        times.append(time.perf_counter() - started)
        assert answer.peer_id == "bench-rx"
    return statistics.median(times)


async def update_us(payload: bytes, count: int, window: int, config: NetConfig, rx: TransportSecurity,
                    tx: TransportSecurity) -> float:
    """Microseconds per update of ``count`` updates through EdgeSender -> PeerServer (``window`` in flight)."""
    return await stream_seconds(payload, count, window, config, rx, tx) / count * 1e6


async def main(connects: int, updates: int, repeats: int) -> None:
    config = NetConfig()
    window = GossipSpec().window
    with tempfile.TemporaryDirectory() as tmp:
        pki = make_pki(Path(tmp))
        modes = {"TLS": (pki["bench-rx"], pki["bench-tx"]),
                 "insecure": (TransportSecurity.insecure(FLEET), TransportSecurity.insecure(FLEET))}
        print(f"loopback, cpus={os.cpu_count()}, {platform.machine()}, ECDSA P-256 certificates, window {window}, "
              f"median of {repeats} runs, TLS and insecure alternating")
        print(f"{'measure':>32} {'TLS':>10} {'insecure':>10} {'ratio':>6}")
        servers = {}
        for mode, (rx, _) in modes.items():
            servers[mode] = PeerServer(NullGate("bench-rx"), config, security=rx)
            await servers[mode].start("127.0.0.1:0")
        results: dict[str, dict[str, list[float]]] = {m: {} for m in modes}
        for mode, (_, tx) in modes.items():  # warm-up
            await connect_s(servers[mode].port, tx, config, 3)
        for _ in range(repeats):
            for mode, (_, tx) in modes.items():
                results[mode].setdefault("connect", []).append(
                    await connect_s(servers[mode].port, tx, config, connects))
        for server in servers.values():
            await server.stop(0)
        sizes = {"update 4 KiB (compressed)": 4 * 1024, "update 1 MiB (dense)": 2 ** 20}
        for label, size in sizes.items():
            payload = os.urandom(size)
            count = updates if size < 2 ** 16 else max(20, updates // 10)
            for mode, (rx, tx) in modes.items():
                await update_us(payload, max(5, count // 10), window, config, rx, tx)  # warm-up
            for _ in range(repeats):
                for mode, (rx, tx) in modes.items():
                    results[mode].setdefault(label, []).append(
                        await update_us(payload, count, window, config, rx, tx))
        rows = [("connect + Identify (ms)", "connect", 1e3)] + [(f"{k} (us)", k, 1.0) for k in sizes]
        for title, key, unit in rows:
            tls = statistics.median(results["TLS"][key]) * unit
            plain = statistics.median(results["insecure"][key]) * unit
            print(f"{title:>32} {tls:>10.2f} {plain:>10.2f} {tls / plain:>6.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connects", type=int, default=40, help="connections per handshake measurement")
    parser.add_argument("--updates", type=int, default=400, help="4 KiB updates per measurement (1 MiB: a tenth)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per case (the median is shown)")
    args = parser.parse_args()
    asyncio.run(main(args.connects, args.updates, args.repeats))
