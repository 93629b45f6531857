"""Strict reassembly of one stream's Update chunks into complete updates (pure logic, no I/O).

Rules (anything else raises :class:`ChunkError`, and the caller drops the partial update - nothing was applied):
    - chunk 0 opens an update; its seq, round, weight, scale and algorithm describe the whole update;
    - chunk_count >= 1 and total_length <= max_payload_bytes; every later chunk repeats seq, chunk_count and
      total_length exactly and has chunk_index = previous + 1;
    - each chunk holds 1 .. max_chunk_bytes bytes (a single empty chunk is allowed for an empty payload), and the
      bytes received never exceed total_length; at the last chunk they equal it;
    - a new update may only start after the previous one completed.
"""

from __future__ import annotations

from dataclasses import dataclass

from peer.net.proto.lpdl.v1 import peer_pb2 as pb


class ChunkError(ValueError):
    """A chunk broke the rules above; ``reason`` is a short counter key."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class CompleteUpdate:
    """A reassembled update (weight and scale dimensionless, payload = codec bytes)."""

    seq: int
    round: int
    weight: float
    scale: float
    algorithm: str
    payload: bytes


class Reassembler:
    """Reassembles the updates of one stream, one at a time.

    Args:
        max_chunk_bytes: largest accepted chunk (bytes).
        max_payload_bytes: largest accepted complete update (bytes).
    """

    def __init__(self, max_chunk_bytes: int, max_payload_bytes: int) -> None:
        self.max_chunk_bytes = max_chunk_bytes
        self.max_payload_bytes = max_payload_bytes
        self._head: pb.Update | None = None
        self._parts: list[bytes] = []
        self._received = 0

    @property
    def partial(self) -> pb.Update | None:
        """Chunk 0 of the update being reassembled, or None between updates."""
        return self._head

    @property
    def buffered(self) -> int:
        """Payload bytes held for the update being reassembled (0 between updates)."""
        return self._received

    @property
    def received_chunks(self) -> int:
        return len(self._parts)

    def feed(self, chunk: pb.Update, data: bytes) -> CompleteUpdate | None:
        """Take one chunk whose payload slice is ``data`` (``chunk.data`` read ONCE by the caller: each read of a
        protobuf bytes field is a fresh copy); returns the update when its last chunk arrived. Raises ChunkError
        (and resets)."""
        try:
            return self._feed(chunk, data)
        except ChunkError:
            self.reset()
            raise

    def reset(self) -> None:
        """Drop any partial update."""
        self._head, self._parts, self._received = None, [], 0

    def _feed(self, chunk: pb.Update, data: bytes) -> CompleteUpdate | None:
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
            head = self._head = chunk
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
        self._parts.append(data)
        self._received += size
        if len(self._parts) < head.chunk_count:
            return None
        if self._received != head.total_length:
            raise ChunkError("length_mismatch", f"update seq {head.seq}: {self._received} bytes in "
                                                f"{head.chunk_count} chunks, total_length says {head.total_length}")
        done = CompleteUpdate(seq=head.seq, round=head.round, weight=head.weight, scale=head.scale,
                              algorithm=head.algorithm, payload=b"".join(self._parts))
        self.reset()
        return done
