"""The daemon's :class:`~peer.net.api.GossipGate`: the peer's exactly-once entry points, plus the daemon's policy
around them - refuse inbound edges while joining, pace acks to this peer's rounds, serve the status document."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from peer.compress.codec import max_payload_bytes
from peer.daemon.pace import NeighbourPace
from peer.gossip import ledger
from peer.gossip.engine import GossipInputError
from peer.net.api import Identity, model_to_bytes
from peer.net.limits import CallerBuckets
from peer.runtime.peer import Peer


class PeerGate:
    """Gate over one :class:`Peer`.

    Args:
        peer: the peer (its lock makes every call atomic).
        identity: who this peer is on the wire (listen address filled in once the server has bound).
        status: builds the daemon's status document (the Status RPC and the control socket serve the same one).
        ack_delay_cap_s: longest an Ack waits for this peer's next round boundary (seconds); half the senders'
            ack timeout, so pacing never breaks a healthy stream.
        update_rates: each sender's budget of applied updates (net.max_updates_per_s / net.update_burst); None: no
            bound.
        pace: paces this peer's rounds to its receivers (pace.py), woken by every ack and handshake that settles
            messages; None: not paced.
    """

    def __init__(self, peer: Peer, identity: Identity, status: Callable[[], dict[str, Any]],
                 ack_delay_cap_s: float, update_rates: CallerBuckets | None = None,
                 pace: NeighbourPace | None = None) -> None:
        self.peer = peer
        self._identity = identity
        self._status = status
        self.ack_delay_cap_s = ack_delay_cap_s
        self.update_rates = update_rates
        self.pace = pace
        self._max_payload = max_payload_bytes(peer.flat.layout)
        self.accepting = False
        #: Why this peer moves no mass now (its state directory cannot take a checkpoint: peer/daemon/durability.py),
        #: or None. Set and cleared on the event loop, where every inbound message is applied, so no message slips
        #: in between the pause and the checkpoint of the paused state.
        self.paused: str | None = None
        #: This peer has run its last round and is stopping: it takes in no more mass, since it would send none
        #: back (docs/decisions/daemon-lifecycle.md#a-stopping-peer-takes-in-no-mass). Hellos are still answered,
        #: so a sender settles what it sent since (retracted) instead of leaving it in flight.
        self.stopping = False
        self._refused_while_stopping: set[str] = set()
        self.pacing = True
        #: This peer waits between rounds for neighbours it ran too far ahead of (pace.py): acknowledge at once
        #: meanwhile, or two peers that send to each other would each hold the acks the other waits for.
        self.between_rounds = False
        self._round_done = asyncio.Event()

    def identity(self) -> Identity:
        return self._identity

    def set_identity(self, identity: Identity) -> None:
        """Fill in the listen address once the server has bound its port (before discovery advertises it)."""
        self._identity = identity

    def round_finished(self) -> None:
        """Release the acks held back since the last round (called by the round loop and at shutdown)."""
        self._round_done.set()
        self._round_done = asyncio.Event()

    def wait_between_rounds(self, waiting: bool) -> None:
        """This peer waits between rounds (True: the acks held so far go now, later ones at once) or starts its next
        round (False: acks wait for its boundary again)."""
        self.between_rounds = waiting
        if waiting:
            self.round_finished()

    def stop_pacing(self) -> None:
        """Acknowledge at once from now on (shutdown: senders must settle quickly)."""
        self.pacing = False
        self.round_finished()

    async def before_ack(self, sender_id: str) -> None:
        """Ack at this peer's next round boundary (at most ``ack_delay_cap_s`` later).

        Without this, a peer that pauses (evaluation, checkpoint, a slower CPU) receives many messages from a fast
        neighbour per own round: push-sum stays unbiased, but weights swing by orders of magnitude and compressed
        gossip's replica error is amplified by each burst (docs/decisions/daemon-lifecycle.md#acks-paced-to-the-round).
        """
        if not self.pacing or self.between_rounds:
            return
        try:
            await asyncio.wait_for(self._round_done.wait(), self.ack_delay_cap_s)
        except asyncio.TimeoutError:
            pass

    def answer_hello(self, sender_id: str, hello: ledger.Hello) -> ledger.HelloReply:
        if not self.accepting:
            raise GossipInputError("not_ready", "this peer is joining the fleet (pulling the model); retry shortly")
        if self.paused is not None:
            raise GossipInputError("not_ready", f"this peer has paused gossip ({self.paused}); retry later")
        reply = self.peer.answer_hello(sender_id, hello)
        self._refused_while_stopping.discard(sender_id)  # the sender settles what was refused by this reply
        return reply

    def receive(self, sender_id: str, seq: int, weight: float, scale: float, payload: bytes | memoryview) -> bool:
        if self.paused is not None:  # the sender keeps the message in flight; the next handshake settles it
            raise GossipInputError("paused", f"this peer has paused gossip ({self.paused})")
        if self.stopping:
            self._refused_while_stopping.add(sender_id)
            raise GossipInputError("not_ready", "this peer is stopping and takes in no more updates; the next "
                                                "handshake retracts this one")
        if self.update_rates is not None and not self.update_rates.allow(sender_id):
            raise GossipInputError("update_rate", f"more than {self.update_rates.burst} updates at "
                                                  f"{self.update_rates.rate_per_s:g}/s from {sender_id}")
        return self.peer.receive(sender_id, seq, weight, scale, payload)

    def refusals_unsettled(self) -> int:
        """How many senders had an update refused since this peer began stopping and have not handshaked since:
        until they do, what was refused stays in flight at them."""
        return len(self._refused_while_stopping)

    def note_quarantines(self, sender_id: str, quarantined: list[str]) -> None:
        if self.update_rates is not None and not self.update_rates.allow(sender_id):  # one bucket for all it sends
            raise GossipInputError("update_rate", f"more than {self.update_rates.burst} updates and notices at "
                                                  f"{self.update_rates.rate_per_s:g}/s from {sender_id}")
        self.peer.note_quarantines(sender_id, quarantined)

    def note_probe(self, sender_id: str, sketch: bytes) -> None:
        if self.update_rates is not None and not self.update_rates.allow(sender_id):
            raise GossipInputError("update_rate", f"more than {self.update_rates.burst} updates, notices and probes "
                                                  f"at {self.update_rates.rate_per_s:g}/s from {sender_id}")
        self.peer.note_probe(sender_id, sketch)

    def hello_for(self, receiver_id: str) -> ledger.Hello:
        return self.peer.hello_for(receiver_id)

    def on_hello_reply(self, receiver_id: str, hello: ledger.Hello, reply: ledger.HelloReply) -> ledger.Settlement:
        settlement = self.peer.on_hello_reply(receiver_id, hello, reply)
        self._settled(receiver_id)
        return settlement

    def on_ack(self, receiver_id: str, seq: int) -> ledger.Settlement:
        settlement = self.peer.on_ack(receiver_id, seq)
        self._settled(receiver_id)
        return settlement

    def _settled(self, receiver_id: str) -> None:
        if self.pace is not None:
            self.pace.acked(receiver_id)

    def in_flight_count(self, receiver_id: str) -> int:
        return self.peer.in_flight_count(receiver_id)

    def model_bytes(self) -> bytes:
        return model_to_bytes(self.peer.model_vector())

    def max_payload_bytes(self) -> int:
        return self._max_payload

    def status(self) -> dict[str, Any]:
        return self._status()
