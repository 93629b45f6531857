"""Conversions between protobuf messages and the engine's plain dataclasses (no I/O, no policy)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar

from peer.gossip import ledger
from peer.net.api import Identity
from peer.net.proto.lpdl.v1 import peer_pb2 as pb


def identity_to_pb(identity: Identity) -> pb.PeerIdentity:
    return pb.PeerIdentity(peer_id=identity.peer_id, protocol_version=identity.protocol_version,
                           fingerprint=identity.fingerprint, fleet=identity.fleet,
                           listen_addr=identity.listen_addr, algorithm=identity.algorithm)


def identity_from_pb(msg: pb.PeerIdentity) -> Identity:
    return Identity(peer_id=msg.peer_id, protocol_version=msg.protocol_version, fingerprint=msg.fingerprint,
                    fleet=msg.fleet, listen_addr=msg.listen_addr, algorithm=msg.algorithm)


def hello_frame(sender: Identity, receiver_id: str, hello: ledger.Hello) -> pb.GossipFrame:
    return pb.GossipFrame(hello=pb.Hello(sender=identity_to_pb(sender), receiver_id=receiver_id,
                                         next_seq=hello.next_seq, first_in_flight=hello.first_in_flight,
                                         replica_digests=list(hello.replica_digests)))


def hello_from_pb(msg: pb.Hello) -> ledger.Hello:
    return ledger.Hello(next_seq=msg.next_seq, first_in_flight=msg.first_in_flight,
                        replica_digests=tuple(msg.replica_digests))


def reply_to_pb(reply: ledger.HelloReply, receiver: Identity) -> pb.GossipReply:
    return pb.GossipReply(hello_reply=pb.HelloReply(last_applied=reply.last_applied, fence=reply.fence,
                                                    reset=reply.reset, receiver=identity_to_pb(receiver)))


def reply_from_pb(msg: pb.HelloReply) -> ledger.HelloReply:
    return ledger.HelloReply(last_applied=msg.last_applied, fence=msg.fence, reset=msg.reset)


def notice_frame(quarantined: Sequence[str]) -> bytes:
    """The serialized QuarantineNotice frame naming the peers ``quarantined`` (protocol 6; sent to every live peer since 7)."""
    frame: bytes = pb.GossipFrame(notice=pb.QuarantineNotice(quarantined=list(quarantined))).SerializeToString()
    return frame


def probe_frame(sketch: bytes, round_index: int) -> bytes:
    """The serialized ConsensusProbe frame carrying the count-sketch ``sketch`` of the sender's model (protocol 9,
    peer/gossip/sketch.py) in its phase round ``round_index``."""
    frame: bytes = pb.GossipFrame(probe=pb.ConsensusProbe(sketch=sketch, round=round_index)).SerializeToString()
    return frame


# Field keys of the frames the sender encodes itself (proto/lpdl/v1/peer.proto): (field number << 3) | 2.
_FRAME_UPDATE = b"\x12"      # GossipFrame.update = 2
_FRAME_BATCH = b"\x1a"       # GossipFrame.batch = 3
_BATCH_UPDATES = b"\x0a"     # UpdateBatch.updates = 1
_UPDATE_DATA = b"\x4a"       # Update.data = 9, the last field


_SMALL_VARINTS = [bytes((n,)) for n in range(0x80)]


def _varint(n: int) -> bytes:
    if n < 0x80:
        return _SMALL_VARINTS[n]
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _update_parts(head: bytes, data: bytes | memoryview) -> tuple[list[bytes | memoryview], int]:
    """(parts, their total length) of a serialized Update: ``head`` is protobuf's serialization of every field but
    data (a few dozen bytes), data is appended as the last field (number 9) - byte for byte what SerializeToString
    writes (fields in number order, an empty bytes field left out), without copying the payload into a message."""
    size = len(data)
    if not size:
        return [head], len(head)
    length = _varint(size)
    return [head, _UPDATE_DATA, length, data], len(head) + 1 + len(length) + size


def _frame(key: bytes, parts: list[bytes | memoryview], size: int) -> bytes:
    """``parts`` (``size`` bytes in all) as the one field ``key`` of a GossipFrame, serialized: the payload bytes
    are copied once."""
    return b"".join([key, _varint(size), *parts])


def _chunk_head(seq: int, round_index: int, weight: float, scale: float, algorithm: str, payload_length: int,
                index: int, count: int) -> pb.Update:
    """An Update chunk's fields but data: the first chunk carries every field; later chunks repeat only seq, index,
    count and total_length (the receiver checks those for consistency), a few bytes of overhead per chunk."""
    if index == 0:
        return pb.Update(seq=seq, chunk_index=index, chunk_count=count, total_length=payload_length,
                         round=round_index, weight=weight, scale=scale, algorithm=algorithm)
    return pb.Update(seq=seq, chunk_index=index, chunk_count=count, total_length=payload_length)


def _chunk_frames(seq: int, round_index: int, weight: float, scale: float, algorithm: str, payload: bytes,
                  chunk_bytes: int) -> list[bytes]:
    """One update cut into serialized Update frames of at most ``chunk_bytes`` payload bytes each."""
    view = memoryview(payload)
    count = max(1, -(-len(payload) // chunk_bytes))
    frames = []
    for index in range(count):
        head = _chunk_head(seq, round_index, weight, scale, algorithm, len(payload), index,
                           count).SerializeToString()
        parts, size = _update_parts(head, view[index * chunk_bytes:(index + 1) * chunk_bytes] if count > 1
                                    else payload)
        frames.append(_frame(_FRAME_UPDATE, parts, size))
    return frames


class WholeUpdate(Protocol):
    """What a frame needs of one outbound update (the engine's OutMessage has these)."""

    seq: int
    round: int
    weight: float
    scale: float
    payload: bytes


AnyWholeUpdate = TypeVar("AnyWholeUpdate", bound=WholeUpdate)


def update_frames(updates: Sequence[AnyWholeUpdate], algorithm: str, chunk_bytes: int,
                  batch_bytes: int | None = None) -> list[tuple[list[AnyWholeUpdate], list[bytes]]]:
    """The serialized frames that carry ``updates`` in order, as groups ``(the updates, their frames)``:
    consecutive updates of at most ``chunk_bytes`` each share one UpdateBatch frame (at most ledger.MAX_WINDOW of
    them, payloads summing to at most ``batch_bytes``, default ``chunk_bytes``); a lone one goes as a plain Update
    frame, a larger one as its own chunks. The sender stamps each group when it starts writing it
    (its Ack deadline).

    Why: grpc.aio costs about 0.2-0.3 ms of CPU per stream message whatever its size, so a sender whose queue holds
    several small updates moves them in one message. With one update queued the frames are those of that update
    alone - what the simulator sends (peer/sim/transport.py) - so a daemon that never lags counts its bytes.
    Frames are encoded here rather than by protobuf's serializer (which copies every payload into the message, then
    grows its output buffer by copying again): the bytes are identical (tests), the payload is copied once.
    """
    limit = chunk_bytes if batch_bytes is None else batch_bytes
    groups: list[tuple[list[AnyWholeUpdate], list[bytes]]] = []
    batch: list[AnyWholeUpdate] = []
    batch_size = 0

    def flush() -> None:
        if len(batch) == 1:
            first = batch[0]
            groups.append(([first], _chunk_frames(first.seq, first.round, first.weight, first.scale, algorithm,
                                                  first.payload, chunk_bytes)))
        elif batch:
            parts: list[bytes | memoryview] = []
            total = 0
            for update in batch:
                head = pb.Update(seq=update.seq, round=update.round, weight=update.weight, scale=update.scale,
                                 algorithm=algorithm, chunk_index=0, chunk_count=1,
                                 total_length=len(update.payload)).SerializeToString()
                inner, size = _update_parts(head, update.payload)
                length = _varint(size)
                parts += [_BATCH_UPDATES, length, *inner]
                total += 1 + len(length) + size
            groups.append((list(batch), [_frame(_FRAME_BATCH, parts, total)]))
        batch.clear()

    for update in updates:
        size = len(update.payload)
        if batch and (size > chunk_bytes or batch_size + size > limit or len(batch) == ledger.MAX_WINDOW):
            flush()
            batch_size = 0
        batch.append(update)
        batch_size += size
        if size > chunk_bytes:  # goes as its own chunks: nothing joins it
            flush()
            batch_size = 0
    flush()
    return groups
