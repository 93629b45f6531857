"""Conversions between protobuf messages and the engine's plain dataclasses (no I/O, no policy)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

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


def update_chunks(seq: int, round_index: int, weight: float, scale: float, algorithm: str, payload: bytes,
                  chunk_bytes: int) -> list[pb.GossipFrame]:
    """Cut one update into Update frames of at most ``chunk_bytes`` payload bytes each.

    The first chunk carries every field; later chunks repeat only seq, index, count and total_length (the
    receiver checks those for consistency) to keep per-chunk overhead at a few bytes.
    """
    view = memoryview(payload)
    count = max(1, -(-len(payload) // chunk_bytes))
    frames = []
    for index in range(count):
        data = payload if count == 1 else bytes(view[index * chunk_bytes:(index + 1) * chunk_bytes])
        fields = dict(seq=seq, chunk_index=index, chunk_count=count, total_length=len(payload), data=data)
        if index == 0:
            fields.update(round=round_index, weight=weight, scale=scale, algorithm=algorithm)
        frames.append(pb.GossipFrame(update=fields))  # built in place (a constructed Update would be copied)
    return frames


class WholeUpdate(Protocol):
    """What a frame needs of one outbound update (the engine's OutMessage has these)."""

    seq: int
    round: int
    weight: float
    scale: float
    payload: bytes


def update_frames(updates: Sequence[WholeUpdate], algorithm: str,
                  chunk_bytes: int) -> list[tuple[list[WholeUpdate], list[pb.GossipFrame]]]:
    """The frames that carry ``updates`` in order, as groups ``(the updates, their frames)``: consecutive updates
    that fit in ``chunk_bytes`` share one UpdateBatch frame (at most ledger.MAX_WINDOW of them, payloads summing to
    at most ``chunk_bytes``); a lone one goes as a plain Update frame, a larger one as its own chunks
    (update_chunks). The sender stamps each group when it starts writing it (its Ack deadline).

    Why: grpc.aio costs about 0.2-0.3 ms of CPU per stream message whatever its size, so a sender whose queue holds
    several small updates moves them in one message. With one update queued the frames are exactly those of
    update_chunks, so a daemon that never lags counts the same bytes as the simulator.
    """
    groups: list[tuple[list[WholeUpdate], list[pb.GossipFrame]]] = []
    batch: list[WholeUpdate] = []
    batch_bytes = 0

    def flush() -> None:
        if len(batch) == 1:
            first = batch[0]
            groups.append(([first], update_chunks(first.seq, first.round, first.weight, first.scale, algorithm,
                                                  first.payload, chunk_bytes)))
        elif batch:
            frame = pb.GossipFrame()
            for update in batch:  # built in place: a constructed Update passed in would be copied again
                frame.batch.updates.add(seq=update.seq, round=update.round, weight=update.weight,
                                        scale=update.scale, algorithm=algorithm, chunk_index=0, chunk_count=1,
                                        total_length=len(update.payload), data=update.payload)
            groups.append((list(batch), [frame]))
        batch.clear()

    for update in updates:
        size = len(update.payload)
        if batch and (size > chunk_bytes or batch_bytes + size > chunk_bytes or len(batch) == ledger.MAX_WINDOW):
            flush()
            batch_bytes = 0
        batch.append(update)
        batch_bytes += size
    flush()
    return groups
