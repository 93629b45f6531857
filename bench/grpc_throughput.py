"""gRPC Gossip streaming throughput vs a raw TCP socket, side by side in one run, on loopback.

gRPC path: the real EdgeSender -> PeerServer path (chunking at NetConfig.chunk_bytes, strict reassembly, up to W
updates in flight, cumulative Acks), with a gate whose receive() does nothing, so only the transport is measured.
Raw path: asyncio streams, 4-byte length prefix + payload, a 4-byte cumulative ack per payload (or per k payloads),
the same window of W payloads in flight. Both servers and clients share one event loop in this process (like one
daemon serving and sending).

Usage: python bench/grpc_throughput.py [--mib-per-case 64] [--repeats 3] [--windows 1,32] [--allocator auto]
Prints MB/s (1 MB = 10**6 bytes) per payload size and window, the gRPC/raw ratio with the same window, the ratio
to raw TCP with one payload in flight (the baseline of earlier runs), and the same ratio in MB per CPU-second of
this process (both ends, all threads): on a shared machine the wall-clock rates swing with the neighbours' load,
the CPU cost per byte much less. Goals: >= 0.8 at 1 MB, >= 0.5 at 64 KiB with the default window.

The process runs on the allocator the daemon would choose (``--allocator auto``: tcmalloc, else jemalloc, else
glibc; peer/daemon/allocator.py), both paths alike. It matters for the gRPC path: each stream message of up to
net.batch_bytes is a fresh multi-hundred-KiB buffer at several stages, which glibc serves from fresh pages.
Raw acking: the "raw" column acks every payload, as earlier runs did; gRPC's receiver acks once per stream message
(a batch of 16 x 64 KiB with the defaults), so "raw cum" acks cumulatively once per window // 2 payloads: the same
acking work, the fairer baseline when updates are batched. Caveat of all raw columns: asyncio streams with more than
one payload in flight copy payloads through the transport's and the reader's buffers; at 1 MB that makes raw W>1
several times slower than raw W=1 (compare the columns), so at 1 MB the raw W=1 column is the stricter baseline.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import struct
import time

from peer.daemon.allocator import in_use, reexec_with  # light: no torch, no gRPC
from peer.daemon.kinds import ALLOCATORS


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib-per-case", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--windows", default=None,
                        help="comma-separated windows (updates in flight per edge); default 1 and the default window")
    parser.add_argument("--allocator", choices=ALLOCATORS, default="auto",
                        help="malloc to run on, as the daemon's --allocator (auto: what the daemon would use)")
    return parser


if __name__ == "__main__":
    reexec_with(_parser().parse_args().allocator)  # before torch and gRPC load; returns when staying

from peer.config import GossipSpec  # noqa: E402
from peer.gossip import ledger  # noqa: E402
from peer.gossip.engine import OutMessage  # noqa: E402
from peer.net.api import PROTOCOL_VERSION, Identity  # noqa: E402
from peer.net.client import EdgeSender  # noqa: E402
from peer.net.config import NetConfig  # noqa: E402
from peer.net.server import PeerServer  # noqa: E402
from peer.security.credentials import TransportSecurity  # noqa: E402


class NullGate:
    """A GossipGate that accepts everything and keeps only seq numbers (no tensors); counts unsettled messages."""

    def __init__(self, peer_id: str) -> None:
        self._identity = Identity(peer_id, PROTOCOL_VERSION, "bench", "bench", "", "")
        self.next_seq = 1
        self.last_applied = 0
        self.acked = 0
        self.settled = asyncio.Event()

    def identity(self) -> Identity:
        return self._identity

    def answer_hello(self, sender_id: str, hello: ledger.Hello) -> ledger.HelloReply:
        return ledger.HelloReply(last_applied=self.last_applied, fence=0, reset=False)

    def receive(self, sender_id: str, seq: int, weight: float, scale: float, payload: bytes) -> bool:
        self.last_applied = seq
        return True

    def hello_for(self, receiver_id: str) -> ledger.Hello:
        return ledger.Hello(next_seq=self.next_seq)

    def on_hello_reply(self, receiver_id: str, hello: ledger.Hello, reply: ledger.HelloReply) -> ledger.Settlement:
        return ledger.Settlement()

    def on_ack(self, receiver_id: str, seq: int) -> ledger.Settlement:
        settled = [(s, None) for s in range(self.acked + 1, seq + 1)]
        self.acked = max(self.acked, seq)
        self.settled.set()
        return ledger.Settlement(delivered=settled)

    def in_flight_count(self, receiver_id: str) -> int:
        return self.next_seq - 1 - self.acked

    async def before_ack(self, sender_id: str) -> None:
        return None

    def model_bytes(self) -> bytes:
        return b""

    def max_payload_bytes(self) -> int:
        return 2**62  # no model layout: the transport's own max_payload_bytes applies

    def status(self) -> dict:
        return {}


async def stream_seconds(payload: bytes, count: int, window: int, config: NetConfig,
                         rx: TransportSecurity, tx: TransportSecurity) -> float:
    """Seconds to carry ``count`` updates through EdgeSender -> PeerServer, at most ``window`` unacknowledged
    (``rx``/``tx``: the server's and the sender's transport security)."""
    receiver, sender_gate = NullGate("bench-rx"), NullGate("bench-tx")
    server = PeerServer(receiver, config, security=rx)
    port = await server.start("127.0.0.1:0")
    edge = EdgeSender(sender_gate, "bench-rx", f"127.0.0.1:{port}", config, security=tx)
    edge.start()
    while not edge.ready:
        await asyncio.sleep(0.001)
    started = time.perf_counter()
    for _ in range(count):
        while sender_gate.in_flight_count("bench-rx") >= window:
            sender_gate.settled.clear()
            await sender_gate.settled.wait()
        seq = sender_gate.next_seq
        sender_gate.next_seq += 1
        edge.submit(OutMessage("bench-tx", "bench-rx", seq, 0, 0.5, 0.5, payload))
    await edge.wait_idle()
    elapsed = time.perf_counter() - started
    assert edge.delivered == count, (edge.delivered, count)
    await edge.close()
    await server.stop(0)
    return elapsed


async def grpc_rate(payload: bytes, count: int, window: int, config: NetConfig) -> tuple[float, float]:
    """(MB/s, MB per CPU-second) of ``count`` updates through EdgeSender -> PeerServer, at most ``window``
    unacknowledged."""
    cpu = time.process_time()
    lab = TransportSecurity.insecure()  # the bench measures the transport without TLS (bench/tls.py: with)
    seconds = await stream_seconds(payload, count, window, config, lab, lab)
    megabytes = len(payload) * count / 1e6
    return megabytes / seconds, megabytes / max(time.process_time() - cpu, 1e-9)


async def raw_rate(payload: bytes, count: int, window: int, ack_every: int = 1) -> tuple[float, float]:
    """(MB/s, MB per CPU-second) of ``count`` length-prefixed payloads, at most ``window`` unacknowledged. The
    receiver acks cumulatively (a 4-byte count of payloads read) after every ``ack_every`` payloads and the last:
    1 is one ack per payload (the baseline of earlier runs); the gRPC receiver acks about once per stream message,
    so with batches ``window // 2`` gives raw the same acking work."""
    cpu = time.process_time()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        done = 0
        try:
            while True:
                (length,) = struct.unpack("<I", await reader.readexactly(4))
                await reader.readexactly(length)
                done += 1
                if done % ack_every == 0 or done == count:
                    writer.write(struct.pack("<I", done))
                    await writer.drain()
        except asyncio.IncompleteReadError:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    header = struct.pack("<I", len(payload))
    started = time.perf_counter()
    acked = 0
    for sent in range(count):
        while sent - acked >= window:
            (acked,) = struct.unpack("<I", await reader.readexactly(4))
        writer.write(header)
        writer.write(payload)
        await writer.drain()
    while acked < count:
        (acked,) = struct.unpack("<I", await reader.readexactly(4))
    elapsed = time.perf_counter() - started
    writer.close()
    await writer.wait_closed()
    server.close()
    await server.wait_closed()
    megabytes = len(payload) * count / 1e6
    return megabytes / elapsed, megabytes / max(time.process_time() - cpu, 1e-9)


