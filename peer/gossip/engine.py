"""One peer's gossip state machine: push-sum state, the algorithm (which owns its own state) and per-edge ledgers.

This is the gossip step every driver shares (docs/design.md#architecture): the simulator and the daemon differ only in
how the :class:`OutMessage` objects travel and when acks, hellos and replies come back. Everything here is pure tensor
code (no sockets, no threads); the runtime (peer/runtime/peer.py) serialises access with one lock and keeps the slow
parts (encoding, decoding) outside it.

Message life cycle on edge ``i -> j``:
    i.plan_round -> i.encode_round -> i.commit_round   OutMessage(seq, weight, scale, payload); i subtracted its mass
    j.receive(i, ...) (= j.decode + j.apply)           applies mass once (or drops a duplicate / fenced copy)
    i.on_ack(j, seq)                                   seq and every earlier in-flight seq are settled: forgotten
  or, after a broken stream:
    hello = i.hello_for(j); reply = j.answer_hello(i, hello); i.on_hello_reply(j, hello, reply)
                                                       each in-flight message delivered, or its mass taken back

Invariant (tested): ``sum_i (x_i + held_i) + sum in-flight mass`` and ``sum_i (w_i + held weight_i) + sum in-flight
weight`` change only by gradient steps (held: what the robust receive rule's clipping has not applied yet,
:meth:`GossipEngine.held`).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from peer.compress.codec import CodecConfig, Decoded, PayloadError, decode
from peer.compress.layout import Layout
from peer.errors import PeerError
from peer.gossip import kinds
from peer.gossip.algorithms import Algorithm, Plan, Sent, make_algorithm
from peer.gossip.checkpoint import EngineState, OutEdgeState
from peer.gossip.consensus import NeighbourDistances
from peer.gossip.ledger import (
    DEFAULT_MAX_PEERS,
    DEFAULT_WINDOW,
    SEQ_WINDOW,
    Hello,
    HelloError,
    HelloReply,
    InboundEdge,
    OutboundEdge,
    Settlement,
)
from peer.gossip.pushsum import MIN_SEND_WEIGHT, MIN_WEIGHT, PushSumState
from peer.gossip.robust import REASON_NON_FINITE, Admission, HeldMass, ReceiveGuard, Refusal, RobustConfig
from peer.gossip.sketch import estimated_distance, sketch

#: Forgotten senders whose inbound ledger is kept (two ints each); beyond it the oldest goes, and if that peer ever
#: returns with messages still unacknowledged, their mass may be counted twice - after 4,096 departures in between.
MAX_DEPARTED = 4096
#: Refusals before :meth:`GossipEngine.apply` that are charged to the sender's anomaly score (a malformed or
#: non-finite payload, a weight no honest sender claims); sequence and handshake errors are a transport's matter.
_CHARGED = frozenset({"bad_payload", "implausible_weight", "bad_weight", "bad_scale"})


class GossipInputError(PeerError, ValueError):
    """A received message was refused; the engine's state is unchanged. ``reason`` is a short counter key."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message, reason=reason)


@dataclass
class OutMessage:
    """One message of a directed edge, as the transport carries it.

    Attributes:
        sender, receiver: peer ids.
        seq: the edge's sequence number (1, 2, ...).
        round: the sender's local round (informational).
        weight: push-sum weight mass moved (dimensionless).
        scale: factor the receiver applies to the decoded mass (gamma * share).
        payload: codec bytes.
    """

    sender: str
    receiver: str
    seq: int
    round: int
    weight: float
    scale: float
    payload: bytes


@dataclass
class RoundPlan:
    """One round of sending between its three steps (plan under the lock, encode outside, commit under it).

    Attributes:
        round_index: the sender's round.
        scale: gamma * share, share = 1 / (out-degree + 1) over the whole out-set (column-stochastic).
        w: the push-sum weight the moved weights are shares of (read under the lock).
        algorithm_plan: what the algorithm copied for encoding.
        factors: per receiver, the fraction of ``scale`` its message moves (the robust rule's reduced share for a
            neighbour far outside its peers' spread, :meth:`ReceiveGuard.send_factor`; absent: 1). The sender
            keeps the rest, so mass stays exact: push-sum takes any column-stochastic split.
        sent: the encoded messages (filled by encode_round).
    """

    round_index: int
    scale: float
    w: float
    algorithm_plan: Plan
    factors: dict[str, float] = field(default_factory=dict)
    sent: dict[str, Sent] = field(default_factory=dict)


