"""Strict reassembly of one stream's Update chunks into complete updates (pure logic, no I/O).

Rules (anything else raises :class:`ChunkError`, and the caller drops the partial update - nothing was applied):
    - chunk 0 opens an update; its seq, round, weight, scale and algorithm describe the whole update;
    - chunk_count >= 1 and total_length <= max_payload_bytes; every later chunk repeats seq, chunk_count and
      total_length exactly and has chunk_index = previous + 1;
    - each chunk holds 1 .. max_chunk_bytes bytes (a single empty chunk is allowed for an empty payload), and the
      bytes received never exceed total_length; at the last chunk they equal it;
    - a new update may only start after the previous one completed.

Payloads: a chunk's data may be any bytes-like object (the server hands memoryview slices of the received frames,
peer/net/frames.py). An update of one chunk is passed on as that very object, uncopied; the chunks of a larger
update are copied as they arrive (so a partial update never pins whole received frames, whose size the buffer
budget does not see) and joined once at the last.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

from peer.errors import PeerError


class Chunk(Protocol):
    """The fields of one Update chunk that reassembly reads (pb.Update and frames.UpdateView have them)."""

    seq: int
    round: int
    weight: float
    scale: float
    algorithm: str
    chunk_index: int
    chunk_count: int
    total_length: int


class Head(NamedTuple):
    """Chunk 0's fields of the update being reassembled (its data is not kept here)."""

    seq: int
    round: int
    weight: float
    scale: float
    algorithm: str
    chunk_count: int
    total_length: int


class ChunkError(PeerError, ValueError):
    """A chunk broke the rules above; ``reason`` is a short counter key."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message, reason=reason)


@dataclass(frozen=True)
class CompleteUpdate:
    """A reassembled update (weight and scale dimensionless, payload = codec bytes: a read-only bytes-like object,
    a memoryview into the received frame for an update of one chunk - valid as long as it is referenced)."""

    seq: int
    round: int
    weight: float
    scale: float
    algorithm: str
    payload: bytes | memoryview


class Reassembler:
    """Reassembles the updates of one stream, one at a time.

    Args:
        max_chunk_bytes: largest accepted chunk (bytes).
        max_payload_bytes: largest accepted complete update (bytes).
    """

    def __init__(self, max_chunk_bytes: int, max_payload_bytes: int) -> None:
        self.max_chunk_bytes = max_chunk_bytes
        self.max_payload_bytes = max_payload_bytes
        self._head: Head | None = None
        self._parts: list[bytes | memoryview] = []
        self._received = 0

    @property
    def partial(self) -> Head | None:
        """Chunk 0 of the update being reassembled, or None between updates."""
        return self._head

    @property
    def buffered(self) -> int:
        """Payload bytes held for the update being reassembled (0 between updates)."""
        return self._received

    @property
    def received_chunks(self) -> int:
        return len(self._parts)

    def feed(self, chunk: Chunk, data: bytes | memoryview) -> CompleteUpdate | None:
        """Take one chunk whose payload slice is ``data`` (bytes-like; ``chunk.data`` read ONCE by the caller: each
        read of a protobuf bytes field is a fresh copy); returns the update when its last chunk arrived. Raises
        ChunkError (and resets)."""
        try:
            return self._feed(chunk, data)
        except ChunkError:
            self.reset()
            raise

    def reset(self) -> None:
        """Drop any partial update."""
        self._head, self._parts, self._received = None, [], 0

    def _feed(self, chunk: Chunk, data: bytes | memoryview) -> CompleteUpdate | None:
        size = len(data)
        if size > self.max_chunk_bytes:
            raise ChunkError("chunk_too_large", f"chunk {chunk.chunk_index} of seq {chunk.seq} holds {size} bytes, "
                                                f"max_chunk_bytes is {self.max_chunk_bytes}")
        head = self._head
        if head is None:
            if chunk.chunk_index != 0:
                raise ChunkError("chunk_order", f"update seq {chunk.seq} starts at chunk_index {chunk.chunk_index}, "
                                                f"expected 0")
            if chunk.chunk_count < 1:
                raise ChunkError("chunk_count", f"update seq {chunk.seq} has chunk_count {chunk.chunk_count}, "
                                                f"expected >= 1")
            if chunk.total_length > self.max_payload_bytes:
                raise ChunkError("payload_too_large", f"update seq {chunk.seq} announces total_length "
                                                      f"{chunk.total_length} bytes, max_payload_bytes is "
                                                      f"{self.max_payload_bytes}")
            if chunk.chunk_count > max(1, chunk.total_length):
                raise ChunkError("chunk_count", f"update seq {chunk.seq}: chunk_count {chunk.chunk_count} exceeds "
                                                f"total_length {chunk.total_length} (chunks must not be empty)")
            head = self._head = Head(chunk.seq, chunk.round, chunk.weight, chunk.scale, chunk.algorithm,
                                     chunk.chunk_count, chunk.total_length)
        else:
            expected = len(self._parts)
            if chunk.chunk_index != expected:
                raise ChunkError("chunk_order", f"update seq {head.seq}: got chunk_index {chunk.chunk_index}, "
                                                f"expected {expected}")
            for field in ("seq", "chunk_count", "total_length"):
                if getattr(chunk, field) != getattr(head, field):
                    raise ChunkError("chunk_mismatch", f"update seq {head.seq} chunk {chunk.chunk_index}: {field} "
                                                       f"{getattr(chunk, field)} != {getattr(head, field)} of chunk 0")
        if size == 0 and head.total_length > 0:
            raise ChunkError("empty_chunk", f"update seq {head.seq} chunk {chunk.chunk_index} is empty")
        if self._received + size > head.total_length:
            raise ChunkError("length_mismatch", f"update seq {head.seq}: chunks hold more than total_length "
                                                f"{head.total_length} bytes")
        self._received += size
        if len(self._parts) + 1 < head.chunk_count:
            self._parts.append(data if type(data) is bytes else bytes(data))  # held across frames: a copy
            return None
        self._parts.append(data)
        if self._received != head.total_length:
            raise ChunkError("length_mismatch", f"update seq {head.seq}: {self._received} bytes in "
                                                f"{head.chunk_count} chunks, total_length says {head.total_length}")
        payload = data if head.chunk_count == 1 else b"".join(self._parts)
        done = CompleteUpdate(seq=head.seq, round=head.round, weight=head.weight, scale=head.scale,
                              algorithm=head.algorithm, payload=payload)
        self.reset()
        return done