async def main(mib_per_case: int, repeats: int, windows: list[int]) -> None:
    config = NetConfig()
    print(f"chunk_bytes={config.chunk_bytes} batch_bytes={config.batch_bytes}  {mib_per_case} MiB per measurement, "
          f"median of {repeats} (alternating gRPC/raw), cpus={os.cpu_count()}, {platform.machine()}, default window "
          f"{GossipSpec().window}, allocator {in_use()}")
    print("raw: acks each payload; raw W=1: one in flight; raw cum: one cumulative ack per window // 2 payloads "
          "(as gRPC acks a batch); ratio = gRPC / the raw column before it; MB/cpu-s: MB per CPU-second")
    print(f"{'payload':>10} {'window':>6} {'count':>6} {'gRPC MB/s':>10} {'raw MB/s':>10} {'ratio':>6} "
          f"{'raw W=1':>8} {'ratio':>6} {'raw cum':>8} {'ratio':>6} {'gRPC MB/cpu-s':>13} {'raw MB/cpu-s':>12} "
          f"{'ratio':>6} {'cum MB/cpu-s':>12} {'ratio':>6}")
    for size in (1_000_000, 64 * 1024):
        payload = os.urandom(size)
        count = max(1, mib_per_case * 2 ** 20 // size)
        label = "1 MB" if size == 1_000_000 else "64 KiB"
        for window in windows:
            await grpc_rate(payload, max(1, count // 10), window, config)  # warm-up
            await raw_rate(payload, max(1, count // 10), window)
            g, r, r1, rk = [], [], [], []
            for _ in range(repeats):
                g.append(await grpc_rate(payload, count, window, config))
                r.append(await raw_rate(payload, count, window))
                r1.append(await raw_rate(payload, count, 1))
                rk.append(await raw_rate(payload, count, window, ack_every=max(1, window // 2)))
            gm, rm, r1m, rkm = (statistics.median(x[0] for x in runs) for runs in (g, r, r1, rk))
            gc, rc, rkc = (statistics.median(x[1] for x in runs) for runs in (g, r, rk))
            print(f"{label:>10} {window:>6} {count:>6} {gm:>10.1f} {rm:>10.1f} {gm / rm:>6.2f} {r1m:>8.1f} "
                  f"{gm / r1m:>6.2f} {rkm:>8.1f} {gm / rkm:>6.2f} {gc:>13.1f} {rc:>12.1f} {gc / rc:>6.2f} "
                  f"{rkc:>12.1f} {gc / rkc:>6.2f}")


if __name__ == "__main__":
    args = _parser().parse_args()
    windows = args.windows or f"1,{GossipSpec().window}"
    asyncio.run(main(args.mib_per_case, args.repeats, [int(w) for w in windows.split(",")]))
