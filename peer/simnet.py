"""In-memory transport for simulated peers: message loss, ack loss, delay in rounds, churn.

Carries the daemon's own :class:`~peer.gossip.engine.OutMessage` objects between the daemon's own
:class:`~peer.gossip.engine.GossipEngine` objects. A lost message or ack is settled the way the daemon settles a
broken stream: the sender's next handshake with the receiver either confirms delivery or takes the mass back.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from peer.gossip.engine import GossipEngine, OutMessage


@dataclass(frozen=True)
class ChaosSpec:
    """Faults of the in-memory transport.

    Attributes:
        drop: probability that a message, or its ack, is lost (each independently).
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
        if self.delay < 0 or self.offline_rounds < 1:
            raise ValueError("delay must be >= 0 and offline_rounds >= 1")


@dataclass
class _InFlight:
    message: OutMessage
    due_round: int
    lost: bool
    ack_lost: bool


class InMemoryTransport:
    """Moves :class:`OutMessage` objects between engines with optional loss, delay and churn."""

    def __init__(self, engines: dict[str, GossipEngine], chaos: ChaosSpec, seed: int = 0) -> None:
        self.engines = engines
        self.chaos = chaos
        self.rng = random.Random(seed)
        self.queue: list[_InFlight] = []
        self.offline_until: dict[str, int] = {}
        self.bytes_sent: dict[str, int] = {p: 0 for p in engines}

    def online(self, round_index: int) -> list[str]:
        return [p for p in self.engines if self.offline_until.get(p, -1) <= round_index]

    def churn(self, round_index: int) -> None:
        """Take random peers offline; never all of them."""
        if self.chaos.churn <= 0.0:
            return
        for peer in self.online(round_index):
            if len(self.online(round_index)) > 1 and self.rng.random() < self.chaos.churn:
                self.offline_until[peer] = round_index + self.chaos.offline_rounds

    def send(self, messages: list[OutMessage], round_index: int) -> None:
        for msg in messages:
            self.bytes_sent[msg.sender] += len(msg.payload)
            self.queue.append(_InFlight(msg, round_index + self.chaos.delay,
                                        lost=self.rng.random() < self.chaos.drop,
                                        ack_lost=self.rng.random() < self.chaos.drop))

    def deliver(self, round_index: int) -> None:
        """Deliver due messages between online peers; settle lost ones by handshake (sender learns via timeout)."""
        online = set(self.online(round_index))
        waiting = []
        for item in self.queue:
            msg = item.message
            if item.due_round > round_index or msg.sender not in online or msg.receiver not in online:
                waiting.append(item)
                continue
            sender = self.engines[msg.sender]
            receiver = self.engines[msg.receiver]
            if not item.lost:
                receiver.receive(msg.sender, msg.seq, msg.weight, msg.scale, msg.payload)
            if item.lost or item.ack_lost:
                sender.on_hello_reply(msg.receiver, receiver.answer_hello(msg.sender, sender.hello_for(msg.receiver)))
            else:
                sender.on_ack(msg.receiver, msg.seq)
        self.queue = waiting

    def flush(self, round_index: int) -> None:
        """Bring everyone online and settle every message (end of a run / conservation checks)."""
        self.offline_until.clear()
        for item in self.queue:
            item.due_round = round_index
        self.deliver(round_index)
