"""Receiving half of the Gossip stream protocol as a pure state machine: frames in; replies, acks, refusals and
deliveries out. No I/O, no clock of its own (callers pass ``now``: seconds on one monotonic clock), no logging:
the gRPC server (server.py) and the simulator's in-memory transport (peer/sim/transport.py) are shells around it,
so a change to stream semantics is made once and both transports run it.

Per stream (client = sender of mass; see proto/lpdl/v1/peer.proto):
    Hello -> HelloReply | Refusal        identity checks (protocol, fleet, fingerprint, algorithm, self, receiver)
    Update chunks -> cumulative Acks     strict reassembly (reassembly.py), seq strictly increasing per stream
    UpdateBatch -> one cumulative Ack    several whole updates in one frame (protocol 5), all checked first
    QuarantineNotice -> nothing          the peers the sender quarantined (protocol 6+), handed to the gate
    ConsensusProbe -> nothing            a sketch of the sender's model (protocol 9), handed to the gate
Every Refusal ends the stream; the sender reconnects and its handshake settles any in-flight message, so a refusal
never loses or duplicates mass. A refused frame changes no engine state (a batch whose later update the ENGINE
refuses keeps the earlier ones applied, exactly as separate frames would; the handshake settles them as delivered).
A newer stream from the same sender supersedes the older one, which is told REFUSAL_SUPERSEDED; the ledger fence
makes late updates of the old stream harmless anyway.

Across the streams of one receiver (:class:`InboundStreams`): at most ``max_peers`` senders, one stream each;
partial updates bounded in time (``reassembly_timeout_s`` from their first chunk), in size (the model layout's
largest payload) and together (``max_buffered_bytes``).
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass, field

from peer.errors import PeerError
from peer.gossip.engine import GossipInputError
from peer.gossip.ledger import MAX_WINDOW
from peer.gossip.sketch import PROBE_BUCKETS, SKETCH_BYTES
from peer.net import frames, wire
from peer.net.api import StreamGate
from peer.net.config import NetConfig
from peer.net.limits import ByteBudget
from peer.net.proto.lpdl.v1 import peer_pb2 as pb
from peer.net.reassembly import ChunkError, CompleteUpdate, Head, Reassembler

#: Longest peer id a QuarantineNotice may name (bytes of UTF-8).
MAX_NOTICE_ID_BYTES = 256

_IDENTITY_CODES = {
    "protocol": pb.REFUSAL_PROTOCOL, "fleet": pb.REFUSAL_FLEET, "fingerprint": pb.REFUSAL_FINGERPRINT,
    "algorithm": pb.REFUSAL_ALGORITHM, "self": pb.REFUSAL_SELF,
}
#: Refusal code of each reason the gate may give for a Hello (GossipInputError.reason).
_HELLO_CODES = {"bad_hello": pb.REFUSAL_BAD_FRAME, "not_ready": pb.REFUSAL_NOT_READY, "self": pb.REFUSAL_SELF,
                "peer_limit": pb.REFUSAL_LIMIT}
#: Refusal code of each reason the gate may give for an update other than a bad one (REFUSAL_BAD_UPDATE).
_UPDATE_CODES = {"update_rate": pb.REFUSAL_LIMIT, "not_ready": pb.REFUSAL_NOT_READY, "paused": pb.REFUSAL_NOT_READY}


@dataclass(frozen=True)
class Refusal:
    """Why a stream ends: ``code`` (pb.RefusalCode) goes on the wire, ``reason`` is the counter key, ``message``
    one line for the log, ``seq`` the update concerned (0: none)."""

    code: pb.RefusalCode
    reason: str
    message: str
    seq: int = 0

    def reply(self) -> pb.GossipReply:
        return pb.GossipReply(refusal=pb.Refusal(code=self.code, reason=self.reason, message=self.message,
                                                 seq=self.seq))


class _Refused(PeerError):
    def __init__(self, code: pb.RefusalCode, reason: str, message: str, seq: int = 0) -> None:
        super().__init__(message, reason=reason)
        self.refusal = Refusal(code, reason, message, seq)


def ack_reply(seq: int) -> pb.GossipReply:
    """The cumulative Ack of every update up to ``seq`` (applied, or dropped as a duplicate: settled either way)."""
    return pb.GossipReply(ack=pb.Ack(seq=seq, applied=True))


@dataclass
class ServerCounters:
    """Counters keyed by reason (plain data; the daemon exports them as metrics)."""

    refused: collections.Counter[str] = field(default_factory=collections.Counter)
    dropped: collections.Counter[str] = field(default_factory=collections.Counter)
    applied: int = 0


@dataclass
class Received:
    """What one frame did.

    Attributes:
        reply: a HelloReply to write now.
        ack: the newest seq this frame settled: acknowledge it (cumulatively, whenever the receiver's pacing allows).
        delivered: ``(seq, applied)`` of every complete update handed to the gate, in order (False: dropped as
            already applied or fenced).
        refusal: the stream is refused: write it, then end the stream (already counted).
        superseded: the older stream of the same sender this Hello replaced: tell it REFUSAL_SUPERSEDED
            (:meth:`InboundStream.superseded_reply`) and end it.
    """

    reply: pb.GossipReply | None = None
    ack: int | None = None
    delivered: list[tuple[int, bool]] = field(default_factory=list)
    refusal: Refusal | None = None
    superseded: InboundStream | None = None


class InboundStreams:
    """The receiving end of every Gossip stream of one peer: the open streams by sender, the shared byte budget of
    partial updates, and the counters.

    Args:
        gate: the receiving peer.
        config: limits (max_peers, chunk and payload sizes, max_buffered_bytes, reassembly_timeout_s).
    """

    def __init__(self, gate: StreamGate, config: NetConfig) -> None:
        self.gate = gate
        self.config = config
        self.counters = ServerCounters()
        self.buffered = ByteBudget(config.max_buffered_bytes)
        self.max_payload_bytes = min(config.max_payload_bytes, gate.max_payload_bytes())
        self._by_sender: dict[str, InboundStream] = {}

    def open(self, remote: str, caller: str | None = None) -> InboundStream:
        """A new stream from transport address ``remote`` whose certificate names ``caller`` (None: insecure, the
        Hello's claim is trusted)."""
        return InboundStream(self, remote, caller)

    def get(self, sender: str) -> InboundStream | None:
        """The open stream of ``sender`` (an accepted Hello), if any."""
        return self._by_sender.get(sender)

    def senders(self) -> list[str]:
        return sorted(self._by_sender)

    def __len__(self) -> int:
        return len(self._by_sender)

    def count_refused(self, reason: str) -> None:
        self.counters.refused[reason] += 1


class InboundStream:
    """One stream's state: who sent it, the next acceptable seq, the update being reassembled.

    Usage: :meth:`on_frame` for each frame as it arrives; :meth:`expire` when :attr:`deadline` passes with no
    frame; :meth:`close` once the stream is over, however it ended (frees its budget and its place).
    """

    def __init__(self, table: InboundStreams, remote: str, caller: str | None) -> None:
        self.table = table
        self.remote = remote
        self.caller = caller
        self.sender = ""                  # peer id, set by an accepted Hello
        self.superseded = False           # a newer stream of the same sender replaced this one
        self.ended = False                # refused or closed: takes no more frames
        self._reassembler = Reassembler(table.config.max_chunk_bytes, table.max_payload_bytes)
        self._next_seq = 0                # first acceptable seq of the next update
        self._partial_since = 0.0         # ``now`` of the first chunk of the update being reassembled

    @property
    def who(self) -> str:
        return f"{self.sender or '<no hello>'}@{self.remote}"

    @property
    def partial(self) -> Head | None:
        """The update being reassembled (its first chunk's fields), or None between updates."""
        return self._reassembler.partial

    @property
    def deadline(self) -> float | None:
        """When the update being reassembled must be complete (the callers' clock, seconds), or None."""
        if self._reassembler.partial is None:
            return None
        return self._partial_since + self.table.config.reassembly_timeout_s

    def on_frame(self, raw: bytes, now: float) -> Received:
        """Take one serialized GossipFrame arriving at ``now``."""
        out = Received()
        try:
            if self.ended:
                raise RuntimeError(f"frame on the ended stream from {self.who}")
            deadline = self.deadline
            if deadline is not None and now >= deadline:
                raise self._timeout()
            self._on_frame(self._read(raw), now, out)
        except _Refused as refused:
            out.refusal = self._refuse(refused.refusal)
        return out

    def expire(self) -> Refusal:
        """The reassembly deadline passed with no further frame: the partial update is dropped, the stream refused."""
        return self._refuse(self._timeout().refusal)

    def close(self, error: str | None = None) -> Refusal | None:
        """The stream is over (the sender half-closed; ``error``: it broke). Returns the dropped partial update as a
        counted, unsent "truncated" refusal (for the log), if one was left."""
        head = self._reassembler.partial
        truncated = None
        if head is not None and not self.ended and not self.superseded:
            how = (f"ended inside update seq {head.seq} after {self._reassembler.received_chunks} of "
                   f"{head.chunk_count} chunks" if error is None else
                   f"broke inside update seq {head.seq}: {error}")
            truncated = Refusal(pb.REFUSAL_BAD_CHUNK, "truncated",
                                f"gossip stream from {self.who} {how}; update dropped", head.seq)
            self.table.count_refused(truncated.reason)
        self._drop_partial()
        self.ended = True
        if self.sender and self.table._by_sender.get(self.sender) is self:
            del self.table._by_sender[self.sender]
        return truncated

    def superseded_reply(self) -> pb.GossipReply:
        return Refusal(pb.REFUSAL_SUPERSEDED, "superseded",
                       f"a newer stream from {self.sender} replaced this one").reply()

    # --- frames --------------------------------------------------------------------------------------------------
    def _refuse(self, refusal: Refusal) -> Refusal:
        self.table.count_refused(refusal.reason)
        self._drop_partial()
        self.ended = True
        return refusal

    def _drop_partial(self) -> None:
        self.table.buffered.give(self._reassembler.buffered)
        self._reassembler.reset()

    def _timeout(self) -> _Refused:
        head = self._reassembler.partial
        assert head is not None
        return _Refused(pb.REFUSAL_LIMIT, "reassembly_timeout",
                        f"update seq {head.seq} from {self.who} not complete within "
                        f"{self.table.config.reassembly_timeout_s:g} s ({self._reassembler.received_chunks} of "
                        f"{head.chunk_count} chunks); partial update dropped", head.seq)

    def _read(self, raw: bytes) -> frames.Frame:
        """The frame in ``raw``, its payloads left in place (frames.read_frame); refused if malformed."""
        try:
            return frames.read_frame(raw)
        except frames.FrameError as exc:
            if exc.reason == "batch_size":  # checked in the order of _on_batch: first a Hello, then the size
                if not self.sender:
                    raise _Refused(pb.REFUSAL_BAD_FRAME, "no_hello", f"UpdateBatch before Hello from {self.remote}",
                                   exc.seq) from None
                raise _Refused(pb.REFUSAL_BAD_FRAME, "batch_size", f"UpdateBatch from {self.who} {exc}; expected "
                                                                   f"1..{MAX_WINDOW}", exc.seq) from None
            raise _Refused(pb.REFUSAL_BAD_FRAME, "malformed",
                           f"gossip frame of {len(raw)} bytes from {self.who} is not a valid GossipFrame ({exc})") \
                from None

    def _on_frame(self, frame: frames.Frame, now: float, out: Received) -> None:
        if frame.kind == "hello":
            if self.sender:
                raise _Refused(pb.REFUSAL_BAD_FRAME, "hello_twice", f"second Hello on the stream from {self.who}")
            assert frame.hello is not None
            self._on_hello(frame.hello, out)
        elif frame.kind == "update":
            assert frame.update is not None
            if not self.sender:
                raise _Refused(pb.REFUSAL_BAD_FRAME, "no_hello", f"Update before Hello from {self.remote}",
                               frame.update.seq)
            self._on_update(frame.update, now, out)
        elif frame.kind == "batch":
            self._on_batch(frame.updates, out)
        elif frame.kind == "notice":
            assert frame.notice is not None
            self._on_notice(list(frame.notice.quarantined))
        elif frame.kind == "probe":
            assert frame.probe is not None
            self._on_probe(frame.probe.sketch)
        else:
            raise _Refused(pb.REFUSAL_BAD_FRAME, "empty_frame", f"frame with neither Hello, Update, UpdateBatch, "
                                                                f"QuarantineNotice nor ConsensusProbe from {self.who}")

    def _on_probe(self, sketch: bytes) -> None:
        """Hand a sender's model sketch to the gate (its consensus phase judges the sender's distance by it); a
        sketch of another size is refused."""
        if not self.sender:
            raise _Refused(pb.REFUSAL_BAD_FRAME, "no_hello", f"ConsensusProbe before Hello from {self.remote}")
        if len(sketch) != SKETCH_BYTES:
            raise _Refused(pb.REFUSAL_BAD_FRAME, "bad_probe",
                           f"ConsensusProbe from {self.who} holds a sketch of {len(sketch)} bytes; expected "
                           f"{SKETCH_BYTES} ({PROBE_BUCKETS} float32)")
        self._hand_to_gate("ConsensusProbe", lambda: self.table.gate.note_probe(self.sender, sketch))

    def _hand_to_gate(self, frame: str, note: Callable[[], None]) -> None:
        """Run the gate's ``note`` of a frame without mass; its refusal ends the stream (over the sender's update
        rate: REFUSAL_LIMIT)."""
        try:
            note()
        except GossipInputError as exc:
            raise _Refused(pb.REFUSAL_LIMIT if exc.reason == "update_rate" else pb.REFUSAL_BAD_FRAME, exc.reason,
                           f"{frame} from {self.who} refused: {exc}") from exc

    def _on_notice(self, quarantined: list[str]) -> None:
        """Hand the peers a sender says it quarantined to the gate, which decides what they count for
        (docs/design.md#quarantine-notices); a notice of more ids than this peer keeps state for, or of an empty
        or overlong id, is refused."""
        if not self.sender:
            raise _Refused(pb.REFUSAL_BAD_FRAME, "no_hello", f"QuarantineNotice before Hello from {self.remote}")
        limit = self.table.config.max_peers
        if len(quarantined) > limit:
            raise _Refused(pb.REFUSAL_BAD_FRAME, "bad_notice",
                           f"QuarantineNotice from {self.who} names {len(quarantined)} peers; at most {limit} "
                           f"(net.max_peers)")
        for peer_id in quarantined:
            if not peer_id or len(peer_id.encode()) > MAX_NOTICE_ID_BYTES:
                raise _Refused(pb.REFUSAL_BAD_FRAME, "bad_notice",
                               f"QuarantineNotice from {self.who} names a peer id of {len(peer_id.encode())} bytes; "
                               f"expected 1..{MAX_NOTICE_ID_BYTES}")
        self._hand_to_gate("QuarantineNotice", lambda: self.table.gate.note_quarantines(self.sender, quarantined))

    def _on_hello(self, hello: pb.Hello, out: Received) -> None:
        table = self.table
        me = table.gate.identity()
        theirs = wire.identity_from_pb(hello.sender)
        if not theirs.peer_id:
            raise _Refused(pb.REFUSAL_BAD_FRAME, "no_peer_id", f"Hello from {self.remote} has an empty peer_id")
        if self.caller is not None and theirs.peer_id != self.caller:
            raise _Refused(pb.REFUSAL_UNAUTHENTICATED, "sender_mismatch",
                           f"refused gossip from {self.remote}: the Hello claims peer {theirs.peer_id!r} but the "
                           f"certificate is {self.caller!r}")
        mismatch = me.mismatch(theirs)
        if mismatch is not None:
            reason, ours, other = mismatch
            raise _Refused(_IDENTITY_CODES[reason], reason,
                           f"refused gossip from peer {theirs.peer_id!r} at {self.remote}: {reason} mismatch "
                           f"(theirs={other!r}, ours={ours!r})")
        if hello.receiver_id and hello.receiver_id != me.peer_id:
            raise _Refused(pb.REFUSAL_WRONG_RECEIVER, "wrong_receiver",
                           f"refused gossip from peer {theirs.peer_id!r} at {self.remote}: it wants peer "
                           f"{hello.receiver_id!r} but this is {me.peer_id!r}")
        old = table.get(theirs.peer_id)
        if old is None and len(table) >= table.config.max_peers:
            raise _Refused(pb.REFUSAL_LIMIT, "peer_limit",
                           f"refused gossip from peer {theirs.peer_id!r} at {self.remote}: {len(table)} "
                           f"inbound streams open (net.max_peers {table.config.max_peers})")
        try:
            reply = table.gate.answer_hello(theirs.peer_id, wire.hello_from_pb(hello))
        except GossipInputError as exc:
            raise _Refused(_HELLO_CODES.get(exc.reason, pb.REFUSAL_BAD_FRAME), exc.reason,
                           f"hello from {theirs.peer_id}@{self.remote} refused: {exc}") from None
        except ValueError as exc:  # a Hello the wire could carry but the ledger cannot hold
            raise _Refused(pb.REFUSAL_BAD_FRAME, "bad_hello",
                           f"hello from {theirs.peer_id}@{self.remote} refused: {exc}") from None
        if old is not None:
            old.superseded = True
            table.count_refused("superseded")
            out.superseded = old
        self.sender = theirs.peer_id
        table._by_sender[self.sender] = self
        self._next_seq = max(hello.next_seq, reply.fence + 1)
        out.reply = wire.reply_to_pb(reply, me)

    def _check_opening(self, chunk: frames.UpdateView, next_seq: int) -> None:
        """Refuse the first chunk of an update whose seq is below ``next_seq`` (replayed or out of order) or whose
        algorithm is not this peer's."""
        if chunk.seq < next_seq:
            raise _Refused(pb.REFUSAL_BAD_SEQ, "seq_order",
                           f"update from {self.who} has seq {chunk.seq}; this stream expects seq >= "
                           f"{next_seq} (replayed or out of order)", chunk.seq)
        algorithm = self.table.gate.identity().algorithm
        if algorithm and chunk.algorithm != algorithm:
            raise _Refused(pb.REFUSAL_ALGORITHM, "algorithm",
                           f"update seq {chunk.seq} from {self.who} uses algorithm {chunk.algorithm!r}, "
                           f"this peer runs {algorithm!r}", chunk.seq)

    def _on_update(self, chunk: frames.UpdateView, now: float, out: Received) -> None:
        reassembler, budget = self._reassembler, self.table.buffered
        if chunk.chunk_index == 0 and reassembler.partial is None:
            self._check_opening(chunk, self._next_seq)
        data = chunk.data  # a memoryview into the received frame: not copied (frames.py)
        before = reassembler.buffered
        if not budget.take(len(data)):
            raise _Refused(pb.REFUSAL_LIMIT, "buffer_full",
                           f"update seq {chunk.seq} from {self.who} refused: partial updates already hold "
                           f"{budget.used} bytes (net.max_buffered_bytes {budget.limit})", chunk.seq)
        try:
            update = reassembler.feed(chunk, data)
        except ChunkError as exc:
            budget.give(before + len(data))
            raise _Refused(pb.REFUSAL_BAD_CHUNK, exc.reason, f"update from {self.who} refused: {exc}",
                           chunk.seq) from exc
        if update is None:
            if before == 0:
                self._partial_since = now
            return
        budget.give(before + len(data))
        self._deliver(update, out)
        out.ack = update.seq

    def _on_batch(self, updates: list[frames.UpdateView], out: Received) -> None:
        """Whole updates packed in one frame. Every one is checked (whole, seq order, algorithm, sizes) before any
        is applied, so a malformed batch changes nothing; then each is applied as if sent alone, in order, and one
        cumulative Ack covers them. Only the engine's own refusal of one update (a payload it cannot take) can stop a
        batch after earlier updates were applied - as it would stop separate frames; the sender's next handshake
        settles those as delivered and the rest as retracted."""
        first_seq = updates[0].seq if updates else 0
        if not self.sender:
            raise _Refused(pb.REFUSAL_BAD_FRAME, "no_hello", f"UpdateBatch before Hello from {self.remote}",
                           first_seq)
        if not updates or len(updates) > MAX_WINDOW:
            raise _Refused(pb.REFUSAL_BAD_FRAME, "batch_size",
                           f"UpdateBatch from {self.who} holds {len(updates)} updates; expected 1..{MAX_WINDOW}",
                           first_seq)
        if self._reassembler.partial is not None:
            raise _Refused(pb.REFUSAL_BAD_FRAME, "batch_in_partial",
                           f"UpdateBatch from {self.who} while update seq {self._reassembler.partial.seq} is "
                           f"partly received", first_seq)
        next_seq = self._next_seq
        checked: list[CompleteUpdate] = []
        whole_updates = Reassembler(self.table.config.max_chunk_bytes, self.table.max_payload_bytes)
        for update in updates:
            if update.chunk_index != 0 or update.chunk_count != 1:
                raise _Refused(pb.REFUSAL_BAD_CHUNK, "batch_chunked",
                               f"UpdateBatch from {self.who} holds update seq {update.seq} as chunk "
                               f"{update.chunk_index} of {update.chunk_count}; a batch carries whole updates only",
                               update.seq)
            self._check_opening(update, next_seq)
            try:
                whole = whole_updates.feed(update, update.data)
            except ChunkError as exc:
                raise _Refused(pb.REFUSAL_BAD_CHUNK, exc.reason, f"update from {self.who} refused: {exc}",
                               update.seq) from exc
            assert whole is not None  # one chunk of one: complete or refused
            checked.append(whole)
            next_seq = update.seq + 1
        for whole in checked:
            self._deliver(whole, out)
        out.ack = checked[-1].seq  # one Ack: they are cumulative

    def _deliver(self, update: CompleteUpdate, out: Received) -> None:
        """Hand a complete, checked update to the gate (applied, or dropped as a duplicate)."""
        self._next_seq = update.seq + 1
        table = self.table
        try:
            applied = table.gate.receive(self.sender, update.seq, update.weight, update.scale, update.payload)
        except GossipInputError as exc:
            raise _Refused(_UPDATE_CODES.get(exc.reason, pb.REFUSAL_BAD_UPDATE), exc.reason,
                           f"update seq {update.seq} from {self.who} refused by the engine: {exc}",
                           update.seq) from exc
        if applied:
            table.counters.applied += 1
        else:
            table.counters.dropped["duplicate"] += 1
        out.delivered.append((update.seq, applied))
