"""wire.update_frames: which frames carry a sender's queued updates (batches of whole updates, chunks of large
ones) - and that the receiver's reassembly gets every payload back, in order."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from peer.gossip.ledger import MAX_WINDOW
from peer.net import wire
from peer.net.reassembly import Reassembler


@dataclass
class Out:
    seq: int
    payload: bytes
    round: int = 3
    weight: float = 0.25
    scale: float = 0.5


def frames_of(groups) -> list:
    """The frames of update_frames' groups, in order (each group's updates are those its frames carry)."""
    out = []
    for updates, frames in groups:
        carried = [u.seq for f in frames for u in (f.batch.updates if f.WhichOneof("frame") == "batch"
                                                  else [f.update])]
        assert sorted(set(carried)) == [u.seq for u in updates]
        out.extend(frames)
    return out


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
    """With one update queued the frames (and so the byte count) are those of update_chunks: the simulator's."""
    msg = Out(7, b"x" * 100)
    for chunk_bytes in (16, 100, 4096):
        frames = frames_of(wire.update_frames([msg], "choco", chunk_bytes))
        chunks = wire.update_chunks(7, 3, 0.25, 0.5, "choco", msg.payload, chunk_bytes)
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
