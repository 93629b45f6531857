"""In-memory Transport for simulated peers: message loss, ack loss, delay in rounds, churn.

It carries the daemon's own :class:`~peer.gossip.engine.OutMessage` objects between :class:`~peer.runtime.peer.Peer`
objects through the same entry points the gRPC server and edges call, with a gRPC stream's semantics:

- each directed edge is one in-order stream: its messages are cut into the gRPC transport's Update frames,
  reassembled by the server's :class:`~peer.net.reassembly.Reassembler`, applied in order, and acknowledged
  cumulatively;
- a lost message or a lost ack breaks the stream: nothing behind it on that edge gets through, and the sender's
  reconnect handshake (Hello -> HelloReply, the pure ledger's clamp and verdicts) settles every in-flight message;
- bytes are counted frame by frame with the daemon's rule (peer/net/accounting.py: protobuf size + 5 per frame),
  so simulator and fleet byte figures are comparable.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from peer.gossip.engine import OutMessage
from peer.net import frames, wire
from peer.net.accounting import LinkAccounting
from peer.net.api import PROTOCOL_VERSION, Identity
from peer.net.config import NetConfig
from peer.net.proto.lpdl.v1 import peer_pb2 as pb
from peer.net.reassembly import Reassembler
from peer.runtime.peer import Peer
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


@dataclass
class _Queued:
    message: OutMessage
    due_round: int


@dataclass
class _Edge:
    """One directed edge's stream: queued messages in seq order, and whether the stream broke."""

    queue: deque[_Queued] = field(default_factory=deque)
    broken: bool = False


class InMemoryTransport:
    """Moves messages between peers in one process (implements :class:`peer.runtime.round.Transport`).

    Args:
        peers: the simulated peers by id.
        chaos: loss, delay and churn.
        seed: seeds the faults.
        config: chunk size and reassembly limits (the daemon's defaults).
    """

    def __init__(self, peers: dict[str, Peer], chaos: ChaosSpec | None = None, seed: int = 0,
                 config: NetConfig | None = None) -> None:
        self.peers = peers
        self.chaos = chaos or ChaosSpec()
        self.config = config or NetConfig()
        self.rng = random.Random(seed)
        self.edges: dict[tuple[str, str], _Edge] = {}
        self.offline_until: dict[str, int] = {}
        self.links: dict[str, LinkAccounting] = {p: LinkAccounting() for p in peers}
        self.round = 0
        self.settled = SettleReport()

    # --- Transport ---------------------------------------------------------------------------------------------
    def ready(self, sender: str, receivers: Sequence[str]) -> set[str]:
        """Online receivers (a message to an offline one would wait; the sender keeps the share instead)."""
        online = set(self.online(self.round))
        return {r for r in receivers if r in online}

    def submit(self, messages: Sequence[OutMessage]) -> None:
        for msg in messages:
            self.edges.setdefault((msg.sender, msg.receiver), _Edge()).queue.append(
                _Queued(msg, self.round + self.chaos.delay))

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
        """Deliver the due messages of every edge between online peers, in order; a loss breaks the edge's
        stream, and the sender's handshake then settles everything it still has in flight on that edge."""
        online = set(self.online(round_index))
        for (sender, receiver), edge in self.edges.items():
            if sender not in online or receiver not in online:
                continue
            while edge.queue and not edge.broken and edge.queue[0].due_round <= round_index:
                msg = edge.queue.popleft().message
                if self.rng.random() < self.chaos.drop:
                    edge.broken = True
                    break
                self._carry(msg)
                if self.rng.random() < self.chaos.drop:
                    edge.broken = True
                    break
                self._ack(msg)
            if edge.broken:
                self._handshake(sender, receiver, edge)

    def flush(self) -> None:
        """Everyone online, every queued message due, then deliver until nothing is in flight."""
        self.offline_until.clear()
        for edge in self.edges.values():
            for item in edge.queue:
                item.due_round = self.round
        self.deliver(self.round)
        for (sender, receiver), edge in self.edges.items():
            if self.peers[sender].in_flight_count(receiver):
                self._handshake(sender, receiver, edge)

    def bytes_sent(self, peer_id: str) -> int:
        """Frame bytes ``peer_id`` sent over all its links (updates, acks, hellos, replies)."""
        return sum(int(link["bytes_sent"]) for link in self.links[peer_id].snapshot().values())

    # --- one stream's frames -----------------------------------------------------------------------------------
    def _carry(self, msg: OutMessage) -> None:
        """The update's frames, as the daemon's sender encodes them alone (wire.update_frames), read and
        reassembled as its server does (frames.read_frame, reassembly), counted by their length."""
        algorithm = self.peers[msg.sender].engine.algorithm.name
        reassembler = Reassembler(self.config.max_chunk_bytes, self.config.max_payload_bytes)
        update = None
        (_, encoded), = wire.update_frames([msg], algorithm, self.config.chunk_bytes)
        for raw in encoded:
            self._count(msg.sender, msg.receiver, len(raw))
            chunk = frames.read_frame(raw).update
            assert chunk is not None
            update = reassembler.feed(chunk, chunk.data)
        assert update is not None
        self.peers[msg.receiver].receive(msg.sender, update.seq, update.weight, update.scale, update.payload)

    def _ack(self, msg: OutMessage) -> None:
        self._count(msg.receiver, msg.sender, pb.GossipReply(ack=pb.Ack(seq=msg.seq, applied=True)).ByteSize())
        settlement = self.peers[msg.sender].on_ack(msg.receiver, msg.seq)
        self.settled.delivered += len(settlement.delivered)

    def _handshake(self, sender: str, receiver: str, edge: _Edge) -> None:
        """Reconnect: Hello, HelloReply, settle every in-flight message; the stream is whole again."""
        a, b = self.peers[sender], self.peers[receiver]
        hello = a.hello_for(receiver)
        self._count(sender, receiver, wire.hello_frame(self._identity(sender), receiver, hello).ByteSize())
        reply = b.answer_hello(sender, hello)
        self._count(receiver, sender, wire.reply_to_pb(reply, self._identity(receiver)).ByteSize())
        settlement = a.on_hello_reply(receiver, hello, reply)
        self.settled.delivered += len(settlement.delivered)
        self.settled.retracted += len(settlement.retracted)
        edge.queue.clear()  # every queued message was in flight, so the handshake settled it: never sent
        edge.broken = False

    def _identity(self, peer_id: str) -> Identity:
        return Identity(peer_id=peer_id, protocol_version=PROTOCOL_VERSION, fingerprint="simulated", fleet="sim",
                        algorithm=self.peers[peer_id].engine.algorithm.name)

    def _count(self, sender: str, receiver: str, message_bytes: int) -> None:
        self.links[sender].sent(receiver, message_bytes)
        self.links[receiver].received(sender, message_bytes)
