"""Hostile and broken input on the Gossip stream, from a raw gRPC client on 127.0.0.1: every bad frame is refused
with a clear log line and a counter, the engine state stays bitwise unchanged, and the server keeps serving a
well-behaved sender afterwards."""

from __future__ import annotations

import asyncio
import logging
import struct

import grpc
import pytest
import torch

from peer.compress.codec import CodecConfig, encode
from peer.compress.layout import Layout
from peer.gossip.algorithms import digest as replica_digest
from peer.gossip.ledger import Hello
from peer.net import wire
from peer.net.api import PROTOCOL_VERSION, Identity
from peer.net.client import GOSSIP_METHOD, EdgeSender
from peer.net.config import NetConfig
from peer.net.proto.lpdl.v1 import peer_pb2 as pb
from peer.net.server import PeerServer
from tests.test_net_support import FINGERPRINT, FLEET, INSECURE, LAYOUT, assert_snapshot_equal, engine_snapshot, make_gate

CONFIG = NetConfig(connect_timeout_s=2.0, ack_timeout_s=2.0, backoff_base_s=0.02, backoff_max_s=0.2,
                   chunk_bytes=1024, max_chunk_bytes=4096, max_payload_bytes=64 * 1024)
ATTACKER = Identity("mallory", PROTOCOL_VERSION, FINGERPRINT, FLEET, "", "choco")


def good_payload(seed: int = 0, layout: Layout = LAYOUT) -> bytes:
    gen = torch.Generator().manual_seed(seed)
    payload, _ = encode(torch.randn(layout.numel, generator=gen), layout, CodecConfig(compression=0.9), gen)
    return payload


def update(seq: int, data: bytes, *, index: int = 0, count: int = 1, total: int | None = None,
           weight: float = 0.25, scale: float = 0.25, algorithm: str = "choco") -> pb.GossipFrame:
    return pb.GossipFrame(update=pb.Update(seq=seq, round=1, weight=weight, scale=scale, algorithm=algorithm,
                                           chunk_index=index, chunk_count=count,
                                           total_length=len(data) if total is None else total, data=data))


def batch(*frames: pb.GossipFrame) -> pb.GossipFrame:
    """One UpdateBatch frame holding the updates of ``frames`` (each built by update())."""
    out = pb.GossipFrame(batch=pb.UpdateBatch())
    for frame in frames:
        out.batch.updates.add().CopyFrom(frame.update)
    return out


def hello(identity: Identity = ATTACKER, next_seq: int = 1, receiver: str = "peer-b",
          replica: torch.Tensor | None = None) -> pb.GossipFrame:
    """A Hello whose replica digest matches ``replica`` (default: a fresh all-zero Choco replica)."""
    digest = replica_digest(torch.zeros(LAYOUT.numel) if replica is None else replica)
    return wire.hello_frame(identity, receiver, Hello(next_seq=next_seq, replica_digests=(digest,)))


def _serialize(frame: pb.GossipFrame | bytes) -> bytes:
    return frame if isinstance(frame, bytes) else frame.SerializeToString()


async def exchange(port: int, frames: list[pb.GossipFrame | bytes], *,
                   reply_first: bool = False) -> list[pb.GossipReply]:
    """Write the frames (bytes: written as they are, e.g. not a protobuf at all), half-close, and collect every
    reply until the server ends the stream. ``reply_first``: read the reply to the first frame (a Hello the server
    refuses) before writing the rest - the server ends the stream after a refusal, and a write racing that end
    fails the whole call, the refusal already received with it (grpc: INTERNAL, "Failed execute_batch"; once in a
    fresh-clone run)."""
    replies: list[pb.GossipReply] = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.stream_stream(GOSSIP_METHOD, request_serializer=_serialize,
                                     response_deserializer=pb.GossipReply.FromString)()
        for i, frame in enumerate(frames):
            try:
                await call.write(frame)
            except asyncio.InvalidStateError:  # server already ended the stream after a refusal
                break
            except grpc.aio.AioRpcError:
                if not replies:
                    raise
                break  # the stream ended under this write, after the reply read first
            if reply_first and i == 0:
                first = await call.read()
                if first is grpc.aio.EOF:
                    return replies
                replies.append(first)
        try:
            await call.done_writing()
        except (asyncio.InvalidStateError, grpc.aio.AioRpcError):
            pass
        try:
            while (reply := await call.read()) is not grpc.aio.EOF:
                replies.append(reply)
        except grpc.aio.AioRpcError:
            if not (reply_first and replies):
                raise
    return replies


def nan_payload() -> bytes:
    """A well-formed raw-f32 dense payload with one NaN value."""
    gen = torch.Generator().manual_seed(3)
    payload, _ = encode(torch.randn(LAYOUT.numel, generator=gen), LAYOUT, CodecConfig(bits=32), gen)
    nan = struct.pack("<f", float("nan"))
    return payload[:-4] + nan


OTHER_LAYOUT = Layout.from_named_shapes([("w", (50,)), ("b", (7,))])

