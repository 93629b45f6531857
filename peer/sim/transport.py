"""In-memory Transport for simulated peers: message loss, ack loss, delay in rounds, churn.

It carries the daemon's own :class:`~peer.gossip.engine.OutMessage` objects between simulated peers as the daemon's
stream protocol does, with the same two pure state machines the gRPC shells run: each directed edge has the sender's
:class:`~peer.net.outbound.OutboundStream` and, once handshaken, the receiver's
:class:`~peer.net.inbound.InboundStream` (one :class:`~peer.net.inbound.InboundStreams` per peer), and only
serialized frames and replies pass between them:

- a stream opens with the Hello -> HelloReply handshake (when the sender first asks whether the edge is ready, and
  after every break), which settles every in-flight message by the pure ledger's clamp and verdicts;
- the sender frames what it submits as the daemon does (wire.update_frames: chunks, batches of several queued
  updates); the receiver checks per-stream order, reassembles within its budgets and acknowledges cumulatively;
- a lost frame, a lost ack or a refusal breaks the stream: nothing behind it on that edge gets through, and the
  sender's reconnect handshake settles what it carried; a receiver that did not refuse learns of the break only when
  that Hello supersedes its stale half of the stream (and drops any partial update it held), as a gRPC server does;
- bytes are counted frame by frame with the daemon's rule (peer/net/accounting.py: protobuf size + 5 per frame),
  so simulator and fleet byte figures are comparable.
What the simulator adds is only its faults (loss, delay in rounds, churn) and its synchronous schedule.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from peer.compress.codec import max_payload_bytes
from peer.compress.layout import Layout
from peer.gossip.engine import OutMessage
from peer.gossip.kinds import Algorithm
from peer.gossip.ledger import Hello, HelloReply, Settlement
from peer.net.accounting import LinkAccounting
from peer.net.api import PROTOCOL_VERSION, Identity
from peer.net.config import NetConfig
from peer.net.inbound import InboundStream, InboundStreams, ack_reply
from peer.net.outbound import OutboundStream, StreamBroken
from peer.net.proto.lpdl.v1 import peer_pb2 as pb
from peer.runtime.round import SettleReport


@dataclass(frozen=True)
class ChaosSpec:
    """Faults of the in-memory transport.

    Attributes:
        drop: probability that a message, or its ack, is lost (each independently); either breaks the edge's
            stream until the sender's handshake.
        delay: rounds between sending and delivery (0 = same round).
        churn: probability per round that an online peer goes offline.
        offline_rounds: how long an offline peer stays away (it keeps its state, like a partition or a restart
            from an up-to-date checkpoint).
    """

    drop: float = 0.0
    delay: int = 0
    churn: float = 0.0
    offline_rounds: int = 3

    def __post_init__(self) -> None:
        for name in ("drop", "churn"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{name}: probability must be in [0, 1), got {value}")
        if self.delay < 0:
            raise ValueError(f"delay: rounds must be >= 0, got {self.delay}")
        if self.offline_rounds < 1:
            raise ValueError(f"offline_rounds: must be >= 1, got {self.offline_rounds}")


class _Named(Protocol):
    @property
    def name(self) -> Algorithm: ...


class _Engine(Protocol):
    @property
    def algorithm(self) -> _Named: ...

    @property
    def layout(self) -> Layout: ...


class Endpoint(Protocol):
    """What the transport needs of a simulated peer (a :class:`~peer.runtime.peer.Peer` has it): the exactly-once
    entry points, and its engine for the algorithm id and layout."""

    @property
    def engine(self) -> _Engine: ...

    def receive(self, sender: str, seq: int, weight: float, scale: float, payload: bytes | memoryview) -> bool: ...
    def on_ack(self, receiver: str, seq: int) -> Settlement: ...
    def hello_for(self, receiver: str) -> Hello: ...
    def note_quarantines(self, sender: str, quarantined: list[str]) -> None: ...
    def note_probe(self, sender: str, sketch: bytes) -> None: ...
    def answer_hello(self, sender: str, hello: Hello) -> HelloReply: ...
    def on_hello_reply(self, receiver: str, hello: Hello, reply: HelloReply) -> Settlement: ...
    def in_flight_count(self, receiver: str) -> int: ...


class _Gate:
    """A simulated peer as both stream halves see it (peer.net.api.StreamGate), with a wire identity."""

    def __init__(self, peer_id: str, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self._identity = Identity(peer_id=peer_id, protocol_version=PROTOCOL_VERSION, fingerprint="simulated",
                                  fleet="sim", algorithm=endpoint.engine.algorithm.name.value)
        self._max_payload = max_payload_bytes(endpoint.engine.layout)

    def identity(self) -> Identity:
        return self._identity

    def answer_hello(self, sender_id: str, hello: Hello) -> HelloReply:
        return self.endpoint.answer_hello(sender_id, hello)

    def receive(self, sender_id: str, seq: int, weight: float, scale: float, payload: bytes | memoryview) -> bool:
        return self.endpoint.receive(sender_id, seq, weight, scale, payload)

    def note_quarantines(self, sender_id: str, quarantined: list[str]) -> None:
        self.endpoint.note_quarantines(sender_id, quarantined)

    def note_probe(self, sender_id: str, sketch: bytes) -> None:
        self.endpoint.note_probe(sender_id, sketch)

    def hello_for(self, receiver_id: str) -> Hello:
        return self.endpoint.hello_for(receiver_id)

    def on_hello_reply(self, receiver_id: str, hello: Hello, reply: HelloReply) -> Settlement:
        return self.endpoint.on_hello_reply(receiver_id, hello, reply)

    def on_ack(self, receiver_id: str, seq: int) -> Settlement:
        return self.endpoint.on_ack(receiver_id, seq)

    def in_flight_count(self, receiver_id: str) -> int:
        return self.endpoint.in_flight_count(receiver_id)

    def max_payload_bytes(self) -> int:
        return self._max_payload


@dataclass
class _Edge:
    """One directed edge: the sender's half (across streams), the receiver's half of the open stream (None: no
    stream), and the frames written on it with the round each arrives."""

    sender: OutboundStream
    stream: InboundStream | None = None
    wire: deque[tuple[bytes, int]] = field(default_factory=deque)


class InMemoryTransport:
    """Moves messages between peers in one process (implements :class:`peer.runtime.round.Transport`).

    Args:
        peers: the simulated peers by id.
        chaos: loss, delay and churn.
        seed: seeds the faults.
        config: chunk sizes, batching and the receivers' limits (the daemon's defaults).
    """

    def __init__(self, peers: Mapping[str, Endpoint], chaos: ChaosSpec | None = None, seed: int = 0,
                 config: NetConfig | None = None) -> None:
        self.peers = peers
        self.chaos = chaos or ChaosSpec()
        self.config = config or NetConfig()
        self.rng = random.Random(seed)
        self.gates = {p: _Gate(p, endpoint) for p, endpoint in peers.items()}
        #: The receiving end of every peer's streams (the state a gRPC server keeps).
        self.inbound = {p: InboundStreams(gate, self.config) for p, gate in self.gates.items()}
        self.edges: dict[tuple[str, str], _Edge] = {}
        self.offline_until: dict[str, int] = {}
        self.links: dict[str, LinkAccounting] = {p: LinkAccounting() for p in peers}
        self.round = 0
        self.settled = SettleReport()

    # --- Transport ---------------------------------------------------------------------------------------------
    def ready(self, sender: str, receivers: Sequence[str]) -> set[str]:
        """Online receivers whose stream is handshaken (a first contact handshakes now; a message to an offline
        receiver would wait, so the sender keeps the share instead)."""
        online = set(self.online(self.round))
        ready = set()
        for receiver in receivers:
            if receiver in online:
                edge = self._edge(sender, receiver)
                if edge.stream is None:
                    self._connect(sender, receiver, edge)
                if edge.stream is not None:
                    ready.add(receiver)
        return ready

    def submit(self, messages: Sequence[OutMessage]) -> None:
        """Queue each message on its edge, then write every touched edge's queue (several to one edge share a
        batch frame, as a lagging daemon's do)."""
        touched: dict[tuple[str, str], _Edge] = {}
        for msg in messages:
            edge = self._edge(msg.sender, msg.receiver)
            edge.sender.submit(msg)
            touched[msg.sender, msg.receiver] = edge
        for edge in touched.values():
            self._write(edge)

    def notify(self, sender: str, receivers: Collection[str], quarantined: Sequence[str]) -> None:
        """Write a QuarantineNotice naming ``quarantined`` on the edge to each online receiver (connecting it if
        needed); it arrives with the edge's next delivery."""
        self._queue_side_frame(sender, receivers, lambda stream: stream.notify(quarantined))

    def probe(self, sender: str, receivers: Collection[str], sketch: bytes, round_index: int) -> None:
        """Write a ConsensusProbe carrying ``sketch`` on the edge to each online receiver (connecting it if
        needed); it arrives with the edge's next delivery."""
        self._queue_side_frame(sender, receivers, lambda stream: stream.probe(sketch, round_index))

    async def settle(self, timeout_s: float = 0.0) -> SettleReport:
        """Bring everyone online and settle every message (end of a run / conservation checks)."""
        self.flush()
        return self.settled

    # --- the simulator's scheduling ----------------------------------------------------------------------------
    def online(self, round_index: int) -> list[str]:
        return [p for p in self.peers if self.offline_until.get(p, -1) <= round_index]

    def begin_round(self, round_index: int) -> None:
        """Start round ``round_index``: take random peers offline (never all of them)."""
        self.round = round_index
        if self.chaos.churn <= 0.0:
            return
        for peer in self.online(round_index):
            if len(self.online(round_index)) > 1 and self.rng.random() < self.chaos.churn:
                self.offline_until[peer] = round_index + self.chaos.offline_rounds

    def deliver(self, round_index: int) -> None:
        """Deliver the due frames of every edge between online peers, in order; a loss breaks the edge's stream,
        and the sender's reconnect handshake then settles everything it still has in flight on that edge."""
        online = set(self.online(round_index))
        for (sender, receiver), edge in self.edges.items():
            if sender not in online or receiver not in online:
                continue
            while edge.stream is not None and edge.wire and edge.wire[0][1] <= round_index:
                raw, _ = edge.wire.popleft()
                if self.rng.random() < self.chaos.drop or not self._carry(sender, receiver, edge, raw):
                    self._break(edge)
            if edge.stream is None:
                self._connect(sender, receiver, edge)

    def flush(self) -> None:
        """Everyone online, every written frame due, then deliver until nothing is in flight."""
        self.offline_until.clear()
        for edge in self.edges.values():
            edge.wire = deque((raw, self.round) for raw, _ in edge.wire)
        self.deliver(self.round)
        for (sender, receiver), edge in self.edges.items():
            if self.peers[sender].in_flight_count(receiver):
                self._break(edge)
                self._connect(sender, receiver, edge)

    def cut(self, sender: str, receiver: str) -> None:
        """Break the edge's stream now, with whatever is on its wire (fault injection); the sender reconnects at
        the next delivery."""
        edge = self.edges.get((sender, receiver))
        if edge is not None:
            self._break(edge)

    def bytes_sent(self, peer_id: str) -> int:
        """Frame bytes ``peer_id`` sent over all its links (updates, acks, hellos, replies)."""
        return sum(int(link["bytes_sent"]) for link in self.links[peer_id].snapshot().values())

    # --- one edge's streams ------------------------------------------------------------------------------------
    def _queue_side_frame(self, sender: str, receivers: Collection[str],
                          queue: Callable[[OutboundStream], None]) -> None:
        """``queue`` a frame without mass (a notice, a probe) on the edge to each online receiver and write it, or
        connect the edge first (its handshake writes the queue)."""
        online = set(self.online(self.round))
        for receiver in sorted(receivers):
            if receiver not in online:
                continue
            edge = self._edge(sender, receiver)
            queue(edge.sender)
            if edge.stream is None:
                self._connect(sender, receiver, edge)
            else:
                self._write(edge)

    def _edge(self, sender: str, receiver: str) -> _Edge:
        edge = self.edges.get((sender, receiver))
        if edge is None:
            edge = self.edges[sender, receiver] = _Edge(OutboundStream(self.gates[sender], receiver, self.config))
        return edge

    def _connect(self, sender: str, receiver: str, edge: _Edge) -> None:
        """Open a stream: Hello, then the HelloReply settles every in-flight message (or a Refusal: no stream)."""
        hello = edge.sender.hello()
        self._count(sender, receiver, len(hello))
        stream = self.inbound[receiver].open(remote=sender)
        received = stream.on_frame(hello, float(self.round))
        if received.superseded is not None:
            received.superseded.close()
        reply = received.refusal.reply() if received.refusal is not None else received.reply
        assert reply is not None  # a Hello is answered or refused
        try:
            self._reply(receiver, sender, edge, reply)
        except StreamBroken:
            stream.close()
            edge.sender.broken()
            return
        edge.stream = stream
        self._write(edge)

    def _write(self, edge: _Edge) -> None:
        """Put the edge's queued frames on its stream (they wait in the sender's queue while there is none)."""
        if edge.stream is not None:
            due = self.round + self.chaos.delay
            edge.wire.extend((raw, due) for raw in edge.sender.frames(lambda: float(self.round)))

    def _carry(self, sender: str, receiver: str, edge: _Edge, raw: bytes) -> bool:
        """One frame arrives and is acknowledged (unless the ack is lost); False when the stream broke."""
        assert edge.stream is not None
        self._count(sender, receiver, len(raw))
        received = edge.stream.on_frame(raw, float(self.round))
        if received.refusal is not None:
            edge.stream.close()  # the receiver ends a stream it refused
            return False
        if received.ack is None:
            return True  # a chunk of an update still being reassembled
        if self.rng.random() < self.chaos.drop:
            return False
        try:
            self._reply(receiver, sender, edge, ack_reply(received.ack))
        except StreamBroken:
            return False
        return True

    def _reply(self, receiver: str, sender: str, edge: _Edge, reply: pb.GossipReply) -> None:
        raw = reply.SerializeToString()
        self._count(receiver, sender, len(raw))
        settlement = edge.sender.on_reply(pb.GossipReply.FromString(raw), float(self.round))
        self.settled.delivered += len(settlement.delivered)
        self.settled.retracted += len(settlement.retracted)

    def _break(self, edge: _Edge) -> None:
        """The stream is lost with whatever was on its wire; its sender reconnects (the receiver's half stays open
        until the reconnect's Hello supersedes it)."""
        edge.wire.clear()
        edge.stream = None
        edge.sender.broken()

    def _count(self, sender: str, receiver: str, message_bytes: int) -> None:
        self.links[sender].sent(receiver, message_bytes)
        self.links[receiver].received(sender, message_bytes)
