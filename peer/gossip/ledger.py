"""Per-edge sequence bookkeeping for exactly-once mass transfer (DESIGN.md 3), as pure data and pure decisions.

Every directed edge ``i -> j`` has an :class:`OutboundEdge` at the sender and an :class:`InboundEdge` at the
receiver. The sender numbers messages 1, 2, ...; at most one is in flight (unacknowledged) per edge. The receiver
applies a message iff its seq is above both the last applied seq and the fence, and records that seq together with
the state change.

When a stream breaks, the sender does not know whether its in-flight message was applied. On reconnect it sends a
hello naming that message's seq (``retract_seq``); the receiver answers, atomically, with its last applied seq and,
if that message was NOT applied, raises its fence to it so that a late copy is dropped forever. The sender then
either forgets the message (delivered) or takes its mass back (retracted). Both outcomes keep the invariant
``sum x + in-flight mass`` and ``sum w + in-flight weight`` constant.

An edge whose history is in doubt (one end restarted from an older checkpoint: sender's seq behind the receiver's,
or the Choco replicas differ) is reset on both ends: replicas become zero and the receiver fences every seq it has
seen or been told of, so the sender resumes numbering above the fence. That is consistent because the mass a Choco
message moves is computed from the replica itself.

Nothing here touches sockets or threads; the daemon's transport and the simulator's in-memory transport both call
these functions.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Verdict(enum.Enum):
    """What the sender must do with its in-flight message after a handshake."""

    NOTHING = "nothing"  # no message was in flight
    DELIVERED = "delivered"  # receiver applied it: forget it
    RETRACTED = "retracted"  # receiver never applied it and fenced it: take the mass back


@dataclass
class OutboundEdge:
    """Sender-side state of one directed edge.

    Attributes:
        next_seq: the seq the next message gets (starts at 1).
        in_flight_seq: seq of the unacknowledged message, 0 if none.
    """

    next_seq: int = 1
    in_flight_seq: int = 0

    @property
    def busy(self) -> bool:
        """True while a message waits for its ack: the edge is skipped this round."""
        return self.in_flight_seq != 0

    def issue(self) -> int:
        """Reserve the next seq for a new message; the edge must be idle."""
        if self.busy:
            raise RuntimeError("edge already has a message in flight")
        seq = self.next_seq
        self.next_seq += 1
        self.in_flight_seq = seq
        return seq

    def settle(self) -> None:
        """The in-flight message is resolved (acked, delivered or retracted)."""
        self.in_flight_seq = 0

    def resume_after(self, fence: int) -> None:
        """After an edge reset: number new messages above the receiver's fence."""
        self.next_seq = max(self.next_seq, fence + 1)


@dataclass
class InboundEdge:
    """Receiver-side state of one directed edge.

    Attributes:
        last_applied: seq of the last message whose mass was applied (0 = none).
        fence: messages with seq <= fence are dropped (retracted by their sender).
    """

    last_applied: int = 0
    fence: int = 0

    def accepts(self, seq: int) -> bool:
        """Whether a message with this seq is new (not a duplicate, not retracted)."""
        return seq > max(self.last_applied, self.fence)

    def record_applied(self, seq: int) -> None:
        """Call together with the state change the message caused."""
        self.last_applied = seq

    def reset(self, hello: "Hello") -> None:
        """Fence everything seen or announced, so no message of the old history is ever applied."""
        self.fence = max(self.fence, self.last_applied, hello.retract_seq, hello.next_seq - 1)


@dataclass(frozen=True)
class Hello:
    """What a sender tells a receiver when (re)opening an edge.

    Attributes:
        next_seq: the sender's next seq; behind the receiver's history means the sender lost state.
        retract_seq: seq of the sender's in-flight message (0 if none).
        replica_digest: digest of the sender's Choco replica for this edge as it is if the in-flight message was
            NOT applied (b"" when the algorithm has none).
        replica_digest_applied: the digest if the in-flight message WAS applied (equal to ``replica_digest`` when
            nothing is in flight).
    """

    next_seq: int
    retract_seq: int
    replica_digest: bytes = b""
    replica_digest_applied: bytes = b""


@dataclass(frozen=True)
class HelloReply:
    """The receiver's answer.

    Attributes:
        last_applied: the receiver's last applied seq on this edge (decides the in-flight verdict).
        fence: the receiver's fence after the hello; the sender numbers new messages above it.
        reset: both ends must zero their replicas of this edge, after the sender settled its in-flight message.
    """

    last_applied: int
    fence: int
    reset: bool


def answer_hello(edge: InboundEdge, hello: Hello, local_replica_digest: bytes) -> HelloReply:
    """Receiver side of the handshake; mutates ``edge`` (call under the edge's lock, atomically with its state).

    The edge is reset when the sender is behind (it would reuse seqs the receiver already applied) or when the
    replicas differ. An in-flight message that was not applied is fenced, so a late copy is never applied.
    """
    sender_behind = hello.next_seq <= edge.last_applied
    applied = 0 < hello.retract_seq <= edge.last_applied
    expected = hello.replica_digest_applied if applied else hello.replica_digest
    replica_mismatch = expected != local_replica_digest
    reset = sender_behind or replica_mismatch
    if reset:
        edge.reset(hello)
    elif hello.retract_seq > edge.last_applied:
        edge.fence = max(edge.fence, hello.retract_seq)
    return HelloReply(last_applied=edge.last_applied, fence=edge.fence, reset=reset)


def judge_reply(edge: OutboundEdge, reply: HelloReply) -> Verdict:
    """Sender side: what to do with the in-flight message given the receiver's reply (does not mutate)."""
    if not edge.busy:
        return Verdict.NOTHING
    if edge.in_flight_seq <= reply.last_applied:
        return Verdict.DELIVERED
    return Verdict.RETRACTED