HANDSHAKE_CASES = {
    "fingerprint": (Identity("mallory", PROTOCOL_VERSION, "other-fp", FLEET, "", "choco"), pb.REFUSAL_FINGERPRINT),
    "protocol": (Identity("mallory", PROTOCOL_VERSION + 1, FINGERPRINT, FLEET, "", "choco"), pb.REFUSAL_PROTOCOL),
    "fleet": (Identity("mallory", PROTOCOL_VERSION, FINGERPRINT, "other-fleet", "", "choco"), pb.REFUSAL_FLEET),
    "self": (Identity("peer-b", PROTOCOL_VERSION, FINGERPRINT, FLEET, "", "choco"), pb.REFUSAL_SELF),
    "algorithm": (Identity("mallory", PROTOCOL_VERSION, FINGERPRINT, FLEET, "", "sgp"), pb.REFUSAL_ALGORITHM),
}

P = good_payload()
UPDATE_CASES = {
    # name: (frames after a good Hello, expected counter reason, log fragment)
    "truncated": ([update(1, P[:10], count=3, total=len(P))], "truncated", "ended inside update seq 1"),
    "garbage_payload": ([update(1, b"\x00garbage" * 8)], "bad_payload", "refused by the engine"),
    "out_of_order_chunk": ([update(1, P[:10], count=2, total=len(P)), update(1, P[10:], index=3, count=2,
                                                                              total=len(P))],
                           "chunk_order", "expected 1"),
    "count_mismatch": ([update(1, P[:10], count=2, total=len(P)), update(1, P[10:], index=1, count=5,
                                                                          total=len(P))],
                       "chunk_mismatch", "chunk_count"),
    "oversized_chunk": ([update(1, b"x" * 5000)], "chunk_too_large", "max_chunk_bytes"),
    "oversized_payload": ([update(1, b"x" * 100, count=2, total=10 ** 9)], "payload_too_large",
                          "max_payload_bytes"),
    "length_mismatch": ([update(1, P, total=len(P) + 5)], "length_mismatch", "total_length"),
    "nan_weight": ([update(1, P, weight=float("nan"))], "bad_weight", "weight"),
    "inf_scale": ([update(1, P, scale=float("inf"))], "bad_scale", "scale"),
    "nan_payload": ([update(1, nan_payload())], None, "refused by the engine"),
    "other_layout": ([update(1, good_payload(layout=OTHER_LAYOUT))], "bad_payload", "layout"),
    "out_of_order_seq": ([update(5, P), update(3, P)], "seq_order", "replayed or out of order"),
    "replayed_seq": ([update(1, P), update(1, P)], "seq_order", "replayed or out of order"),
    "wrong_algorithm": ([update(1, P, algorithm="sgp")], "algorithm", "algorithm"),
    "update_before_hello": (None, "no_hello", "Update before Hello"),
    # UpdateBatch frames (protocol 5): whole updates only, 1..MAX_WINDOW of them, never inside a partial update
    "batch_before_hello": ([batch(update(1, P), update(2, P))], "no_hello", "UpdateBatch before Hello"),
    "empty_batch": ([pb.GossipFrame(batch=pb.UpdateBatch())], "batch_size", "holds 0 updates"),
    "oversized_batch": ([batch(*[update(seq, b"z") for seq in range(1, 66)])], "batch_size", "holds 65 updates"),
    "chunked_in_batch": ([batch(update(1, P[:10], count=2, total=len(P)))], "batch_chunked", "whole updates only"),
    "batch_in_partial": ([update(1, P[:10], count=2, total=len(P)), batch(update(2, P), update(3, P))],
                         "batch_in_partial", "partly received"),
    "bad_first_in_batch": ([batch(update(1, b"\x00garbage" * 8), update(2, P))], "bad_payload",
                           "refused by the engine"),
    "malformed_frame": ([b"\xff\xff\xff\x07"], "malformed", "is not a valid GossipFrame"),
    # a batch is checked whole before any update is applied: a bad later update leaves the good first one unapplied
    "chunk_later_in_batch": ([batch(update(1, P), update(2, P[:10], count=2, total=len(P)))], "batch_chunked",
                             "whole updates only"),
    "replay_inside_batch": ([batch(update(1, P), update(1, P))], "seq_order", "replayed or out of order"),
    "algorithm_later_in_batch": ([batch(update(1, P), update(2, P, algorithm="sgp"))], "algorithm", "algorithm"),
    "oversized_later_in_batch": ([batch(update(1, P), update(2, b"x" * 5000))], "chunk_too_large",
                                 "max_chunk_bytes"),
}


async def _until(predicate) -> None:
    while not predicate():
        await asyncio.sleep(0.005)


async def serve() -> tuple:
    b = make_gate("peer-b", seed=11)
    server = PeerServer(b, CONFIG, security=INSECURE)
    port = await server.start("127.0.0.1:0")
    return b, server, port


async def well_behaved_sender_still_served(b, port: int) -> None:
    a = make_gate("peer-a", seed=12)
    sender = EdgeSender(a, "peer-b", f"127.0.0.1:{port}", CONFIG, security=INSECURE)
    sender.start()
    for rnd in range(3):
        await asyncio.wait_for(_until(lambda: sender.ready), 5)
        for msg in a.engine.send_round(["peer-b"], rnd):
            sender.submit(msg)
        assert await sender.wait_idle(5)
    assert sender.delivered == 3
    await sender.close()