class GossipEngine:
    """Push-sum gossip of one peer.

    Args:
        peer_id: this peer's id.
        layout: parameter layout shared by all peers (payloads carry its digest).
        x0: initial flat model vector (becomes x with w = 1).
        algorithm: a :class:`peer.gossip.kinds.Algorithm` (or its name).
        codec: compression config for payloads.
        gamma: consensus step size (forced to 1 for sgp; about 0.01-0.5 with 99% sparsification).
        window: messages one directed edge may have in flight (sent, not settled). 1 makes every edge wait a full
            ack round trip per message; a few let a sender keep gossiping while acks are on their way.
        max_in_flight_bytes: most payload bytes one edge may have in flight besides the window's count: a new
            message goes while the edge's unsettled payloads add up to less (so at most this plus one message);
            one message is always allowed. It bounds the queue a slow link builds (and the sender's records,
            a small multiple of the payloads). None: the window alone bounds it.
        seed: seeds stochastic rounding.
        replica_init: Choco's common starting replica (see :class:`peer.gossip.algorithms.Choco`).
        max_sender_weight: largest push-sum weight a sender may hold (dimensionless): an update moving ``weight``
            at ``scale`` claims the sender holds ``weight / scale``. The fleet's weights sum to its number of peers,
            so no honest sender exceeds the largest fleet this peer talks to; more is refused as implausible (one
            forged update of weight 1000 otherwise takes over the receiver's model, issue 10). None: ``max_peers``.
        max_peers: most peers this engine keeps edge state for (ledgers, replicas); a Hello from one more is
            refused, so a flood of ids cannot allocate a replica each.
        robust: the robust receive rule (peer/gossip/robust.py); on by default.
    """

    def __init__(self, peer_id: str, layout: Layout, x0: torch.Tensor, algorithm: str, codec: CodecConfig,
                 gamma: float = 1.0, window: int = DEFAULT_WINDOW, seed: int = 0,
                 replica_init: torch.Tensor | None = None, max_in_flight_bytes: int | None = None,
                 max_sender_weight: float | None = None, max_peers: int = DEFAULT_MAX_PEERS,
                 robust: RobustConfig | None = None) -> None:
        if not (0.0 < gamma <= 1.0) or not math.isfinite(gamma):
            raise ValueError(f"gamma: consensus step size must be in (0, 1], got {gamma}")
        if window < 1:
            raise ValueError(f"window: messages in flight per edge must be >= 1, got {window}")
        if x0.numel() != layout.numel:
            raise ValueError(f"x0 has {x0.numel()} entries but the layout has {layout.numel}")
        self.peer_id = peer_id
        self.layout = layout
        self.algorithm: Algorithm = make_algorithm(algorithm, layout, codec, x0.device, replica_init)
        self.gamma = 1.0 if self.algorithm.name is kinds.Algorithm.SGP else gamma
        self.window = window
        self.max_in_flight_bytes = max_in_flight_bytes
        self.max_sender_weight = float(max_peers) if max_sender_weight is None else max_sender_weight
        self.max_peers = max_peers
        self.state = PushSumState.from_model_vector(x0)
        self.out_edges: dict[str, OutboundEdge[Sent]] = {}
        self.in_edges: dict[str, InboundEdge] = {}
        #: Inbound ledgers of forgotten senders (two ints each, oldest first): a sender that comes back may still
        #: hold messages this peer applied before forgetting it, and its handshake must judge them delivered.
        self.departed_in: OrderedDict[str, InboundEdge] = OrderedDict()
        self._generator = torch.Generator(device=x0.device).manual_seed(seed)
        #: Per-neighbour anomaly records and the receive rule's radius history; quarantine lives here.
        self.guard = ReceiveGuard(robust or RobustConfig(), noise_floor=self.algorithm.noise_floor(),
                                  radius_scale=self.algorithm.radius_scale(),
                                  mass_carries_model=self.algorithm.mass_carries_model(),
                                  models_comparable=self.algorithm.models_comparable(),
                                  common_start=self.algorithm.common_start())
        self.guard.notices.max_notifiers = max_peers
        #: What the rule's clipping held back per sender: received, acknowledged, counted here, not yet applied.
        self.held_from: dict[str, HeldMass] = {}
        #: How far each sender's model is from this peer's, by its messages (docs/method.md#the-consensus-phase).
        self.distances = NeighbourDistances()

    # --- state views -------------------------------------------------------------------------------------------
    @property
    def x(self) -> torch.Tensor:
        return self.state.x

    @property
    def w(self) -> float:
        return self.state.w

    def has_room(self, receiver: str) -> bool:
        """Whether the edge to ``receiver`` may take another message: fewer than ``window`` in flight and, if
        any are, their payloads under ``max_in_flight_bytes``."""
        edge = self.out_edges.get(receiver)
        return edge is None or self._edge_has_room(edge)

    def _edge_has_room(self, edge: OutboundEdge[Sent]) -> bool:
        if not edge.has_room(self.window):
            return False
        if self.max_in_flight_bytes is None or not edge.in_flight:
            return True
        return sum(sent.payload_bytes for sent in edge.in_flight.values()) < self.max_in_flight_bytes

    def in_flight(self) -> tuple[torch.Tensor, float]:
        """Total mass and weight this peer has subtracted but not yet seen settled (for the invariant)."""
        mass = torch.zeros_like(self.state.x)
        weight = 0.0
        for receiver, edge in self.out_edges.items():
            records = list(edge.in_flight.values())
            self.algorithm.flight_mass_into(receiver, records, mass)
            weight += sum(sent.weight for sent in records)
        return mass, weight

    def held(self) -> tuple[torch.Tensor, float]:
        """Total numerator mass and weight received but held back by the robust rule's clipping (for the
        invariant: this peer's mass is ``x + held`` and ``w + held weight``)."""
        mass = torch.zeros_like(self.state.x)
        weight = 0.0
        for held in self.held_from.values():
            mass.add_(held.mass)
            weight += held.weight
        return mass, weight

    def holdings(self) -> tuple[torch.Tensor, float]:
        """This peer's own push-sum mass in float64: ``x`` plus what clipping held back, and ``w`` plus the held
        weight (in-flight mass excluded: :meth:`in_flight`). What mass totals and consensus checks count."""
        held_mass, held_weight = self.held()
        return self.state.x.double() + held_mass.double(), self.state.w + held_weight

    def last_applied_from(self, sender: str) -> int:
        """The last seq this peer applied from ``sender`` (0 if none), kept for forgotten senders too."""
        edge = self.in_edges.get(sender) or self.departed_in.get(sender)
        return 0 if edge is None else edge.last_applied

    def known_peers(self) -> set[str]:
        """Every peer this engine keeps state for (ledgers and algorithm state)."""
        return set(self.out_edges) | set(self.in_edges) | self.algorithm.peers()

    # --- sending -----------------------------------------------------------------------------------------------
    def plan_round(self, receivers: list[str], round_index: int,
                   ready: Collection[str] | None = None) -> RoundPlan | None:
        """Step 1 (under the lock): choose this round's targets and copy what encoding needs.

        The share is ``1 / (len(receivers) + 1)`` per out-neighbour (column-stochastic, decided by the schedule);
        edges not in ``ready`` (link down) or without room are skipped and the sender simply keeps their share.
        Returns None when no edge will send, or this peer's weight is below ``MIN_SEND_WEIGHT`` (it keeps all).
        """
        if self.state.w < MIN_SEND_WEIGHT:
            return None
        targets = [r for r in dict.fromkeys(receivers) if r != self.peer_id]
        idle = [r for r in targets if (ready is None or r in ready) and self.has_room(r)]
        if not idle:
            return None
        scale = self.gamma / (len(targets) + 1)
        return RoundPlan(round_index=round_index, scale=scale, w=self.state.w,
                         algorithm_plan=self.algorithm.prepare(self.state.x, self.state.w, idle),
                         factors=self._send_factors(idle))

    def _send_factors(self, receivers: list[str]) -> dict[str, float]:
        """The reduced shares of receivers the robust rule finds far outside their peers' spread (the rest: 1);
        tells the rule whom this peer sends to (its outlier charge compares like with like: ReceiveGuard.mutual)."""
        if not (self.guard.config.enabled and self.guard.models_comparable) or self.state.w < MIN_WEIGHT:
            return {}  # no outliers to cut (Choco, Deep-Squeeze: the model's norm is not even taken)
        z_norm = float(torch.linalg.vector_norm(self.state.x, dtype=torch.float64)) / self.state.w
        self.guard.note_sent(receivers)
        factors = {r: self.guard.send_factor(r, z_norm) for r in receivers}
        return {r: f for r, f in factors.items() if f < 1.0}

    def encode_round(self, plan: RoundPlan) -> RoundPlan:
        """Step 2 (no lock): compress the payloads; reads only the plan's copies."""
        plan.sent = self.algorithm.encode(plan.algorithm_plan, self._generator)
        return plan

    def commit_round(self, plan: RoundPlan) -> list[OutMessage]:
        """Step 3 (under the lock): issue seqs, subtract each message's mass, return the messages to send."""
        messages = []
        for receiver, sent in self.algorithm.commit(plan.algorithm_plan, plan.sent).items():
            edge = self.out_edges.setdefault(receiver, OutboundEdge())
            if not self._edge_has_room(edge):
                continue
            scale = plan.scale * plan.factors.get(receiver, 1.0)
            sent.weight, sent.scale = scale * plan.w, scale
            payload, sent.payload = sent.payload, b""  # the transport carries the bytes; the record keeps the mass
            sent.payload_bytes = len(payload)
            seq = edge.issue(sent, self.window)
            self.algorithm.mass_into(receiver, sent, self.state.x, -1.0)
            self.state.w -= sent.weight
            messages.append(OutMessage(self.peer_id, receiver, seq, plan.round_index, sent.weight, sent.scale,
                                       payload))
        return messages

    def send_round(self, receivers: list[str], round_index: int,
                   ready: Collection[str] | None = None) -> list[OutMessage]:
        """All three steps at once (single-threaded callers and tests)."""
        plan = self.plan_round(receivers, round_index, ready)
        return [] if plan is None else self.commit_round(self.encode_round(plan))

    def on_ack(self, receiver: str, seq: int) -> Settlement[Sent]:
        """The receiver applied (or dropped as duplicate) message ``seq`` and every earlier one: forget them."""
        edge = self.out_edges.get(receiver)
        settlement = edge.acknowledge(seq) if edge is not None else Settlement()
        self.guard.delivered(receiver, len(settlement.delivered))
        return settlement

    def hello_for(self, receiver: str) -> Hello:
        """What to send when (re)opening the edge to ``receiver``."""
        edge = self.out_edges.setdefault(receiver, OutboundEdge())
        digests = self.algorithm.out_digests(receiver, list(edge.in_flight.values()))
        return edge.hello(digests)

    def on_hello_reply(self, receiver: str, hello: Hello, reply: HelloReply) -> Settlement[Sent]:
        """Settle every in-flight message of the edge from the receiver's reply to ``hello``: forget the
        delivered ones, take back the mass of the others (newest first), reset the edge if the receiver did."""
        edge = self.out_edges.setdefault(receiver, OutboundEdge())
        settlement = edge.settle(hello, reply)
        self.guard.delivered(receiver, len(settlement.delivered))
        for _, sent in settlement.retracted:
            self.algorithm.mass_into(receiver, sent, self.state.x, 1.0)
            self.state.w += sent.weight
            self.algorithm.retract(receiver, sent)
        if reply.reset:
            self.algorithm.reset_out(receiver)
        return settlement

    def set_mixing(self, compression: float, gamma: float, bits: int | None = None, deflate: bool = False,
                   step_floor: float = 0.0) -> None:
        """Gossip with top-k ``compression`` at step size ``gamma``, ``bits`` wide (None: as now), deflated or
        not, on a grid no finer than ``step_floor`` (CodecConfig.step_floor), from the next round on (the
        consensus phase widens and narrows the codec). Rounding stays; SGP stays dense at gamma 1. Mass stays
        exact: every message carries its own scale and its payload names its own codec."""
        if not (0.0 < gamma <= 1.0) or not math.isfinite(gamma):
            raise ValueError(f"gamma: consensus step size must be in (0, 1], got {gamma}")
        codec = self.algorithm.codec
        sgp = self.algorithm.name == "sgp"
        new = CodecConfig(compression=codec.compression if sgp else compression,
                          bits=codec.bits if bits is None else bits, rounding=codec.rounding, deflate=deflate,
                          step_floor=step_floor)
        new.validate()
        self.algorithm.codec = new
        if not sgp:
            self.gamma = gamma

    # --- receiving ---------------------------------------------------------------------------------------------
    def check_update(self, sender: str, seq: int, weight: float, scale: float) -> None:
        """Refuse an update's scalar fields (no state read)."""
        if sender == self.peer_id:
            raise GossipInputError("self", "message claims to come from this peer itself")
        if not isinstance(seq, int) or seq < 1:
            raise GossipInputError("bad_seq", f"seq must be a positive integer, got {seq!r}")
        if not (math.isfinite(weight) and weight > 0.0):
            raise GossipInputError("bad_weight", f"push-sum weight must be finite and > 0, got {weight!r}")
        if not (math.isfinite(scale) and 0.0 < scale <= 1.0):
            raise GossipInputError("bad_scale", f"mass scale must be in (0, 1], got {scale!r}")
        if weight > scale * self.max_sender_weight:
            raise GossipInputError("implausible_weight",
                                   f"weight {weight!r} at scale {scale!r} claims a sender weight of "
                                   f"{weight / scale:.4g}, more than any peer of a fleet of up to "
                                   f"{self.max_sender_weight:g} holds")

    def decode(self, payload: bytes | memoryview) -> Decoded:
        """Decode a payload against this engine's layout (pure: no state; call it outside the lock)."""
        try:
            decoded = decode(payload, self.layout)
        except PayloadError as exc:
            raise GossipInputError("bad_payload", f"payload refused: {exc}") from exc  # incl. NaN/Inf values
        if decoded.values.device != self.state.x.device:
            decoded = Decoded(None if decoded.indices is None else decoded.indices.to(self.state.x.device),
                              decoded.values.to(self.state.x.device))
        return decoded

    def apply(self, sender: str, seq: int, weight: float, scale: float, decoded: Decoded) -> bool:
        """Apply one checked, decoded message exactly once (under the lock).

        Returns:
            True if its mass was applied, False if it was a duplicate or a fenced (retracted) copy.
        """
        self.check_update(sender, seq, weight, scale)
        self._refuse(self.guard.check_sender(sender))
        edge = self.in_edges.get(sender) or self.departed_in.get(sender) or InboundEdge()
        if not edge.accepts(seq):
            return False
        if not edge.in_window(seq):
            raise GossipInputError("seq_window", f"seq {seq} is more than {SEQ_WINDOW} beyond this edge's last seq "
                                                 f"{max(edge.last_applied, edge.fence)}")
        # the sender is judged against this peer's model BEFORE its mass comes in: after, a receiver of small weight
        # holds mostly the sender's model and every neighbour looks near (a starved SGP peer at 27% accuracy ended
        # its phase "converged" beside neighbours at 67% under a 10 Mbit/s link)
        own = self.state.debiased()
        if self.guard.config.enabled:
            pending = self.algorithm.incoming_mass(sender, decoded, weight, scale)
            pending_weight = weight
            held = self.held_from.get(sender)
            if held is not None:
                pending.add_(held.mass)
                pending_weight += held.weight
            verdict = self.guard.judge(sender, pending, pending_weight, self.state.x, self.state.w,
                                       claim=(weight, scale))
            if isinstance(verdict, Refusal):
                raise GossipInputError(verdict.reason, verdict.message)
            self.algorithm.take(sender, decoded)
            self.guard.accept(sender, verdict)  # charged first: the message that quarantines its sender is held whole
            self._admit(sender, pending, pending_weight,
                        replace(verdict, fraction=0.0) if self.guard.is_quarantined(sender) else verdict)
        else:
            self.algorithm.apply(sender, decoded, weight, scale, self.state.x)
            self.state.w += weight
            self.guard.accept(sender, None)
        edge.record_applied(seq)
        self.distances.observe(sender, self.algorithm.sender_view(sender, decoded, weight, scale), own,
                               dense=decoded.indices is None)
        self.in_edges[sender] = edge
        self.departed_in.pop(sender, None)
        return True

    def _admit(self, sender: str, pending: torch.Tensor, pending_weight: float, admission: Admission) -> None:
        """Apply the admitted fraction of ``sender``'s pending mass (``pending``, overwritten) and hold the rest."""
        fraction = admission.fraction
        if fraction >= 1.0:
            self.state.x.add_(pending)
            self.state.w += pending_weight
            self.held_from.pop(sender, None)
            return
        applied = pending * fraction
        self.state.x.add_(applied)
        self.state.w += fraction * pending_weight
        # the rest as pending - applied (not pending * (1 - f)): x + held gains exactly what was pending
        self.held_from[sender] = HeldMass(pending.sub_(applied), pending_weight - fraction * pending_weight)

    def drain_held(self) -> None:
        """Apply, within the radius, what clipping held back from each sender that is not quarantined (once per
        round, before training: a neighbour that went quiet still has its mass applied). Charges nobody."""
        for sender, held in list(self.held_from.items()):
            if self.guard.is_quarantined(sender):
                continue  # held, counted, never applied until an operator releases it
            verdict = self.guard.judge(sender, held.mass, held.weight, self.state.x, self.state.w)
            if isinstance(verdict, Refusal) or verdict.fraction <= 0.0:
                continue
            del self.held_from[sender]
            self._admit(sender, held.mass, held.weight, verdict)

    @staticmethod
    def _refuse(refusal: Refusal | None) -> None:
        """Raise the robust rule's refusal as a GossipInputError (nothing was changed): the transport ends the
        stream and the sender's handshake retracts the message, as for a dropped one."""
        if refusal is not None:
            raise GossipInputError(refusal.reason, refusal.message)

    def charge_refusal(self, sender: str, error: GossipInputError) -> None:
        """Charge a message refused before :meth:`apply` (a payload that does not decode or is not finite, an
        implausible weight) to its sender's anomaly score; a sender this engine keeps no state for and has no room
        for is not recorded (a flood of forged ids allocates nothing)."""
        if sender == self.peer_id or error.reason not in _CHARGED or not self.guard.config.enabled:
            return
        if sender not in self.guard.neighbours and sender not in self.known_peers() \
                and len(self.guard.neighbours) >= self.max_peers:
            return
        self.guard.charge(sender, REASON_NON_FINITE if error.reason == "bad_payload" else error.reason,
                          self.guard.config.severe, str(error))

    def quarantined(self) -> set[str]:
        """Neighbours this peer takes nothing from and sends nothing to (peer/gossip/robust.py)."""
        return self.guard.quarantined()

    def release(self, peer_id: str) -> bool:
        """Operator release of a quarantined neighbour (False: it was not quarantined)."""
        return self.guard.release(peer_id)

    def model_sketch(self) -> torch.Tensor:
        """The count-sketch of this peer's de-biased model (what a consensus probe carries; peer/gossip/sketch.py)."""
        return sketch(self.state.debiased())

    def observe_probe(self, sender: str, values: torch.Tensor) -> None:
        """``sender``'s consensus probe (the sketch ``values`` of its model) arrived: record its estimated distance
        from this peer's model, as a dense message's would be (a quarantined sender's probe changes nothing, as its
        messages do not)."""
        if self.guard.check_sender(sender) is None:
            self.distances.observe_distance(sender, estimated_distance(values, self.state.debiased()))

    def receive(self, sender: str, seq: int, weight: float, scale: float,
                payload: bytes | memoryview) -> bool:
        """Check, decode and apply one message (single-threaded callers and tests).

        Raises:
            GossipInputError: the message is malformed or hostile; nothing was changed.
        """
        try:
            self.check_update(sender, seq, weight, scale)
            decoded = self.decode(payload)
        except GossipInputError as exc:
            self.charge_refusal(sender, exc)
            raise
        return self.apply(sender, seq, weight, scale, decoded)

    def answer_hello(self, sender: str, hello: Hello) -> HelloReply:
        """Receiver side of the handshake (atomic: the caller holds the lock).

        Raises:
            GossipInputError: the Hello is malformed; nothing was changed.
        """
        if sender == self.peer_id:
            raise GossipInputError("self", "hello claims to come from this peer itself")
        self._refuse(self.guard.check_sender(sender))
        known = self.known_peers()
        if sender not in known and len(known) >= self.max_peers:
            raise GossipInputError("peer_limit", f"this peer already keeps state for {len(known)} peers (max_peers "
                                                 f"{self.max_peers}); refusing new peer {sender!r}")
        edge = self.in_edges.get(sender) or self.departed_in.get(sender) or InboundEdge()
        try:
            reply = edge.answer(hello, self.algorithm.in_digest(sender))
        except HelloError as exc:
            raise GossipInputError("bad_hello", f"hello refused: {exc}") from None
        self.in_edges[sender] = edge
        self.departed_in.pop(sender, None)
        if reply.reset:
            self.algorithm.reset_in(sender)
        return reply

    # --- membership --------------------------------------------------------------------------------------------
    def forget_peer(self, peer_id: str) -> bool:
        """Drop the edge state of a peer that left (out-edge, algorithm state such as Choco's replicas). Refused
        (False) while messages to it are in flight: their fate is unknown until a handshake settles them.

        The inbound ledger (last applied seq, fence) moves to :attr:`departed_in` instead of vanishing: the peer may
        still hold unacknowledged messages this peer applied, and if it returns, its handshake must find them
        applied (else it retracts their mass while this peer keeps it). Choco's replicas are gone, so that
        handshake's digests differ and the edge resets consistently."""
        edge = self.out_edges.get(peer_id)
        if edge is not None and edge.in_flight:
            return False
        self.out_edges.pop(peer_id, None)
        inbound = self.in_edges.pop(peer_id, None)
        if inbound is not None:
            self.departed_in[peer_id] = inbound
            self.departed_in.move_to_end(peer_id)
            while len(self.departed_in) > MAX_DEPARTED:
                self.departed_in.popitem(last=False)
        self.algorithm.forget(peer_id)
        self.guard.forget(peer_id)
        self.distances.forget(peer_id)
        return True

    # --- checkpoint --------------------------------------------------------------------------------------------
    def checkpoint_state(self) -> EngineState:
        """Everything needed to resume exactly, and to rebuild this engine from it alone (:meth:`from_state_dict`).
        In-flight records are :meth:`Sent.checkpoint_record` dicts."""
        return EngineState(
            algorithm=self.algorithm.name.value, x=self.state.x, w=self.state.w,
            layout=[(seg.name, tuple(seg.shape)) for seg in self.layout.segments],
            codec=self.algorithm.codec, gamma=self.gamma, window=self.window,
            out_edges={k: OutEdgeState(e.next_seq, {seq: s.checkpoint_record() for seq, s in e.in_flight.items()})
                       for k, e in self.out_edges.items()},
            in_edges={k: replace(e) for k, e in self.in_edges.items()},
            departed_in_edges={k: replace(e) for k, e in self.departed_in.items()},
            algorithm_state=self.algorithm.state_dict(),
            generator=self._generator.get_state(),
            robust=self.guard.state_dict(),
            held={k: (h.mass, h.weight) for k, h in self.held_from.items()},
        )

    def state_dict(self) -> dict[str, Any]:
        """:meth:`checkpoint_state` as tensors and plain data, readable by torch's weights-only loader."""
        return self.checkpoint_state().to_dict()

    @classmethod
    def from_state_dict(cls, peer_id: str, sd: Mapping[str, Any],
                        device: torch.device | None = None) -> GossipEngine:
        """The engine :meth:`state_dict` described, rebuilt through the constructor and :meth:`load_state_dict`:
        what reads a checkpoint's in-flight mass (peer/fleet/mass.py) runs the engine's own code."""
        state = EngineState.from_dict(sd)
        layout = Layout.from_named_shapes(state.layout)
        x0 = state.x if device is None else state.x.to(device)
        engine = cls(peer_id, layout, x0, state.algorithm, state.codec, gamma=state.gamma, window=state.window)
        engine.load_state(state)
        return engine

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        """Restore from :meth:`state_dict`, or an earlier version's checkpoint (layout and algorithm must match)."""
        self.load_state(EngineState.from_dict(sd))

    def load_state(self, state: EngineState) -> None:
        """Restore ``state`` (layout and algorithm must match)."""
        if state.x.numel() != self.layout.numel or Layout.from_named_shapes(state.layout) != self.layout:
            raise ValueError("checkpoint is for another model layout")
        if state.algorithm != self.algorithm.name:
            raise ValueError(f"checkpoint is for algorithm {state.algorithm!r}, this peer runs "
                             f"{self.algorithm.name.value!r}")
        device = self.state.x.device
        self.state = PushSumState(x=state.x.to(device, copy=True), w=state.w)
        self.out_edges = {k: OutboundEdge(e.next_seq, {seq: Sent.from_checkpoint_record(r, device)
                                                       for seq, r in e.in_flight.items()})
                          for k, e in state.out_edges.items()}
        self.in_edges = {k: replace(e) for k, e in state.in_edges.items()}
        self.departed_in = OrderedDict((k, replace(e)) for k, e in state.departed_in_edges.items())
        self.algorithm.load_state_dict(state.algorithm_state)
        self._generator.set_state(state.generator)
        self.guard.load_state_dict(state.robust)
        self.held_from = {k: HeldMass(mass.to(device, copy=True), float(weight))
                          for k, (mass, weight) in state.held.items()}

