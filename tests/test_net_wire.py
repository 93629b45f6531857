"""wire.update_frames: which frames carry a sender's queued updates (batches of whole updates, chunks of large
ones), that its own encoding is byte for byte protobuf's, and that the receiver's reassembly gets every payload back,
in order."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from peer.gossip.ledger import MAX_WINDOW
from peer.net import wire
from peer.net.proto.lpdl.v1 import peer_pb2 as pb
from peer.net.reassembly import Reassembler


@dataclass
class Out:
    seq: int
    payload: bytes
    round: int = 3
    weight: float = 0.25
    scale: float = 0.5


def frames_of(groups) -> list:
    """The frames of update_frames' groups, parsed, in order (each group's updates are those its frames carry);
    each frame is exactly what protobuf serializes for it."""
    out = []
    for updates, encoded in groups:
        frames = [pb.GossipFrame.FromString(data) for data in encoded]
        assert [f.SerializeToString() for f in frames] == encoded
        carried = [u.seq for f in frames for u in (f.batch.updates if f.WhichOneof("frame") == "batch"
                                                  else [f.update])]
        assert sorted(set(carried)) == [u.seq for u in updates]
        out.extend(frames)
    return out


def protobuf_chunks(seq: int, round_index: int, weight: float, scale: float, algorithm: str, payload: bytes,
                    chunk_bytes: int) -> list[pb.GossipFrame]:
    """The reference: one update's chunk frames built as protobuf messages (the first chunk carries every field,
    later ones seq, index, count and total_length)."""
    count = max(1, -(-len(payload) // chunk_bytes))
    frames = []
    for index in range(count):
        fields = dict(seq=seq, chunk_index=index, chunk_count=count, total_length=len(payload),
                      data=payload[index * chunk_bytes:(index + 1) * chunk_bytes])
        if index == 0:
            fields.update(round=round_index, weight=weight, scale=scale, algorithm=algorithm)
        frames.append(pb.GossipFrame(update=fields))
    return frames


def kinds(frames) -> list[str]:
    return [f.WhichOneof("frame") + (str(len(f.batch.updates)) if f.WhichOneof("frame") == "batch" else "")
            for f in frames]


def payloads_after_reassembly(frames) -> list[tuple[int, bytes]]:
    reassembler = Reassembler(max_chunk_bytes=1 << 20, max_payload_bytes=1 << 24)
    out = []
    for frame in frames:
        updates = frame.batch.updates if frame.WhichOneof("frame") == "batch" else [frame.update]
        for update in updates:
            done = reassembler.feed(update, update.data)
            if done is not None:
                out.append((done.seq, done.payload))
    return out


def test_a_lone_update_is_framed_exactly_as_its_chunks() -> None:
    """With one update queued the frames (and so the byte count) are that update's chunks alone: the simulator's."""
    msg = Out(7, b"x" * 100)
    for chunk_bytes in (16, 100, 4096):
        frames = frames_of(wire.update_frames([msg], "choco", chunk_bytes))
        chunks = protobuf_chunks(7, 3, 0.25, 0.5, "choco", msg.payload, chunk_bytes)
        assert [f.SerializeToString() for f in frames] == [f.SerializeToString() for f in chunks]


def test_small_updates_share_batches_bounded_by_chunk_bytes() -> None:
    msgs = [Out(seq, bytes([seq]) * 300) for seq in range(1, 8)]
    frames = frames_of(wire.update_frames(msgs, "choco", chunk_bytes=1000))  # 3 x 300 fit, a 4th would not
    assert kinds(frames) == ["batch3", "batch3", "update"]
    assert payloads_after_reassembly(frames) == [(m.seq, m.payload) for m in msgs]
    first = frames[0].batch.updates[0]
    assert (first.round, first.weight, first.scale, first.algorithm) == (3, 0.25, 0.5, "choco")


def test_a_large_update_goes_as_its_own_chunks_between_batches() -> None:
    msgs = [Out(1, b"a" * 10), Out(2, b"b" * 10), Out(3, b"c" * 2500), Out(4, b"d" * 10)]
    frames = frames_of(wire.update_frames(msgs, "sgp", chunk_bytes=1000))
    assert kinds(frames) == ["batch2", "update", "update", "update", "update"]
    assert [f.update.chunk_count for f in frames[1:4]] == [3, 3, 3]
    assert payloads_after_reassembly(frames) == [(m.seq, m.payload) for m in msgs]


@pytest.mark.parametrize("count", [MAX_WINDOW, MAX_WINDOW + 1])
def test_a_batch_never_holds_more_than_the_largest_window(count: int) -> None:
    frames = frames_of(wire.update_frames([Out(seq, b"z") for seq in range(1, count + 1)], "choco",
                                          chunk_bytes=1 << 20))
    assert max(len(f.batch.updates) for f in frames) == MAX_WINDOW
    assert sum(len(f.batch.updates) or 1 for f in frames) == count


def test_batch_bytes_bound_a_batch_apart_from_chunk_bytes() -> None:
    msgs = [Out(seq, bytes([seq]) * 300) for seq in range(1, 8)]
    frames = frames_of(wire.update_frames(msgs, "choco", chunk_bytes=400, batch_bytes=1500))  # 5 x 300 fit
    assert kinds(frames) == ["batch5", "batch2"]
    assert payloads_after_reassembly(frames) == [(m.seq, m.payload) for m in msgs]
    frames = frames_of(wire.update_frames([Out(1, b"a" * 10), Out(2, b"b" * 500), Out(3, b"c" * 10)], "choco",
                                          chunk_bytes=400, batch_bytes=1500))  # an update over chunk_bytes: chunks
    assert kinds(frames) == ["update", "update", "update", "update"]


@pytest.mark.parametrize("size", [0, 1, 127, 128, 300, 16383, 16384, 70000])
def test_the_encoded_frames_are_protobufs_own_bytes(size: int) -> None:
    """The sender encodes frames itself (one copy of each payload); they must equal protobuf's serialization, so
    the byte count (their length) is the one the simulator takes from ByteSize()."""
    payload = bytes(range(256)) * (size // 256) + bytes(size % 256)
    for chunk_bytes in (100, 1 << 20):
        (_, encoded), = wire.update_frames([Out(2**40 + 3, payload, round=2**33, weight=1e-300, scale=1.0)],
                                           "deepsqueeze", chunk_bytes)
        chunks = protobuf_chunks(2**40 + 3, 2**33, 1e-300, 1.0, "deepsqueeze", payload, chunk_bytes)
        assert encoded == [f.SerializeToString() for f in chunks]
        assert [len(data) for data in encoded] == [f.ByteSize() for f in chunks]
    msgs = [Out(seq, payload[:seq * 7]) for seq in range(1, 5)]
    (_, [data]), = wire.update_frames(msgs, "choco", chunk_bytes=1 << 20)
    expected = pb.GossipFrame()
    for m in msgs:
        expected.batch.updates.add(seq=m.seq, round=m.round, weight=m.weight, scale=m.scale, algorithm="choco",
                                   chunk_index=0, chunk_count=1, total_length=len(m.payload), data=m.payload)
    assert data == expected.SerializeToString()