@pytest.mark.parametrize("case", sorted(HANDSHAKE_CASES))
def test_handshake_refused(case: str, caplog: pytest.LogCaptureFixture) -> None:
    identity, code = HANDSHAKE_CASES[case]

    async def main() -> None:
        b, server, port = await serve()
        before = engine_snapshot(b)
        try:
            replies = await exchange(port, [hello(identity), update(1, P)], reply_first=True)
            assert len(replies) == 1 and replies[0].refusal.code == code
            assert server.counters.refused[case] == 1
            assert_snapshot_equal(before, engine_snapshot(b))
            await well_behaved_sender_still_served(b, port)
        finally:
            await server.stop(0)

    with caplog.at_level(logging.WARNING, logger="peer.net.server"):
        asyncio.run(main())
    assert any(f"{case} mismatch" in r.getMessage() and "theirs=" in r.getMessage() and "ours=" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize("case", sorted(UPDATE_CASES))
def test_bad_update_refused_state_unchanged(case: str, caplog: pytest.LogCaptureFixture) -> None:
    frames, reason, fragment = UPDATE_CASES[case]

    async def main() -> None:
        b, server, port = await serve()
        try:
            if case in ("replayed_seq", "out_of_order_seq"):
                # the first update is good and applied; the replay/out-of-order one must change nothing
                await exchange(port, [hello(), frames[0]])
                first = frames[0].update.seq
                sent = [hello(next_seq=first + 1, replica=b.engine.algorithm.replica_in("mallory")), frames[1]]
            else:
                await exchange(port, [hello()])  # the handshake itself creates the (empty) edge record
                if case.endswith("_before_hello"):
                    sent = [update(1, P)] if frames is None else frames
                else:
                    sent = [hello()] + frames
            before = engine_snapshot(b)
            refused_before = sum(server.counters.refused.values())
            replies = await exchange(port, sent)
            await asyncio.sleep(0.05)  # the server notices the end of a truncated stream asynchronously
            assert_snapshot_equal(before, engine_snapshot(b))
            assert sum(server.counters.refused.values()) == refused_before + 1, dict(server.counters.refused)
            if reason is not None:
                assert server.counters.refused[reason] >= 1, dict(server.counters.refused)
            if case != "truncated":
                assert replies and replies[-1].WhichOneof("reply") == "refusal"
                assert not any(r.WhichOneof("reply") == "ack" for r in replies[1:])
            await well_behaved_sender_still_served(b, port)
        finally:
            await server.stop(0)

    with caplog.at_level(logging.WARNING, logger="peer.net.server"):
        asyncio.run(main())
    assert any(fragment in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]


def test_replayed_seq_on_new_stream_with_stale_hello_is_refused() -> None:
    """A replay that lies about its history (Hello next_seq=1 again) is fenced by the handshake and refused."""

    async def main() -> None:
        b, server, port = await serve()
        try:
            await exchange(port, [hello(), update(1, P)])
            before = engine_snapshot(b)
            replies = await exchange(port, [hello(next_seq=1), update(1, P)])
            assert replies[0].hello_reply.reset and replies[-1].refusal.reason == "seq_order"
            # the reset fenced the edge; only the replica reset is a state change (both ends zero it)
            assert torch.equal(before["x"], b.engine.x) and before["w"] == b.engine.w
        finally:
            await server.stop(0)

    asyncio.run(main())


def test_a_batch_of_whole_updates_is_applied_in_order_with_one_cumulative_ack() -> None:
    """The honest case of an UpdateBatch: each update applied once, in seq order, covered by one Ack."""

    async def main() -> None:
        b, server, port = await serve()
        try:
            frames = [update(seq, good_payload(seq)) for seq in (1, 2, 3)]
            replies = await exchange(port, [hello(), batch(*frames)])
            assert [r.WhichOneof("reply") for r in replies] == ["hello_reply", "ack"]
            assert replies[1].ack.seq == 3 and replies[1].ack.applied
            assert server.counters.applied == 3 and b.applied == [("mallory", 1), ("mallory", 2), ("mallory", 3)]
            assert server.links.get("mallory").frames_received == 1  # ONE frame (the Hello counts as unknown)
        finally:
            await server.stop(0)

    asyncio.run(main())


def test_the_server_serves_every_rpc_of_the_proto() -> None:
    """_add_peer_service copies the generated registration (Gossip takes raw bytes): a method added to the proto
    must not go unserved."""
    from peer.net import server as server_module

    registered: dict[str, object] = {}

    class Recorder:
        def add_generic_rpc_handlers(self, handlers) -> None:
            pass

        def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
            registered.update({f"{service}/{name}": h for name, h in handlers.items()})

    server_module._add_peer_service(server_module._Servicer(None), Recorder())
    methods = pb.DESCRIPTOR.services_by_name["Peer"].methods
    assert sorted(registered) == sorted(f"lpdl.v1.Peer/{m.name}" for m in methods)
