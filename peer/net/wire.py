"""Conversions between protobuf messages and the engine's plain dataclasses (no I/O, no policy)."""

from __future__ import annotations

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
        data = bytes(view[index * chunk_bytes:(index + 1) * chunk_bytes])
        if index == 0:
            update = pb.Update(seq=seq, round=round_index, weight=weight, scale=scale, algorithm=algorithm,
                               chunk_index=0, chunk_count=count, total_length=len(payload), data=data)
        else:
            update = pb.Update(seq=seq, chunk_index=index, chunk_count=count, total_length=len(payload), data=data)
        frames.append(pb.GossipFrame(update=update))
    return frames
