"""Sending half of one directed Gossip edge as a pure state machine: committed messages and the receiver's replies
in; frames to write, and settlements out. No I/O, no clock of its own (callers pass ``now`` or a clock: seconds on
one monotonic clock), no logging: the gRPC edge sender (client.py) and the simulator's in-memory transport
(peer/sim/transport.py) are shells around it.

Exactly-once (docs/design.md#exactly-once-mass-transfer, peer/gossip/ledger.py): the peer subtracts a message's
mass when it commits it; the edge carries it; an Ack settles it and every earlier message of the edge (gate.on_ack). Up to the gossip window of
messages may be unsettled at once, so the stream is not bound to one ack round trip per update. Any break ends the
stream, and the next stream starts with a handshake whose reply settles every in-flight message
(gate.on_hello_reply: delivered, or mass taken back and the seq fenced at the receiver). A message is never resent:
after a handshake every message that was in flight is settled, and the edge drops any of them it still holds (its
floor) - including one committed while the handshake was under way, which the ledger's reply clamp always retracts.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sequence

from peer.errors import PeerError
from peer.gossip.algorithms import Sent
from peer.gossip.engine import OutMessage
from peer.gossip.ledger import Hello, HelloError, Settlement
from peer.net import wire
from peer.net.api import StreamGate
from peer.net.config import NetConfig
from peer.net.proto.lpdl.v1 import peer_pb2 as pb


class StreamBroken(PeerError):
    """The stream can no longer be trusted; reconnect and let the handshake settle."""

    default_reason = "stream_broken"


class Refused(StreamBroken):
    """The receiver refused the Hello or an update (code + reason + message from the wire)."""

    def __init__(self, refusal: pb.Refusal) -> None:
        super().__init__(f"{pb.RefusalCode.Name(refusal.code)} ({refusal.reason}): {refusal.message}",
                         reason=refusal.reason or pb.RefusalCode.Name(refusal.code))
        self.code = refusal.code


class OutboundStream:
    """The edge ``self -> receiver_id`` across its streams: messages queued, written and unacknowledged, and the
    floor below which every seq is settled.

    Args:
        gate: the sending peer (hello_for / on_hello_reply / on_ack).
        receiver_id: the receiver's peer id; a HelloReply from anyone else breaks the stream.
        config: chunk_bytes and batch_bytes (framing), ack_timeout_s.

    Usage: :meth:`hello` opens each stream and :meth:`on_reply` takes its HelloReply; then :meth:`frames` while
    :attr:`queued`, :meth:`on_reply` for each Ack, :meth:`check_ack_deadline` when :attr:`ack_deadline` passes.
    Every method raises :class:`StreamBroken` when the stream must end.
    """

    def __init__(self, gate: StreamGate, receiver_id: str, config: NetConfig) -> None:
        self.gate = gate
        self.receiver_id = receiver_id
        self.config = config
        self.open = False                       # handshaken: updates may be written
        self.ack_rtt_s: float | None = None     # last first-frame-written -> Ack round trip (seconds)
        self.handshakes = 0
        self.delivered = 0                      # updates settled by an Ack
        self.batched = 0                        # updates that went in an UpdateBatch with others (a lagging edge)
        self.settled: dict[str, int] = {"delivered": 0, "retracted": 0}  # settled by a handshake
        self._outbox: deque[OutMessage] = deque()   # submitted, not yet written on the current stream
        self._notices: deque[bytes] = deque()       # QuarantineNotice frames to write (no reply, never resent)
        self._probes: deque[bytes] = deque()        # ConsensusProbe frames to write (no reply, never resent)
        self._written: deque[tuple[OutMessage, float]] = deque()  # written on this stream (when), no Ack yet
        self._floor = 0                         # messages with seq <= floor are settled and never sent
        self._hello: Hello | None = None        # the Hello of the handshake under way

    @property
    def queued(self) -> bool:
        """Messages, notices or probes wait to be written."""
        return bool(self._outbox) or bool(self._notices) or bool(self._probes)

    @property
    def unacked(self) -> int:
        """Messages written on this stream and not acknowledged."""
        return len(self._written)

    @property
    def idle(self) -> bool:
        """Nothing queued, nothing awaiting an Ack."""
        return not self._outbox and not self._written

    @property
    def ack_deadline(self) -> float | None:
        """When the oldest unacknowledged message's Ack is due (the callers' clock, seconds), or None."""
        return self._written[0][1] + self.config.ack_timeout_s if self._written else None

    def submit(self, msg: OutMessage) -> bool:
        """Queue ``msg``; False if a handshake already settled it (it must never reach the receiver)."""
        if msg.receiver != self.receiver_id:
            raise ValueError(f"message for {msg.receiver!r} submitted to the edge to {self.receiver_id!r}")
        if msg.seq <= self._floor:
            return False
        self._outbox.append(msg)
        return True

    def notify(self, quarantined: Sequence[str]) -> None:
        """Queue a QuarantineNotice naming ``quarantined`` (written with the next frames; a notice queued while the
        stream is down waits for the next handshake, and only the newest one is kept: each names every peer)."""
        self._notices.clear()
        self._notices.append(wire.notice_frame(quarantined))

    def probe(self, sketch: bytes, round_index: int) -> None:
        """Queue a ConsensusProbe carrying ``sketch`` (written after the queued messages; a probe queued while the
        stream is down waits for the next handshake, and only the newest one is kept: it sketches the model now)."""
        self._probes.clear()
        self._probes.append(wire.probe_frame(sketch, round_index))

    def hello(self) -> bytes:
        """Start the handshake of a new stream: the serialized Hello frame to write first."""
        self.open = False
        self._hello = self.gate.hello_for(self.receiver_id)
        frame: bytes = wire.hello_frame(self.gate.identity(), self.receiver_id, self._hello).SerializeToString()
        return frame

    def broken(self) -> None:
        """The current stream is gone: nothing more is written until the next handshake settles what it carried."""
        self.open = False
        self._hello = None

    def frames(self, clock: Callable[[], float]) -> Iterator[bytes]:
        """The serialized frames of every queued message, several small ones sharing a batch frame
        (wire.update_frames). Each group is recorded as written, its Ack deadline starting at ``clock()``, when its
        first frame is taken - just before the caller writes it."""
        if not self.open:
            raise StreamBroken(f"no handshaken stream to {self.receiver_id}")
        while self._notices:
            yield self._notices.popleft()
        messages = list(self._outbox)
        self._outbox.clear()
        for group, frames in wire.update_frames(messages, self.gate.identity().algorithm, self.config.chunk_bytes,
                                                self.config.batch_bytes):
            now = clock()
            self._written.extend((msg, now) for msg in group)
            if len(group) > 1:
                self.batched += len(group)
            yield from frames
        while self._probes:
            yield self._probes.popleft()

    def on_reply(self, reply: pb.GossipReply, now: float) -> Settlement[Sent]:
        """Take one reply of the receiver: the HelloReply of the handshake under way, or an Ack. Returns what it
        settled."""
        kind = reply.WhichOneof("reply")
        if kind == "refusal":
            raise Refused(reply.refusal)
        if self._hello is not None:
            if kind != "hello_reply":
                raise StreamBroken(f"expected HelloReply, got {kind}")
            return self._on_hello_reply(self._hello, reply.hello_reply)
        if not self.open or kind != "ack":
            raise StreamBroken(f"unexpected {kind} on an open stream")
        return self._on_ack(reply.ack.seq, now)

    def check_ack_deadline(self, now: float) -> None:
        """Break the stream if the oldest unacknowledged message is past its Ack deadline."""
        deadline = self.ack_deadline
        if deadline is not None and now >= deadline:
            raise StreamBroken(f"no Ack for seq {self._written[0][0].seq} within {self.config.ack_timeout_s} s")

    def _on_hello_reply(self, hello: Hello, reply: pb.HelloReply) -> Settlement[Sent]:
        answered_by = reply.receiver.peer_id
        if answered_by != self.receiver_id:
            raise StreamBroken(f"the receiver is peer {answered_by!r}, not {self.receiver_id!r}")
        try:
            settlement = self.gate.on_hello_reply(self.receiver_id, hello, wire.reply_from_pb(reply))
        except HelloError as exc:  # nothing settled: the in-flight messages wait for an honest handshake
            raise StreamBroken(f"hostile HelloReply from {self.receiver_id} ignored: {exc}") from None
        settled = settlement.seqs()
        if settled:
            self._floor = max(self._floor, max(settled))
            self.settled["delivered"] += len(settlement.delivered)
            self.settled["retracted"] += len(settlement.retracted)
        self._written.clear()
        self._outbox = deque(m for m in self._outbox if m.seq > self._floor)
        self._hello = None
        self.open = True
        self.handshakes += 1
        return settlement

    def _on_ack(self, seq: int, now: float) -> Settlement[Sent]:
        if not self._written or seq < self._written[0][0].seq:
            return Settlement()  # stale: an earlier Ack or the handshake settled it
        if seq > self._written[-1][0].seq:
            raise StreamBroken(f"Ack for seq {seq}, which was never sent on this stream")
        while self._written and self._written[0][0].seq <= seq:
            _, written_at = self._written.popleft()
            self.ack_rtt_s = now - written_at
        settlement = self.gate.on_ack(self.receiver_id, seq)
        self.delivered += len(settlement.delivered)
        self._floor = max(self._floor, seq)
        return settlement
