"""Per-edge sequence bookkeeping for exactly-once mass transfer (docs/design.md#exactly-once-mass-transfer), as pure
data and pure decisions.

Every directed edge ``i -> j`` has an :class:`OutboundEdge` at the sender and an :class:`InboundEdge` at the
receiver. The sender numbers messages 1, 2, ...; up to ``window`` of them may be *in flight* (sent, not yet
settled) at once - :attr:`OutboundEdge.in_flight` is the one place that knows which. The receiver applies a message
iff its seq is above both the last applied seq and the fence, and records that seq together with the state change.
Transports deliver one edge's messages in order (a gRPC stream, the simulator's per-edge FIFO), so what a receiver
has applied is always a prefix of what was sent, and an Ack for seq s settles every in-flight seq <= s.

When a stream breaks, the sender does not know which in-flight messages were applied. On reconnect its
:class:`Hello` names the in-flight range; the receiver answers, atomically, with its last applied seq and, if some
were NOT applied, raises its fence above them so a late copy is dropped forever. :func:`settle` then splits the
in-flight messages into delivered (forget) and retracted (take the mass back). Both keep the invariant
``sum x + in-flight mass`` and ``sum w + in-flight weight`` constant.

The reply is clamped to what the Hello announced: a message issued after the Hello was built (it never went out on
the new stream) is always retracted, and a receiver that claims more than was announced cannot make the sender
forget mass it never sent.

An edge whose history is in doubt (one end restarted from an older checkpoint: sender's seq behind the receiver's,
or the Choco replicas differ) is reset on both ends: replicas return to their common start and the receiver fences
every seq it has seen or been told of, so the sender resumes numbering above the fence. That is consistent because
the mass a Choco message moves is computed from the replica itself.

Nothing here touches sockets, threads or tensors; the gRPC transport and the simulator's transport both call it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from peer.errors import PeerError

#: Largest window a Hello may announce (messages in flight on one edge); bounds the digests a Hello carries.
MAX_WINDOW = 64
#: Default window (``gossip.window``, and the engine's); why 32: docs/decisions/window.md#the-count.
DEFAULT_WINDOW = 32
#: Default of the most peers one peer keeps edge state for (``net.max_peers``, and the engine's): the 64 peers of the
#: largest fleet ``lpdl-peer fleet`` and ``simulate`` run.
DEFAULT_MAX_PEERS = 64
#: Sequence numbers stay below this (the wire carries uint64; +1 arithmetic must never overflow).
MAX_SEQ = 2**62
#: Farthest a Hello, a reply or an update may move an edge's numbers past what the other end already knows: about a
#: million messages, far more than an honest end can be ahead (its in-flight window, or the messages since the other
#: end's last checkpoint), far less than MAX_SEQ, so no single message can exhaust an edge's sequence space.
SEQ_WINDOW = 2**20

Record = TypeVar("Record")


class Verdict(enum.Enum):
    """What happens to an in-flight message once it is settled."""

    DELIVERED = "delivered"  # receiver applied it: forget it
    RETRACTED = "retracted"  # receiver never applied it and fenced it: take the mass back


class HelloError(PeerError, ValueError):
    """A Hello that no honest sender builds (range inverted, window too large, wrong digest count, numbers far
    beyond the receiver's), or a reply that no honest receiver gives; the edge is unchanged."""

    default_reason = "bad_hello"


@dataclass(frozen=True)
class Hello:
    """What a sender tells a receiver when (re)opening an edge.

    Attributes:
        next_seq: the sender's next seq; at or behind the receiver's last applied seq means the sender lost state.
        first_in_flight: lowest unsettled seq (0 if none); the in-flight range is ``[first_in_flight, next_seq)``.
        replica_digests: for algorithms with edge replicas (Choco), the sender's replica digest after the first
            ``i`` in-flight messages were applied, for ``i = 0 .. len(range)``; empty otherwise.
    """

    next_seq: int
    first_in_flight: int = 0
    replica_digests: tuple[bytes, ...] = ()

    @property
    def announced(self) -> int:
        """How many in-flight messages the Hello names."""
        return self.next_seq - self.first_in_flight if self.first_in_flight else 0

    def validate(self) -> None:
        """Raise :class:`HelloError` unless an honest sender could have built this Hello."""
        if not 1 <= self.next_seq < MAX_SEQ:
            raise HelloError(f"next_seq {self.next_seq} outside [1, {MAX_SEQ})")
        if self.first_in_flight and not 1 <= self.first_in_flight < self.next_seq:
            raise HelloError(f"in-flight range [{self.first_in_flight}, {self.next_seq}) is empty or inverted")
        if self.announced > MAX_WINDOW:
            raise HelloError(f"{self.announced} messages in flight exceeds the largest window {MAX_WINDOW}")
        if self.replica_digests and len(self.replica_digests) != self.announced + 1:
            raise HelloError(f"{len(self.replica_digests)} replica digests for {self.announced} in-flight "
                             f"messages (expected {self.announced + 1})")


@dataclass(frozen=True)
class HelloReply:
    """The receiver's answer.

    Attributes:
        last_applied: the receiver's last applied seq on this edge (decides every in-flight verdict).
        fence: the receiver's fence after the hello; the sender numbers new messages above it.
        reset: both ends return their replicas of this edge to the common start, after the sender settled.
    """

    last_applied: int
    fence: int
    reset: bool


@dataclass
class Settlement(Generic[Record]):
    """In-flight messages settled by an Ack or a handshake, with the sender's records.

    ``retracted`` is newest first: undoing in that order restores per-edge state (Choco replicas) bit for bit.
    """

    delivered: list[tuple[int, Record]] = field(default_factory=list)
    retracted: list[tuple[int, Record]] = field(default_factory=list)
    reset: bool = False

    def seqs(self) -> set[int]:
        return {seq for seq, _ in self.delivered} | {seq for seq, _ in self.retracted}


@dataclass
class OutboundEdge(Generic[Record]):
    """Sender-side state of one directed edge.

    Attributes:
        next_seq: the seq the next message gets (starts at 1).
        in_flight: unsettled messages, seq -> the sender's record of the mass it moved (ascending seq order).
    """

    next_seq: int = 1
    in_flight: dict[int, Record] = field(default_factory=dict)

    def has_room(self, window: int) -> bool:
        """Whether another message may be issued (fewer than ``window`` in flight)."""
        return len(self.in_flight) < window

    def issue(self, record: Record, window: int) -> int:
        """Put a new message in flight and return its seq; the edge must have room."""
        if not self.has_room(window):
            raise RuntimeError(f"edge already has {len(self.in_flight)} messages in flight (window {window})")
        seq = self.next_seq
        self.next_seq += 1
        self.in_flight[seq] = record
        return seq

    def acknowledge(self, seq: int) -> Settlement[Record]:
        """An Ack for ``seq``: it and every earlier in-flight seq were applied (in-order delivery). Stale acks
        settle nothing."""
        delivered = [(s, self.in_flight.pop(s)) for s in [s for s in self.in_flight if s <= seq]]
        return Settlement(delivered=delivered)

    def hello(self, replica_digests: tuple[bytes, ...] = ()) -> Hello:
        """The Hello that (re)opens this edge, naming the in-flight range."""
        first = min(self.in_flight) if self.in_flight else 0
        return Hello(next_seq=self.next_seq, first_in_flight=first, replica_digests=replica_digests)

    def settle(self, hello: Hello, reply: HelloReply) -> Settlement[Record]:
        """Decide every in-flight message from the receiver's reply to ``hello`` (mutates the edge).

        The reply is clamped to the Hello: seqs up to ``min(reply.last_applied, hello.next_seq - 1)`` were
        delivered, all others (including any issued after the Hello was built) are retracted.
        """
        check_reply(hello, reply)
        cutoff = min(reply.last_applied, hello.next_seq - 1)
        settlement: Settlement[Record] = Settlement(reset=reply.reset)
        for seq in sorted(self.in_flight, reverse=True):
            record = self.in_flight.pop(seq)
            if seq <= cutoff:
                settlement.delivered.append((seq, record))
            else:
                settlement.retracted.append((seq, record))
        settlement.delivered.reverse()
        self.next_seq = max(self.next_seq, reply.fence + 1)
        return settlement


def check_reply(hello: Hello, reply: HelloReply) -> None:
    """Raise :class:`HelloError` for a reply no honest receiver gives to ``hello``: a fence or last applied seq more
    than :data:`SEQ_WINDOW` beyond the Hello's numbers would push the sender's seqs towards MAX_SEQ (an edge that can
    never handshake again). Settling nothing keeps the in-flight messages for the next, honest handshake."""
    for name, value in (("fence", reply.fence), ("last_applied", reply.last_applied)):
        if not 0 <= value < hello.next_seq + SEQ_WINDOW:
            raise HelloError(f"reply {name} {value} is more than {SEQ_WINDOW} beyond the Hello's next_seq "
                             f"{hello.next_seq}")


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

    def in_window(self, seq: int) -> bool:
        """Whether ``seq`` is within :data:`SEQ_WINDOW` of what this edge has seen (an update far beyond it would
        move ``last_applied`` towards MAX_SEQ and wedge the real sender's edge)."""
        return seq < min(MAX_SEQ, max(self.last_applied, self.fence) + 1 + SEQ_WINDOW)

    def record_applied(self, seq: int) -> None:
        """Call together with the state change the message caused."""
        self.last_applied = seq

    def answer(self, hello: Hello, local_replica_digest: bytes = b"") -> HelloReply:
        """Receiver side of the handshake (mutates the edge; call atomically with the receiver's state).

        The edge is reset when the sender is behind (it would reuse seqs already applied) or when the replica
        digest for the prefix of in-flight messages applied here differs from the receiver's. Announced messages
        not applied are fenced, so a late copy is never applied.

        Raises:
            HelloError: ``hello`` is malformed; the edge is unchanged.
        """
        hello.validate()
        known = max(self.last_applied, self.fence)
        if known and hello.next_seq > known + SEQ_WINDOW:
            raise HelloError(f"next_seq {hello.next_seq} is more than {SEQ_WINDOW} beyond this edge's last seq "
                             f"{known}")
        sender_behind = hello.next_seq <= self.last_applied
        applied = min(max(self.last_applied - hello.first_in_flight + 1, 0), hello.announced) if hello.announced else 0
        expected = hello.replica_digests[applied] if hello.replica_digests else b""
        reset = sender_behind or expected != local_replica_digest
        if reset:
            self.fence = max(self.fence, self.last_applied, hello.next_seq - 1)
        elif hello.announced and hello.next_seq - 1 > self.last_applied:
            self.fence = max(self.fence, hello.next_seq - 1)
        return HelloReply(last_applied=self.last_applied, fence=self.fence, reset=reset)
