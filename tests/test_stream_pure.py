"""Property tests (hypothesis) of the pure stream classes, driven directly - no transport, no event loop, no clock
but the one the test passes: an OutboundStream and an InboundStream joined by a test wire that loses frames and
acks and cuts the stream anywhere, and an InboundStream fed arbitrary chunk sequences. Modelled on hivemind's pure
protocol pieces tested without a network (averaging/partition.py)."""

from __future__ import annotations

import dataclasses
from collections import deque

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from peer.net.config import NetConfig
from peer.net.inbound import InboundStream, InboundStreams, ack_reply
from peer.net.outbound import OutboundStream, StreamBroken
from peer.net.proto.lpdl.v1 import peer_pb2 as pb
from tests.test_net_support import make_gate, totals

CONFIG = NetConfig(chunk_bytes=40, max_chunk_bytes=4096, batch_bytes=4096, max_buffered_bytes=1 << 20)


class Wire:
    """Sender peer-a -> receiver peer-b through the pure classes; frames and acks queue in between."""

    def __init__(self, window: int, chunk_bytes: int) -> None:
        self.a, self.b = make_gate("peer-a", seed=1, window=window), make_gate("peer-b", seed=2, window=window)
        config = dataclasses.replace(CONFIG, chunk_bytes=chunk_bytes)
        self.out = OutboundStream(self.a, "peer-b", config)
        self.table = InboundStreams(self.b, config)
        self.stream: InboundStream | None = None
        self.frames: deque[bytes] = deque()
        self.acks: deque[pb.GossipReply] = deque()
        self.round = 0
        self.before = totals([self.a, self.b])

    def connect(self) -> None:
        """Cut whatever stream there is, then open one with a handshake (which settles every in-flight message)."""
        self.cut()
        stream = self.table.open("wire", caller="peer-a")
        received = stream.on_frame(self.out.hello(), 0.0)
        assert received.reply is not None and received.refusal is None
        self.out.on_reply(pb.GossipReply.FromString(received.reply.SerializeToString()), 0.0)
        self.stream = stream
        assert not self.a.in_flight_count("peer-b")

    def cut(self) -> None:
        if self.stream is not None:
            self.stream.close("cut")
            self.stream = None
        self.out.broken()
        self.frames.clear()
        self.acks.clear()

    def commit(self, n: int) -> None:
        for _ in range(n):
            for msg in self.a.engine.send_round(["peer-b"], self.round):
                self.out.submit(msg)
            self.round += 1

    def write(self) -> None:
        if self.out.open:
            self.frames.extend(self.out.frames(lambda: 0.0))

    def deliver(self, n: int) -> None:
        for _ in range(min(n, len(self.frames))):
            assert self.stream is not None
            received = self.stream.on_frame(self.frames.popleft(), 0.0)
            assert received.refusal is None, received.refusal
            if received.ack is not None:
                self.acks.append(ack_reply(received.ack))

    def ack(self, n: int) -> None:
        for _ in range(min(n, len(self.acks))):
            self.out.on_reply(self.acks.popleft(), 0.0)

    def check(self) -> None:
        """Invariants; conservation whenever nothing is in flight (an applied message stays in flight, counted at
        both ends, until an Ack or a handshake settles it)."""
        if not self.a.in_flight_count("peer-b"):
            after = totals([self.a, self.b])
            assert torch.allclose(after.mass, self.before.mass, atol=1e-4, rtol=1e-6)
            assert after.weight == pytest.approx(self.before.weight, abs=1e-9)
        seqs = [seq for _, seq in self.b.applied]
        assert seqs == sorted(set(seqs)), "applied twice or out of order"
        partial = self.stream.partial if self.stream is not None else None
        assert (self.table.buffered.used > 0) == (partial is not None and partial.total_length > 0)


OPS = st.lists(st.one_of(st.tuples(st.just("commit"), st.integers(1, 4)), st.tuples(st.just("write"), st.just(0)),
                         st.tuples(st.just("deliver"), st.integers(1, 6)), st.tuples(st.just("ack"), st.integers(1, 3)),
                         st.tuples(st.just("cut"), st.just(0))), max_size=40)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, window=st.integers(1, 4), chunk_bytes=st.sampled_from([40, 4096]))
def test_any_pattern_of_losses_and_cuts_moves_mass_exactly_once(ops, window: int, chunk_bytes: int) -> None:
    """Messages committed, written (chunked, or batched when several wait), delivered, acknowledged, or lost with
    the stream at any point: mass is conserved, nothing applied twice or out of order, the shared budget holds
    exactly the partial update; a last handshake settles everything and the replicas agree."""
    wire = Wire(window, chunk_bytes)
    wire.connect()
    for op, n in ops:
        if op == "cut":
            wire.connect()
        elif op == "write":
            wire.write()
        else:
            getattr(wire, op)(n)
        wire.check()
    wire.connect()
    wire.check()
    assert wire.table.buffered.used == 0
    assert torch.equal(wire.a.engine.algorithm.replica_out("peer-b"), wire.b.engine.algorithm.replica_in("peer-a"))
    assert wire.out.idle


@settings(max_examples=60, deadline=None)
@given(seqs=st.lists(st.integers(1, 40), min_size=1, max_size=12))
def test_acks_settle_exactly_the_messages_written_up_to_them(seqs) -> None:
    """An Ack for a seq below the first unacknowledged one is stale (settles nothing); one above the last written
    breaks the stream; any other settles every message up to it, once."""
    wire = Wire(window=32, chunk_bytes=4096)
    wire.connect()
    wire.commit(20)
    wire.write()
    wire.deliver(len(wire.frames))
    settled: set[int] = set()
    for seq in seqs:
        unacked_before = wire.a.in_flight_count("peer-b")
        try:
            settlement = wire.out.on_reply(ack_reply(seq), 0.0)
        except StreamBroken:
            assert seq > 20
            continue
        got = {s for s, _ in settlement.delivered}
        assert got.isdisjoint(settled) and all(s <= seq for s in got)
        settled |= got
        assert wire.a.in_flight_count("peer-b") == unacked_before - len(got) == 20 - len(settled)
        assert settled == set(range(1, max(settled, default=0) + 1))


CHUNKS = st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3), st.integers(0, 4), st.integers(0, 300),
                            st.integers(0, 120)), min_size=1, max_size=10)


@settings(max_examples=150, deadline=None)
@given(chunks=CHUNKS, batch=st.booleans())
def test_arbitrary_chunks_never_leak_budget_or_change_state(chunks, batch: bool) -> None:
    """Chunks with any index, count, announced length and size (payload bytes no codec accepts): whatever the
    stream answers, no mass moves, every refusal has a code, and once the stream is over the budget is whole."""
    b = make_gate("peer-b", seed=2)
    table = InboundStreams(b, CONFIG)
    stream = table.open("fuzz", caller="peer-a")
    hello_wire = Wire(1, 40)  # only for a well-formed Hello of peer-a
    received = stream.on_frame(hello_wire.out.hello(), 0.0)
    assert received.reply is not None
    x, w = b.engine.x.clone(), b.engine.w
    updates = [pb.Update(seq=seq + 1, round=0, weight=0.1, scale=0.1, algorithm="choco", chunk_index=index,
                         chunk_count=count, total_length=total, data=b"\xff" * size)
               for seq, index, count, total, size in chunks]
    frames = [pb.GossipFrame(batch=pb.UpdateBatch(updates=updates))] if batch else \
        [pb.GossipFrame(update=u) for u in updates]
    for frame in frames:
        received = stream.on_frame(frame.SerializeToString(), 0.0)
        assert not any(applied for _, applied in received.delivered)
        if received.refusal is not None:
            assert received.refusal.code != pb.REFUSAL_UNSPECIFIED and stream.ended
            break
        assert table.buffered.used == (stream._reassembler.buffered)
    stream.close()
    assert table.buffered.used == 0 and len(table) == 0
    assert torch.equal(x, b.engine.x) and w == b.engine.w


def test_the_stream_classes_and_what_they_import_do_no_io() -> None:
    """peer/net/inbound.py and outbound.py, and every module of peer/ they import (TYPE_CHECKING imports included),
    import no grpc, asyncio or socket; none of the net/ modules among them logs. Package ``__init__`` files are not
    stream code and are skipped (peer/net/__init__.py sets gRPC's log level before any module of the room imports
    grpc); outside net/, the config chain reaches peer/daemon/allocator.py, which logs at start-up only."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]

    def source(module: str) -> Path | None:
        path = root.joinpath(*module.split("."))
        return path.with_suffix(".py") if path.with_suffix(".py").exists() else None

    seen: set[str] = set()
    todo = ["peer.net.inbound", "peer.net.outbound"]
    external: set[tuple[str, str]] = set()
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        path = source(module)
        if path is None:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] + [f"{node.module}.{a.name}" for a in node.names] \
                if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
            for name in names:
                if name.startswith("peer.") and "proto" not in name:
                    todo.append(name)
                elif not name.startswith("peer"):
                    external.add((name.split(".")[0], module))
    forbidden = {(name, module) for name, module in external
                 if name in {"grpc", "asyncio", "socket"} or (name == "logging" and module.startswith("peer.net."))}
    assert not forbidden, forbidden
    assert {"peer.net.server", "peer.net.client", "peer.net.transport"}.isdisjoint(seen)
