"""The robust receive rule: what any one neighbour can do to this peer per message is bounded, and a neighbour whose
messages imply an implausible model is quarantined (docs/design.md#byzantine-robust-receive-rule). Pure: no sockets, no
clock of its own (callers pass rounds), so the simulator and the daemon run this same code inside the engine.

The contribution of a sender's pending mass - its message plus what earlier clipping held back from it - is the
change it would make to this peer's de-biased model: with numerator mass ``m`` (after decoding and, for Choco, after
the replica update) and push-sum weight ``omega`` added to ``(x, w)``,

    delta = (x + m) / (w + omega) - x / w = (m - omega * z) / (w + omega),   z = x / w

(judged with ``max(w, 1)`` for ``w``: weights wander, and a peer that gave most of its weight away must still take
the honest messages that bring it back; its bound is then looser by that factor).

Self-centred clipping (He, Karimireddy and Jaggi 2022) bounds ``|delta|`` by a radius taken from this peer's own
state: ``radius_factor`` times the largest of its own per-round training movements ``|z_after - z_before|``
(received gossip excluded) over the last ``history`` rounds (an honest neighbour's contribution is a share of the
disagreement, which training builds up at that pace; the radius follows the learning-rate schedule up at once and
down ``history`` rounds later, as the disagreement built at the higher rate fades), never more than ``max_relative``
times ``|z|`` and never less than ``floor_relative`` times it (rounding noise; at lr = 0 every honest contribution
is at that level, and at least the relative size of what the algorithm's codec moves by rounding alone: int8 dense
SGP rounds the whole model, and a message moves the receiver by its share of that, under 0.8% of the norm). The
radius is not taken from the neighbours' own messages: in a directed ring a peer hears from one neighbour only, which
could then widen its own radius message by message. Where training moved the model by less than the floor in every
one of those rounds (lr 0, training over), the radius is the consensus phase's (``consensus_relative`` of ``|z|``):
at the floor gossip would never close a disagreement.

Pending mass beyond the radius is *clipped*: the largest fraction ``f`` of it (numerator and weight alike, so the
part applied carries the sender's model, not a shrunken one) whose contribution is the radius is applied, and the
rest is *held* for that sender - acknowledged, counted in this peer's mass (:meth:`GossipEngine.held`), applied by
the next admissions (its next message, and each round's :meth:`GossipEngine.drain_held`). So push-sum mass stays
exact, the two Choco replicas of an edge are updated together as always, and gossip keeps mixing at the radius's
pace while a neighbour is clipped. The rule first refused such a message whole (a dropped message to the ledger:
the sender took its mass back): in a real 2-daemon fleet that fed itself - no mixing, a growing disagreement, a
larger next message, a Choco edge reset by the retraction - until the honest neighbour was quarantined
(docs/decisions/robust-radius.md). Clipping itself is not charged: after a partition
heals or a neighbour restarts from an older checkpoint an honest neighbour is clipped for many rounds in a row, while
the gap closes at the radius's pace (charging it quarantined the honest side of every healed link cut in the netns
fault tests). What is charged is an implausible sender: pending mass whose implied sender model (numerator over
weight: the shares of a dense push-sum message, a Choco replica) is more than ``max_disagreement`` times the norm of
this peer's model away from it - a sign flip is 2, a x10 scaling 9, an honest neighbour a few tenths after a long
partition - or, where the mass carries no model (Deep-Squeeze), whose contribution is ``severe`` radii or more.
Such mass is *gross*: held whole, not clipped, so an insider's first message moves nothing, and charged: an implied
model that far quarantines its sender at once (``implausible_score``), mass without a model ``severe``.
Before ``warmup`` rounds were measured only the ``max_relative`` cap holds, pending mass beyond it is held whole (no
measured radius to clip to yet) and nothing is charged.

The weight a message moves is bounded too: the sender weight it claims (``omega / scale``) must not exceed
``max_sender_weight`` (the fleet's weights average 1, so an honest sender of any degree holds a few at most;
beyond it the message is refused whole, as a dropped one), and no admission lifts this peer's own weight above that
same bound (the rest is held). Weight inflation just under the engine's hard ``max_peers`` bound therefore moves
this peer's weight to at most ``max_sender_weight``.

The sender's anomaly score is charged ``severe`` for gross mass, a weight claim, a non-finite or undecodable
payload, or a divergence it caused (:meth:`ReceiveGuard.suspect`: its applied contributions came near the radius);
every other admission decays it by ``decay``. An insider that stays within ``max_disagreement`` (a little shift,
or a Choco sign flip early in training, when the models are still near their common start) is not quarantined: it
is clipped, so it moves this peer by at most the radius per message, and how often shows as its clipped fraction.
One far outside what the other neighbours show is an *outlier* (:meth:`ReceiveGuard.outlier_threshold`): its radius
and the share this peer sends it are cut in proportion, and one that stays far without closing the gap is charged as
a persistent outlier (:meth:`ReceiveGuard.persistent_outlier`). A Choco sender whose replica travels from the common
start against this peer's own travel is judged with a narrower radius once the fleet has a direction
(:meth:`ReceiveGuard.heading_factor`: a sign flip's mirrored replica is held), and one that keeps pointing against it
is charged (:meth:`ReceiveGuard.reversed_heading`). At ``quarantine_score`` the sender is
quarantined: none of its messages or Hellos are taken, none are sent to it (the round leaves it out of the live set),
what is held for it stays held (counted, never applied) until an operator releases it. Honest neighbours under skew and
heavy compression are clipped now and then, which is never charged: no honest peer was quarantined in any simulator
run (tests/test_gossip_robust.py, bench/robust.py) or daemon test (tests/test_daemon_insider.py, the netns tests).
The README fleet (int8 dense SGP, skew 0.9) quarantined an honest in-neighbour on one divergence of the peer's own
in 2 runs of 4, when one divergence was enough: it now takes ``divergence_strikes``
(:meth:`ReceiveGuard.charge_divergence`), and a divergence after a step of its own that moved it farther than
the neighbour did is charged to nobody (:meth:`ReceiveGuard.suspect`); and once as a persistent outlier judged
against a stale reference: the references are now the schedule's senders (:meth:`ReceiveGuard.references`).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch

from peer.gossip.notices import NoticeBook
from peer.gossip.pushsum import MIN_WEIGHT
from peer.gossip.sinks import LET_BACK, ROUTED, RouteEvent, SinkRoute

#: Reasons the rule refuses a message (GossipInputError.reason, counter keys).
REASON_IMPLAUSIBLE = "implausible_model"
REASON_WEIGHT_CLAIM = "weight_claim"
REASON_QUARANTINED = "quarantined"
REASON_NON_FINITE = "non_finite"
REASON_OUTLIER = "persistent_outlier"
REASON_TRAVELLED = "travelled_too_far"
REASON_STRONG = "strong_outlier"
REASON_REVERSED = "reversed_heading"
#: A persistent outlier's implied distance closes by less than this fraction of itself over ``outlier_rounds``.
OUTLIER_CLOSING = 0.2
#: A strong outlier is judged only beside another neighbour within this many of this peer's radii
#: (:meth:`ReceiveGuard.strong_outlier`): this peer is not the one that strayed.
STRONG_NEAR = 2.0
#: A divergence is charged to a neighbour whose contributions since the last healthy round averaged at least this
#: fraction of the radius (ReceiveGuard.suspect).
SUSPECT_FRACTION = 0.5


@dataclass(frozen=True)
class RobustConfig:
    """Parameters of the receive rule (dimensionless unless said otherwise).

    Attributes:
        enabled: apply the rule (False: the paper's plain push-sum receive; quarantine still refuses).
        radius_factor: a contribution may be this many times the largest of this peer's recent per-round training
            movements.
        max_relative: a contribution is never larger than this fraction of the norm of this peer's model.
        floor_relative: the radius is never below this fraction of the norm of this peer's model.
        max_disagreement: a sender model (numerator over weight of its pending mass) farther than this fraction of
            this peer's model norm from this peer's model is implausible: held whole and charged ``severe``.
        outlier_factor: a neighbour whose implied model is farther than this many times the nearest other
            neighbour's (never less than the codec's rounding floor) has its radius, and the share this peer sends
            it, narrowed in proportion (:meth:`ReceiveGuard.outlier_factor`).
        persistent_factor: a neighbour farther than this many times that threshold in every message for
            ``outlier_rounds`` rounds, its distance not closing, is charged ``severe``
            (:meth:`ReceiveGuard.persistent_outlier`): 8 times the nearest at the defaults, where clean runs stay
            within 3 (on the rotating exponential graph at skew 0.8 the honest neighbours sat 0.025-0.055 apart
            beside a "shift" insider at 0.46: 16 times would not have caught it).
        outlier_rounds: rounds a strong outlier may stay one, not closing, before it is charged.
        strong_factor: a neighbour whose implied model is farther than this many of this peer's training radii
            (``radius_factor`` times its largest recent own movement, uncapped) in ``strong_messages`` messages in a
            row, not closing, beside another neighbour within :data:`STRONG_NEAR` radii, is charged ``severe``
            (:meth:`ReceiveGuard.strong_outlier`). Honest neighbours sat within 1 radius in clean simulator runs of
            dense SGP (a device back after 21 rounds offline too, at its first message), "shift" insiders at 10-60.
        strong_messages: messages in a row a neighbour must be a strong outlier before it is charged.
        travel_factor: where messages imply their sender's trajectory from the fleet's common start (Choco's
            replicas), a sender model that travelled from that start more than this many times as far as this
            peer's model and the nearest other neighbour's did (the farther of the two) is implausible: held whole
            and charged ``severe`` (:meth:`ReceiveGuard.travelled_too_far`; never judged without another neighbour).
            Honest neighbours stayed within 1.1 times in clean simulator runs (ring and exponential graph, skew 0
            and 0.8) and 2.0 beside a x10 insider, which sat at 4.4 and more. One radius is allowed on top (what a
            clipped admission may move an honest neighbour by).
        heading_cut: where messages imply their sender's trajectory, a sender whose travel from the common start
            points away from this peer's own travel is judged with a narrower radius: the full radius at a cosine
            of ``heading_cut / 2`` or more, none at ``-heading_cut / 2`` (:meth:`ReceiveGuard.heading_factor`).
            Honest Choco replicas sat at +0.12 and above after round 29 in simulator runs at skew 0.8, a
            sign-flipped one at -0.02 to -0.24; 0.1 kept more of the honest fleet's accuracy than 0.2, and centring
            the cut on 0 more than ending it there (docs/RESULTS.md).
        heading_after: rounds before the heading is judged: the fleet's common direction takes a while to form.
            Honest Choco replicas sat at +0.004 and above from round 10 in simulator runs at skew 0.8 (ring and
            exponential graph; -0.01 in rounds 5-9); judging from round 15 instead of 30 quarantined two flipped
            insiders on the ring at round 20 instead of 35 and left the honest peers 1.8 points under their devices
            absent instead of 5.9 (4 epochs, 3 seeds; docs/RESULTS.md).
        heading_messages: messages in a row whose travel points against this peer's own (cosine below 0) at
            which a sender is charged ``severe``, and at each one after (:meth:`ReceiveGuard.reversed_heading`:
            quarantined at the next). Honest replicas never had one below 0 from round 10 in those runs, nor in the
            status of a README fleet's daemons from round 15 (+0.074 and above); sign-flipped ones below 0 in every
            message.
        consensus_relative: the radius during a consensus phase, as a fraction of the norm of this peer's model:
            no training moves the model then and dense messages close disagreements of a third of its norm and
            more, so only gross attacks (scaled, non-finite, inflated weight) are refused in the phase.
        history: rounds of own training movement the radius looks back on.
        warmup: rounds measured before the radius applies and refusals beyond it are charged.
        max_sender_weight: largest push-sum weight a message may claim its sender holds, and largest weight a
            message may lift this peer to (the fleet's mean weight is 1).
        decay: factor on a neighbour's score per accepted message.
        severe: score a weight claim, a non-finite payload, a caused divergence, a persistent outlier or a replica
            that travelled too far adds.
        implausible_score: score an implausible model adds (pending mass whose implied sender model is farther than
            ``max_disagreement`` of the norm from this peer's; where mass carries a model): ``quarantine_score``, so
            one such message quarantines its sender. No honest neighbour comes near it (0.03-0.1 of the norm under
            skew 0.8, a few tenths after a long partition), while every round an insider stays in, the peers the
            schedule has sending to it hand it their shares, lost to the honest fleet: a x100 sleeper quarantined at
            its second gross message cost dense SGP on the undirected ring at skew 0.8 19 points against its device
            simply leaving, at its first 6 (docs/RESULTS.md).
        quarantine_score: score at which a neighbour is quarantined.
        divergence_strikes: divergences charged to one neighbour within ``strike_rounds`` rounds that quarantine it
            (:meth:`ReceiveGuard.charge_divergence`). The first ones are strikes: rolled back without halving gamma
            and ``severe`` added to its score. One is not enough evidence: in the README fleet (4 daemons, int8
            dense SGP, skew 0.9) an honest peer's own loss spike at the end of the warm-up (13-155 against a mean
            of 1.25-3.0) was charged to its ring in-neighbour in 2 runs of 4; quarantined, the neighbour was the
            peer's only sender, its push-sum weight went to 1e-29 and the fleets ended at 15.8% and 23.4% mean
            device accuracy.
        strike_rounds: rounds a divergence strike counts.
        sink_rounds: rounds in which the schedule had a neighbour send to this peer, with nothing of it applied,
            after which it is a mass sink (or gone silent) until one of its messages is applied: status flags it
            and, if it took some of this peer's mass meanwhile, the schedule routes around it (peer/gossip/sinks.py).
        sink_probe_rounds: rounds from routing around a sink to its first probe (the backoff then doubles).
        sink_backoff_cap: largest number of rounds between two probes of a sink.
        notice_quorum: the fewest notifiers whose quarantine notices exclude the suspect from every peer's
            schedule; every peer the suspect sends to must have named it as well (peer/gossip/notices.py). Why 1:
            every receiver agreeing is the protection (two slanderers that hear from an honest peer with a third
            receiver are vetoed); a floor of 2 only kept notices from ever acting where a suspect has one receiver
            - the static directed ring of the README fleet, where its only sender then fed it half its weight
            every round and every honest push-sum weight drained to 0 (tests/test_sim_attacks.py). The price
            there: a slandering insider cuts off its one sender (docs/design.md#quarantine-notices).
        notice_every: rounds between the notices a peer that quarantines someone sends (and at once on a change).
        notice_ttl: rounds a received notice counts (a few of ``notice_every``: a notice or two may be lost).
    """

    enabled: bool = True
    radius_factor: float = 4.0
    max_relative: float = 0.1
    floor_relative: float = 1e-4
    max_disagreement: float = 1.0
    outlier_factor: float = 4.0
    persistent_factor: float = 2.0
    outlier_rounds: int = 10
    strong_factor: float = 8.0
    strong_messages: int = 3
    travel_factor: float = 3.0
    heading_cut: float = 0.1
    heading_after: int = 15
    heading_messages: int = 5
    consensus_relative: float = 1.0
    history: int = 30
    warmup: int = 2
    max_sender_weight: float = 8.0
    decay: float = 0.8
    severe: float = 3.0
    implausible_score: float = 6.0
    quarantine_score: float = 6.0
    divergence_strikes: int = 2
    strike_rounds: int = 100
    sink_rounds: int = 3
    sink_probe_rounds: int = 40
    sink_backoff_cap: int = 640
    notice_quorum: int = 1
    notice_every: int = 3
    notice_ttl: int = 12

    def __post_init__(self) -> None:
        for name in ("radius_factor", "max_relative", "floor_relative", "max_disagreement", "outlier_factor",
                     "persistent_factor", "strong_factor", "travel_factor", "heading_cut",
                     "consensus_relative", "max_sender_weight",
                     "severe", "implausible_score", "quarantine_score"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0.0):
                raise ValueError(f"robust.{name}: expected a finite number > 0, got {value!r}")
        if not 0.0 <= self.decay < 1.0:
            raise ValueError(f"robust.decay: expected [0, 1), got {self.decay!r}")
        if self.sink_rounds < 1:
            raise ValueError(f"robust.sink_rounds: expected >= 1, got {self.sink_rounds}")
        if not 1 <= self.sink_probe_rounds <= self.sink_backoff_cap:
            raise ValueError(f"robust.sink_probe_rounds and sink_backoff_cap: expected 1 <= probe <= cap, got "
                             f"{self.sink_probe_rounds}, {self.sink_backoff_cap}")
        if self.outlier_rounds < 1 or self.strong_messages < 1 or self.heading_messages < 1:
            raise ValueError(f"robust.outlier_rounds, robust.strong_messages and robust.heading_messages: expected "
                             f">= 1, got {self.outlier_rounds}, {self.strong_messages}, {self.heading_messages}")
        if self.notice_quorum < 1 or not 1 <= self.notice_every <= self.notice_ttl:
            raise ValueError(f"robust.notice_quorum >= 1 and 1 <= robust.notice_every <= robust.notice_ttl expected, "
                             f"got {self.notice_quorum}, {self.notice_every}, {self.notice_ttl}")
        if self.divergence_strikes < 1 or self.strike_rounds < 1:
            raise ValueError(f"robust.divergence_strikes and robust.strike_rounds: expected >= 1, got "
                             f"{self.divergence_strikes}, {self.strike_rounds}")
        if self.history < 1 or self.warmup < 0 or self.heading_after < 0:
            raise ValueError(f"robust.history >= 1, robust.warmup >= 0 and robust.heading_after >= 0 expected, got "
                             f"{self.history}, {self.warmup}, {self.heading_after}")


class Travel:
    """How far, and which way, a sender's pending mass and this peer's model travelled from the fleet's common
    start (model units): computed on first use and shared by :meth:`ReceiveGuard.travelled_too_far` and
    :meth:`ReceiveGuard.heading_factor`, so a Choco message is differenced against the start once, not twice.
    Float32 norms: the tests on them are factors of 3 and cosines, and a float64 norm of 270k values took 3.4 ms
    here against 0.2 ms."""

    def __init__(self, start: torch.Tensor, pending: torch.Tensor, pending_weight: float, x: torch.Tensor,
                 w: float) -> None:
        self._start, self._pending, self._pending_weight, self._x, self._w = start, pending, pending_weight, x, w

    @cached_property
    def theirs(self) -> torch.Tensor:
        """The sender's implied model minus the start."""
        return self._pending / self._pending_weight - self._start

    @cached_property
    def own(self) -> torch.Tensor:
        """This peer's de-biased model minus the start."""
        return self._x / self._w - self._start

    @cached_property
    def theirs_norm(self) -> float:
        return float(torch.linalg.vector_norm(self.theirs))

    @cached_property
    def own_norm(self) -> float:
        return float(torch.linalg.vector_norm(self.own))


@dataclass
class NeighbourRecord:
    """What this peer knows of one in-neighbour's behaviour.

    Attributes:
        score: anomaly score (quarantine at the config's ``quarantine_score``).
        accepted: messages admitted (wholly or, clipped, in part).
        clipped: admitted messages the radius clipped (part of the pending mass held back).
        refused: messages the rule refused whole (weight claim, non-finite).
        charged: sum over its messages applied since the last healthy round of contribution / radius (what a
            divergence is charged by), and ``charged_messages`` their count.
        moved: the norms of those contributions, summed (model units): what it could have moved this peer by,
            against what this peer's own training moved it (:meth:`ReceiveGuard.suspect`).
        silent_rounds: rounds in which the schedule had it send to this peer since one of its messages was last
            applied (a sink at the config's ``sink_rounds``).
        taken: this peer's messages it applied (settled as delivered by an Ack or a handshake) since one of its
            messages was last applied here. A silent neighbour is routed around only if it took some: a sink takes
            mass and returns none, while a peer that is down, cut off or restarting takes none (what is sent to it
            waits in flight), so routing around it would save nothing and would leave it out of the schedule once
            it is back - and it, silent on this side too, would route around this peer: neither sent to the other
            until a probe 40 rounds later.
        implied: the round of its last message and how far the model that message implied was from this peer's
            (relative to ``|z|``); None before a message of a model-carrying algorithm. What the other neighbours
            are compared with (:meth:`ReceiveGuard.outlier_factor`). Not checkpointed: a restarted peer measures
            it anew.
        narrowed: the fraction of the radius its last message was judged with (:meth:`ReceiveGuard.outlier_factor`;
            1: not an outlier).
        travelled: the round of its last plausible message and how far the model it implied was from the fleet's
            common start (model units; None: not known, or the algorithm's messages carry no trajectory). What the
            other neighbours are compared with (:meth:`ReceiveGuard.travelled_too_far`). Not checkpointed.
        heading: the cosine of its last message's travel from the common start with this peer's own travel
            (:meth:`ReceiveGuard.heading_factor`; None: not judged yet). Not checkpointed.
        reversed_streak: its messages in a row whose travel pointed against this peer's own
            (:meth:`ReceiveGuard.reversed_heading`). Not checkpointed.
        outlier_since: the round from which every message of it was a strong outlier and its implied distance then
            (:meth:`ReceiveGuard.persistent_outlier`; None: it is not one).
        strong_streak: its messages in a row that were strong outliers against this peer's own radius, and the
            implied distance of the first (:meth:`ReceiveGuard.strong_outlier`; None: its last one was not).
        returned: the round its messages resumed after a silence longer than ``history`` rounds, or first came when
            this peer had run ``history`` rounds without it (a device back from a long absence holds a stale model
            until it mixed); None: heard since this peer's start. Not judged a strong outlier for ``history`` rounds
            from it.
        sent_round: the last round this peer sent to it (None: never): a neighbour this peer also sends to mixes
            with it both ways and sits nearer than one it only hears (:meth:`ReceiveGuard.references`).
        strikes: the rounds of the divergences charged to it within the config's ``strike_rounds``.
        quarantined_since: the round this peer quarantined it (None: not quarantined).
        why: the last reason it was charged for.
        route: how this peer routes around it as a sink (None: it is in the schedule).
    """

    score: float = 0.0
    accepted: int = 0
    clipped: int = 0
    refused: int = 0
    charged: float = 0.0
    charged_messages: int = 0
    moved: float = 0.0
    silent_rounds: int = 0
    taken: int = 0
    implied: tuple[int, float] | None = None
    narrowed: float = 1.0
    travelled: tuple[int, float] | None = None
    outlier_since: tuple[int, float] | None = None
    strong_streak: tuple[int, float] | None = None
    returned: int | None = None
    heading: float | None = None
    reversed_streak: int = 0
    sent_round: int | None = None
    strikes: list[int] = field(default_factory=list)
    quarantined_since: int | None = None
    why: str = ""
    route: SinkRoute | None = None

    @property
    def clipped_fraction(self) -> float:
        """Fraction of its messages the rule clipped or refused (the status document's "clipped fraction")."""
        total = self.accepted + self.refused
        return (self.clipped + self.refused) / total if total else 0.0


@dataclass(frozen=True)
class Refusal:
    """Why the rule refuses a message: a counter key and one line for the log."""

    reason: str
    message: str


@dataclass
class HeldMass:
    """What clipping held back from one sender: push-sum numerator mass (dense, model units) and weight. Counted in
    this peer's mass (exactly once), applied by later admissions."""

    mass: torch.Tensor
    weight: float


@dataclass(frozen=True)
class Admission:
    """How much of a sender's pending mass (its message plus what is held for it) this peer applies now.

    Attributes:
        fraction: of the pending numerator mass and weight, applied now (the rest is held), in [0, 1].
        norm: contribution norm of the WHOLE pending mass (model units; what the sender is charged by).
        applied_norm: contribution norm of the fraction applied.
        radius: the radius it was judged against (model units; 0: no radius, a drained peer takes everything).
        clipped: the radius (not the weight bound or the warm-up) made the fraction less than 1.
        gross: the pending mass is implausible (held whole, charged ``severe``).
        why: the reason a gross admission is charged for.
        evidence: what the judgement saw, for the log line of a quarantine it leads to ("" where nothing more
            than ``why`` is worth saying).
    """

    fraction: float
    norm: float
    applied_norm: float
    radius: float
    clipped: bool = False
    gross: bool = False
    why: str = REASON_IMPLAUSIBLE
    evidence: str = ""


@dataclass
class ReceiveGuard:
    """The receive rule and the per-neighbour records of one peer.

    ``round`` is this peer's current round (set by the round's driver, peer/runtime/peer.py): it labels
    quarantines and dates the neighbours' implied distances.
    """

    config: RobustConfig = field(default_factory=RobustConfig)
    neighbours: dict[str, NeighbourRecord] = field(default_factory=dict)
    own_moves: deque[float] = field(default_factory=deque)
    round: int = 0
    #: Relative size of what an honest message moves by rounding alone (set by the engine from its algorithm and
    #: codec, :meth:`peer.gossip.algorithms.Algorithm.noise_floor`): the radius never goes below it.
    noise_floor: float = 0.0
    #: Factor on ``radius_factor`` for the engine's algorithm (:meth:`peer.gossip.algorithms.Algorithm.radius_scale`:
    #: Choco's small gamma steps get a quarter).
    radius_scale: float = 1.0
    #: Quarantines not yet reported (the driver logs them once): (neighbour, reason).
    new_quarantines: list[tuple[str, str]] = field(default_factory=list)
    #: Sinks routed around or let back in, not yet reported (the driver logs them once).
    route_events: list[RouteEvent] = field(default_factory=list)
    #: The sorted live set the last round's schedule was computed over (:meth:`expect_from`; None before one).
    schedule_view: tuple[str, ...] | None = None
    #: The neighbours that schedule has send to this peer within one period of the graph (:meth:`expect_from`;
    #: None before one: every neighbour). Only they are references for the outlier rules (:meth:`references`).
    schedule_senders: frozenset[str] | None = None
    #: Whether numerator mass over weight is the sender's model for the engine's algorithm
    #: (:meth:`peer.gossip.algorithms.Algorithm.mass_carries_model`): gross mass is judged by that model if so.
    mass_carries_model: bool = True
    #: Whether the implied models of different neighbours are comparable
    #: (:meth:`peer.gossip.algorithms.Algorithm.models_comparable`): outliers are judged only then (dense SGP).
    models_comparable: bool = True
    #: The model every peer of the fleet started from, where a message's implied model is its sender's trajectory
    #: from it (:meth:`peer.gossip.algorithms.Algorithm.common_start`: Choco's replicas); None: not judged.
    common_start: torch.Tensor | None = None
    #: Set while a consensus phase runs (docs/method.md#the-consensus-phase): no training moves the model then, and
    #: closing the peers' disagreement is the point, so the radius is ``consensus_relative`` of the model's norm,
    #: not the own-movement one (gross attacks - scaled, non-finite, inflated weight - are still refused). The same
    #: radius holds while ``history`` rounds measured no training movement at all.
    consensus_phase: bool = False
    #: Quarantine notices received and sent (peer/gossip/notices.py; not checkpointed: they are resent).
    notices: NoticeBook = field(default_factory=NoticeBook)

    def record(self, sender: str) -> NeighbourRecord:
        """The record of ``sender`` (created on first use; the engine bounds the senders it takes)."""
        if sender not in self.neighbours:
            self.neighbours[sender] = NeighbourRecord()
        return self.neighbours[sender]

    def is_quarantined(self, peer_id: str) -> bool:
        rec = self.neighbours.get(peer_id)
        return rec is not None and rec.quarantined_since is not None

    def quarantined(self) -> set[str]:
        return {p for p, rec in self.neighbours.items() if rec.quarantined_since is not None}

    @property
    def warmed_up(self) -> bool:
        """Whether enough own rounds were measured for the radius (before: only the ``max_relative`` cap)."""
        return len(self.own_moves) >= max(1, self.config.warmup)

    def consensus_radius(self, z_norm: float) -> bool:
        """Whether the radius is the consensus one: a phase runs, or training moved the model by less than the floor
        in each of ``history`` rounds."""
        return self.consensus_phase or (self.warmed_up and max(self.own_moves) <= self.config.floor_relative * z_norm)

    def radius(self, z_norm: float) -> float:
        """Largest contribution norm accepted now (same units as the model's parameters)."""
        floor = max(self.config.floor_relative, self.noise_floor) * z_norm
        cap = max(floor, self.config.max_relative * z_norm)
        if self.consensus_radius(z_norm):
            # training moved the model by less than the floor in each of ``history`` rounds (lr 0 - where the
            # measured movement is float rounding, not 0 - or training over): the own-movement radius is its floor,
            # at which gossip could never close a disagreement; as in a consensus phase, only implausible senders
            # (and the weight and finiteness checks) stand
            return max(floor, self.config.consensus_relative * z_norm)
        if not self.warmed_up:
            return cap
        return max(floor, min(cap, self.config.radius_factor * self.radius_scale * max(self.own_moves)))

    def outlier_threshold(self, peer_id: str, z_norm: float) -> float | None:
        """The implied distance (relative to ``|z|``) beyond which ``peer_id`` is an outlier: ``max(outlier_factor *
        nearest, rounding floor)``, ``nearest`` the smallest of the OTHER neighbours' latest implied distances
        (those within ``history`` rounds). None - nobody is - where nothing else is to compare with (a sender heard
        alone: an honest neighbour back from a partition would be slowed as much as an insider; a directed ring's
        peer hears one) and with the consensus radius (closing disagreements is then the point). Honest neighbours
        sit within 3 times the nearest (bench/robust.py, clean runs); the rounding floor keeps an insider that
        echoes this peer's own model (``nearest`` near 0) from making everybody else an outlier. None as well where
        the algorithm's implied models are not comparable across neighbours (Choco's replicas lag by each edge's
        backlog: an honest daemon was charged as a persistent outlier at 99% top-k)."""
        if not self.models_comparable or self.consensus_radius(z_norm):
            return None
        nearest = min(self.references(peer_id), default=None)
        if nearest is None:
            return None
        return max(self.config.outlier_factor * nearest, self.config.floor_relative, self.noise_floor)

    def references(self, peer_id: str, alike: bool = False) -> list[float]:
        """The OTHER neighbours' latest implied distances (relative to ``|z|``) within ``history`` rounds, the
        quarantined left out, and those the schedule no longer has send to this peer (:attr:`schedule_senders`):
        what ``peer_id`` is compared with. ``alike``: only those this peer sends to as it does to ``peer_id``
        (both, or neither, within ``history`` rounds: :meth:`mutual`).

        Why the schedule's senders only: a README fleet daemon (4 on a directed ring, dense SGP, skew 0.9) heard
        from a second neighbour for a few rounds while that neighbour's live set still lacked a peer, at the start,
        when every model was near the initial one; 30 rounds later that message was still its reference, its one
        real in-neighbour 8 times farther, charged as a persistent outlier and quarantined, and the fleet
        collapsed (25.6% mean device; 1 of the 6 runs that day before the fix). On a directed ring a peer hears one
        neighbour: nothing to compare with."""
        oldest = self.round - self.config.history
        mutual = self.mutual(peer_id)
        senders = self.schedule_senders
        return [rec.implied[1] for p, rec in self.neighbours.items() if p != peer_id and rec.quarantined_since is None
                and rec.implied is not None and rec.implied[0] >= oldest and (senders is None or p in senders)
                and (not alike or self.mutual(p) == mutual)]

    def mutual(self, peer_id: str) -> bool:
        """Whether this peer sent to ``peer_id`` within ``history`` rounds (they mix both ways)."""
        rec = self.neighbours.get(peer_id)
        return rec is not None and rec.sent_round is not None and rec.sent_round >= self.round - self.config.history

    def note_sent(self, receivers: Collection[str]) -> None:
        """This round's receivers (:meth:`mutual`)."""
        for receiver in receivers:
            self.record(receiver).sent_round = self.round

    @staticmethod
    def outlier_factor(implied: float, threshold: float | None) -> float:
        """The fraction of the radius, and of this peer's share (:meth:`send_factor`), a neighbour ``implied`` away
        gets: ``threshold / implied`` beyond the threshold (it then moves this peer as one at the threshold would),
        else 1. A consistent shift of half the model's norm, clipped to the plain radius every round, pulled whole
        rings of honest peers along (dense SGP: -12 to -49 points)."""
        return 1.0 if threshold is None or implied <= threshold else threshold / implied

    def send_factor(self, receiver: str, z_norm: float) -> float:
        """The fraction of this peer's usual share to send ``receiver``: :meth:`outlier_factor` of its latest implied
        distance (1 if none within ``history`` rounds). What clipping holds back from a sender is weight this peer
        sent it and did not get back: an insider far outside the spread took a third of its ring neighbours'
        weight each round (down to 0.04-0.1 at skew 0.8), and their own data then counted for little. With its
        share cut as its radius is, the sender keeps it; push-sum takes any column-stochastic split, so mass stays
        exact, and an honest outlier still mixes, at the reduced pace, until it is near."""
        rec = self.neighbours.get(receiver)
        if not self.config.enabled or rec is None or rec.implied is None \
                or rec.implied[0] < self.round - self.config.history:
            return 1.0
        return self.outlier_factor(rec.implied[1], self.outlier_threshold(receiver, z_norm))

    def persistent_outlier(self, sender: str, rec: NeighbourRecord, implied: float, threshold: float | None) -> bool:
        """Whether a neighbour's new message, ``implied`` away, is charged as a persistent outlier: farther than
        ``persistent_factor`` times the threshold in every message for ``outlier_rounds`` rounds while that distance
        closed by less than :data:`OUTLIER_CLOSING` of itself - the threshold taken from the neighbours this peer
        sends to as it does to ``sender`` (:meth:`references` ``alike``; none: never charged). Narrowing alone
        bounded a "shift" insider's pull, but a pull of a fraction of a radius per round in one fixed direction,
        never undone, still cost a ring at skew 0.8 15 points (55 vs 70 with the insider offline). An honest
        neighbour is far only after a partition or a restart, and then the gap closes: it mixes towards this peer at
        its own full radius (to it, this peer is not an outlier). Alike, because a neighbour this peer also sends to
        mixes with it both ways and sits structurally nearer: in the README fleet (4 daemons on a directed ring of
        degree 2, so each hears one neighbour it sends to and one it does not) a clean dense SGP daemon stayed 8x
        farther than the mutual one for 10 rounds, was quarantined, and the fleet's mass drained into it (1 run in
        20)."""
        alike = self.references(sender, alike=True)
        if threshold is not None and alike:
            threshold = max(self.config.outlier_factor * min(alike), threshold)
        if threshold is None or not alike or implied <= self.config.persistent_factor * threshold \
                or not self.warmed_up:
            rec.outlier_since = None
            return False
        if rec.outlier_since is None:
            rec.outlier_since = (self.round, implied)
            return False
        since, start = rec.outlier_since
        if implied < (1.0 - OUTLIER_CLOSING) * start:
            rec.outlier_since = (self.round, implied)  # closing: a new period starts
            return False
        return self.round - since >= self.config.outlier_rounds

    def note_contact(self, rec: NeighbourRecord) -> None:
        """Before a neighbour's new message is recorded: mark it :attr:`NeighbourRecord.returned` if it comes after
        a silence longer than ``history`` rounds, or first comes when this peer has run that long without it."""
        last = None if rec.implied is None else rec.implied[0]
        if (self.round >= self.config.history) if last is None else (self.round - last > self.config.history):
            rec.returned = self.round

    def strong_outlier(self, sender: str, rec: NeighbourRecord, implied: float, z_norm: float) -> bool:
        """Whether a neighbour's new message, ``implied`` away (relative to ``|z|``), is charged as a strong
        outlier: farther than ``strong_factor`` of this peer's own training radii (``radius_factor`` times its
        largest recent own movement, uncapped: what an honest neighbour's disagreement is built at) in
        ``strong_messages`` messages in a row while that distance closed by less than :data:`OUTLIER_CLOSING` of
        itself, beside another neighbour within :data:`STRONG_NEAR` radii (so this peer is not the one that
        strayed). Never for a neighbour :attr:`NeighbourRecord.returned` within ``history`` rounds, in a consensus
        phase, or where implied models are not comparable (Choco).

        Why: the outlier threshold is relative to the nearest other neighbour, and a peer that hears insiders
        most often drifts towards them, which moves its honest neighbours away and widens its own threshold: on
        the rotating exponential graph of 8 at skew 0.8, with two colluding "shift" insiders, peer-007 hears them
        in two rounds of three; it followed them within 14 rounds, its threshold no longer narrowed them, and the
        honest peers ended at 25.7% against 58.4% with the insiders absent (dense SGP). Measured against this
        peer's own radius the insiders sat 10-60 radii away from their first message, every honest neighbour
        within 1. A device back from a long absence is exempt while it mixes back in (``returned``)."""
        returning = rec.returned is not None and self.round - rec.returned < self.config.history
        if returning or not self.models_comparable or not self.warmed_up or z_norm <= 0.0 \
                or self.consensus_radius(z_norm):
            rec.strong_streak = None
            return False
        radius = self.config.radius_factor * self.radius_scale * max(self.own_moves) / z_norm
        if implied <= self.config.strong_factor * radius \
                or not any(d <= STRONG_NEAR * radius for d in self.references(sender)):
            rec.strong_streak = None
            return False
        count, start = rec.strong_streak or (0, implied)
        if implied < (1.0 - OUTLIER_CLOSING) * start:
            count, start = 0, implied  # closing: a new streak
        rec.strong_streak = (count + 1, start)
        return count + 1 >= self.config.strong_messages

    def record_own_move(self, norm: float) -> None:
        """This peer's training moved its model by ``norm`` this round (what the radius scales with)."""
        if math.isfinite(norm):
            self.own_moves.append(norm)
            while len(self.own_moves) > self.config.history:
                self.own_moves.popleft()

    def check_sender(self, sender: str) -> Refusal | None:
        """Refuse everything from a quarantined neighbour (messages and Hellos)."""
        if self.is_quarantined(sender):
            return Refusal(REASON_QUARANTINED, f"neighbour {sender} is quarantined since round "
                                               f"{self.neighbours[sender].quarantined_since}")
        return None

    def judge(self, sender: str, pending: torch.Tensor, pending_weight: float, x: torch.Tensor, w: float,
              claim: tuple[float, float] | None = None) -> Refusal | Admission:
        """How much of ``sender``'s pending mass - numerator ``pending`` (dense, not changed) and weight
        ``pending_weight``, its new message's plus what is held for it - this peer at ``(x, w)`` applies now.

        ``claim`` is the new message's ``(weight, scale)``: a sender weight ``weight / scale`` above
        ``max_sender_weight`` refuses the message whole (charged). None: no new message (a round's drain of what is
        held). Returns the refusal (already charged) or the admission to apply and then pass to :meth:`accept`
        (which charges it)."""
        limit = self.config.max_sender_weight
        if claim is not None and claim[0] / claim[1] > limit:
            weight, scale = claim
            return self.charge(sender, REASON_WEIGHT_CLAIM, self.config.severe,
                               f"weight {weight:.4g} at scale {scale:.4g} claims a sender weight of "
                               f"{weight / scale:.4g}, above the bound {limit:g}")
        # no admission lifts this peer's weight above the bound: the rest stays held until its own sending lowers it
        weight_room = 1.0 if w + pending_weight <= limit else max(0.0, limit - w) / pending_weight
        if w < MIN_WEIGHT:
            # a peer that gave nearly all its weight away (its sends to a neighbour that was down sat in flight)
            # holds no model of its own to judge by: x / w is rounding noise, x may be float32 denormals whose
            # norm is 0. Judged against that, every honest message was clipped to nothing and the peer stayed
            # drained for good; push-sum hands such a peer over to what it receives, so it is taken (the weight
            # bounds above still hold)
            return Admission(weight_room, 0.0, 0.0, 0.0)
        z_norm = float(torch.linalg.vector_norm(x, dtype=torch.float64)) / w
        # judged as if this peer held at least the fleet's mean weight 1: a peer that gave most of its weight away
        # (push-sum weights wander) would otherwise find every honest message too large and never recover it
        held_w = max(w, 1.0)
        distance = float(torch.linalg.vector_norm(pending - x * (pending_weight / w), dtype=torch.float64))
        norm = distance / (held_w + pending_weight)  # |m - omega z| / (w + omega)
        if not math.isfinite(norm):
            if claim is None:
                return Refusal(REASON_NON_FINITE, "held contribution is not finite")
            return self.charge(sender, REASON_NON_FINITE, self.config.severe, "contribution is not finite")
        radius = self.radius(z_norm)
        # a pending weight below MIN_WEIGHT (a sender that gave nearly all its weight away: 8e-46 in a CI run) carries
        # no model: its numerator is float32 rounding noise, and judged as one it quarantined an honest sender
        carries_model = self.mass_carries_model and pending_weight >= MIN_WEIGHT
        if carries_model:
            gross = distance > self.config.max_disagreement * pending_weight * z_norm  # |m / omega - z| vs |z|
        else:
            gross = norm >= self.config.severe * radius
        if gross:  # held whole; charged once the radius is measured (before, the peers' start may differ widely)
            # only what can be charged (after warm-up) can lead to a quarantine's log line
            evidence = (f"its pending mass implies a model {distance / max(pending_weight * z_norm, 1e-300):.3g} "
                        f"times this peer's norm away (this peer's w {w:.3g}, |z| {z_norm:.3g}; pending weight "
                        f"{pending_weight:.3g})") if carries_model and self.warmed_up else ""
            return Admission(0.0, norm, 0.0, radius, clipped=True, gross=self.warmed_up, evidence=evidence)
        start = self.common_start
        travel = None if start is None or pending_weight <= 0.0 else Travel(start, pending, pending_weight, x, w)
        if claim is not None and self.travelled_too_far(sender, travel, z_norm, radius):
            return Admission(0.0, norm, 0.0, radius, clipped=True, gross=True, why=REASON_TRAVELLED)
        heading = self.heading_factor(sender, travel, z_norm, record=claim is not None)
        if claim is not None and self.reversed_heading(sender, heading):
            cosine = self.neighbours[sender].heading
            return Admission(0.0, norm, 0.0, radius, clipped=True, gross=True, why=REASON_REVERSED,
                             evidence=f"its replica travelled from the common start against this peer's own travel "
                                      f"in {self.neighbours[sender].reversed_streak} messages in a row (cosine "
                                      f"{cosine:.3g} now)")
        if heading < 1.0:
            radius = radius * heading
        if carries_model and z_norm > 0.0:
            implied = distance / (pending_weight * z_norm)
            threshold = self.outlier_threshold(sender, z_norm)
            factor = self.outlier_factor(implied, threshold)
            if claim is not None:
                rec = self.record(sender)
                self.note_contact(rec)
                rec.implied, rec.narrowed = (self.round, implied), factor
                if self.strong_outlier(sender, rec, implied, z_norm):  # held whole, charged
                    return Admission(0.0, norm, 0.0, radius, clipped=True, gross=True, why=REASON_STRONG)
                if self.persistent_outlier(sender, rec, implied, threshold):  # held whole, charged
                    return Admission(0.0, norm, 0.0, radius, clipped=True, gross=True, why=REASON_OUTLIER)
            if factor < 1.0:
                # an outlier is judged by the movement it really makes: with max(w, 1) a peer that sent its weight
                # shares to a clipped insider (held there) and kept little - 0.06 on a ring at skew 0.8 - took the
                # insider's accumulated held weight as a third of its own model while "moving by the radius"
                radius, held_w = radius * factor, w
                norm = distance / (held_w + pending_weight)
        if norm <= radius:
            fraction, clipped = weight_room, False
        elif not self.warmed_up:
            fraction, clipped = 0.0, False  # no measured radius to clip to yet: held whole, judged after warm-up
        else:
            # a fraction f of the pending mass contributes f d / (w + f omega), d = |m - omega z|: the radius at
            # f = r w / (d - r omega) (d > r (w + omega) > r omega here)
            fraction = min(weight_room, radius * held_w / (distance - radius * pending_weight))
            clipped = True
        applied = fraction * distance / (held_w + fraction * pending_weight)
        return Admission(fraction, norm, applied, radius, clipped)

    def travelled_too_far(self, sender: str, travel: Travel | None, z_norm: float, radius: float) -> bool:
        """Whether ``sender``'s pending mass implies a model that travelled from the fleet's common start more than
        ``travel_factor`` times as far as this peer's model and the nearest other neighbour's (heard within
        ``history`` rounds; the farther of the two is the reference, never less than the radius floor of ``|z|``)
        plus one ``radius`` (model units): what one clipped admission may move an honest neighbour by. Only where
        messages carry their sender's trajectory (``travel``, None otherwise; Choco's replicas start there and move by
        what the sender sent), after warm-up, and beside another neighbour (a sender heard alone, as on a directed ring,
        is never judged: this peer may be the one that lags, restarted from an old checkpoint). Records the sender's
        distance when it is not too far.

        Why: a Choco insider that scales its replica updates x10 moves its replica at this peer ten times as far as
        its own model went: x0 + 10 (z - x0). That stays within ``max_disagreement`` of the norm - training moves a
        model by a small part of it - and Choco's lagging replicas keep the outlier rule off, so it was clipped every
        round, always pulling the same way: on the undirected ring at skew 0.8 the honest peers ended at 21.7%
        against 43.6% without it (docs/RESULTS.md). An honest replica lags its sender, it does not overshoot: each
        top-k update sets coordinates to values its sender's model held. The nearest other neighbour is in the
        reference so that a peer restarted from an old checkpoint, which travelled less than its neighbours, does
        not find them all too far; the nearest, so that one insider cannot vouch for another beside an honest
        neighbour. The radius on top: an honest neighbour that took a clipped message from an insider before it had
        another neighbour to judge it by moved by up to the radius; in the first rounds, while models have travelled
        less than a radius, its replica here was three times as far as this peer's and it was quarantined (a
        5-peer ring with 15% of messages dropped, where the insider was the first neighbour it heard)."""
        if travel is None:
            return False
        travelled, own = travel.theirs_norm, travel.own_norm
        oldest = self.round - self.config.history
        others = [rec.travelled[1] for p, rec in self.neighbours.items() if p != sender
                  and rec.quarantined_since is None and rec.travelled is not None and rec.travelled[0] >= oldest]
        if others and self.warmed_up and math.isfinite(travelled):
            reference = max(own, min(others), self.config.floor_relative * z_norm)
            if travelled > self.config.travel_factor * reference + radius:
                return True
        self.record(sender).travelled = (self.round, travelled)
        return False

    def heading_factor(self, sender: str, travel: Travel | None, z_norm: float, record: bool = True) -> float:
        """The fraction of the radius ``sender``'s pending mass is judged with for the direction its trajectory
        took: 1 where its replica travelled from the fleet's common start along this peer's own travel (cosine >=
        ``heading_cut / 2``), falling linearly to 0 at ``-heading_cut / 2``. Judged only where messages carry
        their sender's trajectory (``travel``, None otherwise: Choco), after ``heading_after`` rounds (the fleet's
        common direction takes a while to form), outside the consensus radius, and only once this peer knows
        another peer than the sender (a fleet of two has no common direction to point against: each device is
        half of it, and under skew their travels oppose - a 2-daemon README fleet at skew 0.9 quarantined its
        honest neighbour for a reversed heading at round 19 in 3 runs of 10). ``record``: keep the cosine
        (:attr:`NeighbourRecord.heading`).

        Why: a Choco insider that negates its replica updates keeps its replica at the receiver as far from the
        start as an honest one, the mirror image ``x0 - (z - x0)``, and its contribution as large (0.12-0.14 of the
        radius against 0.08-0.10 for an honest neighbour; gamma keeps both far inside it), so neither the travelled
        distance nor clipping sees it, and on the undirected ring at skew 0.8 it cost 8 points against its device
        absent at 4 epochs (23 with two). Only its direction differs: from round 29 honest replicas' travel had a
        cosine of +0.12 and more with the receiver's own, the flipped one's -0.02 to -0.24."""
        if (travel is None or self.round < self.config.heading_after or self.consensus_radius(z_norm)
                or not any(peer != sender for peer in self.neighbours)):
            return 1.0
        floor = self.config.floor_relative * z_norm
        if travel.own_norm <= floor or travel.theirs_norm <= floor:
            return 1.0
        cosine = float(torch.dot(travel.theirs, travel.own)) / (travel.own_norm * travel.theirs_norm)
        if record:
            self.record(sender).heading = cosine
        return self.heading_cut_to(cosine)

    def reversed_heading(self, sender: str, factor: float) -> bool:
        """Whether ``sender``'s new message, judged with ``factor`` of the radius for its heading
        (:meth:`heading_factor`), is charged as a reversed heading: its travel pointed against this peer's own
        (cosine below 0: a factor below one half) in ``heading_messages`` messages in a row, this one included.

        Why: the heading's cut holds a sign flip's mirrored replica, but the insider stays in: the peers the
        schedule has sending to it hand it their shares every round while what it sends is held, so their weight
        drains into it. On the undirected ring at skew 0.8 two flipped insiders still cost 8.7 points against
        their devices absent at 4 epochs with the cut alone. The cosines separate cleanly once the fleet has a
        direction: honest replicas at +0.004 and above from round 10, flipped ones below 0 in every message
        (-0.04 to -0.41; simulator, ring and exponential graph, skew 0.8) - so a streak below 0 is charged, a cut
        alone is not."""
        rec = self.record(sender)
        if factor >= 0.5:
            rec.reversed_streak = 0
            return False
        rec.reversed_streak += 1
        return rec.reversed_streak >= self.config.heading_messages

    def heading_cut_to(self, cosine: float) -> float:
        """The fraction of the radius a travel of ``cosine`` with this peer's own is judged with."""
        return min(1.0, max(0.0, 0.5 + cosine / self.config.heading_cut))

    def accept(self, sender: str, admission: Admission | None) -> None:
        """A message was admitted (``admission``: the rule's verdict; None when the rule is off): charge the sender
        for gross mass, else decay its score; remember the applied contribution (what a later divergence is charged
        by)."""
        rec = self.record(sender)
        rec.accepted += 1
        rec.silent_rounds = 0
        rec.taken = 0
        self._let_back(sender, rec)  # a sink routed around spoke: back into the schedule at once
        if admission is None:
            rec.score *= self.config.decay
            return
        if admission.clipped:
            rec.clipped += 1
        if admission.gross:
            model = admission.why == REASON_IMPLAUSIBLE and self.mass_carries_model
            rec.score += self.config.implausible_score if model else self.config.severe
            rec.why = admission.why
            if rec.quarantined_since is None and rec.score >= self.config.quarantine_score:
                self.quarantine(sender, rec.why, admission.evidence)
        else:
            rec.score *= self.config.decay
        if admission.radius > 0.0:
            rec.charged += admission.applied_norm / admission.radius
            rec.charged_messages += 1
            rec.moved += admission.applied_norm

    def charge(self, sender: str, reason: str, amount: float, message: str) -> Refusal:
        """Add ``amount`` to the sender's score for ``reason`` (quarantining it at the threshold)."""
        rec = self.record(sender)
        rec.refused += 1
        rec.score += amount
        rec.why = reason
        if rec.quarantined_since is None and rec.score >= self.config.quarantine_score:
            self.quarantine(sender, reason)
        return Refusal(reason, message)

    def quarantine(self, sender: str, reason: str, evidence: str = "") -> None:
        """Quarantine ``sender`` for ``reason`` (its record's ``why``); ``evidence`` goes into the log line only."""
        rec = self.record(sender)
        if rec.quarantined_since is None:
            rec.quarantined_since = self.round
            rec.why = reason
            rec.route = None  # left out of the schedule as a quarantined neighbour now
            self.new_quarantines.append((sender, f"{reason}: {evidence}" if evidence else reason))

    def release(self, peer_id: str) -> bool:
        """Operator release: the neighbour's messages are taken again, its score starts from zero. False if it
        was not quarantined."""
        rec = self.neighbours.get(peer_id)
        if rec is None or rec.quarantined_since is None:
            return False
        self.neighbours[peer_id] = NeighbourRecord(accepted=rec.accepted, clipped=rec.clipped, refused=rec.refused)
        return True

    # --- mass sinks -------------------------------------------------------------------------------------------
    def expect_from(self, senders: set[str], view: tuple[str, ...] | None = None,
                    period_senders: Collection[str] | None = None) -> None:
        """The schedule had each of ``senders`` send to this peer this round (counts towards a sink); ``view``: the
        sorted live set it was computed over; ``period_senders``: the neighbours it has send to this peer within
        one period of the graph (the outlier rules' references, :meth:`references`; None: unchanged).

        A view other than the last round's voids what the earlier one expected: every silent count starts over
        and each sink routed around is let back in. Each peer computes its neighbours' schedules over its own view
        of the live set, and while the fleet starts (or a peer joins or leaves) views differ: a README fleet daemon
        that had found two of its three neighbours expected one of them to send to it, which that neighbour's
        schedule over the whole fleet never did; it routed around it at round 12 and, that neighbour never
        expected again, never let it back in before round 97, holding nearly all the fleet's mass (w 4.0 of 4)
        meanwhile. A sink is flagged again ``sink_rounds`` expected rounds into the new view."""
        if view is not None and view != self.schedule_view:
            if self.schedule_view is not None:
                for peer_id, rec in self.neighbours.items():
                    rec.silent_rounds = 0
                    self._let_back(peer_id, rec, why="the live set changed")
            self.schedule_view = view
        if period_senders is not None:
            self.schedule_senders = frozenset(period_senders)
        for sender in senders:
            self.record(sender).silent_rounds += 1

    def _let_back(self, peer_id: str, rec: NeighbourRecord, why: str = RouteEvent.why) -> None:
        """Take ``peer_id`` back into the schedule if it was routed around as a sink (logged once, with ``why``)."""
        if rec.route is not None:
            self.route_events.append(RouteEvent(peer_id, LET_BACK, self.round, rec.route.since, why=why))
            rec.route = None

    def sinks(self) -> set[str]:
        """Neighbours silent for ``sink_rounds`` rounds in which the schedule had them send to this peer: a mass
        sink (receives, returns nothing) or a peer gone quiet (restarting, link down). Reported in status and
        routed around (:meth:`route_around`); a neighbour whose schedule never sends to this peer (a directed ring's
        successor) is never expected, so never a sink."""
        return {p for p, rec in self.neighbours.items() if rec.silent_rounds >= self.config.sink_rounds}

    def delivered(self, receiver: str, count: int) -> None:
        """``count`` of this peer's messages to ``receiver`` were settled as applied by it (an Ack, a handshake):
        it took this peer's mass (what makes a silent neighbour a sink to route around)."""
        if count > 0:
            self.record(receiver).taken += count

    def route_around(self, round_index: int) -> set[str]:
        """The sinks this peer leaves out of its schedule in ``round_index``: every sink that is not quarantined
        and took some of this peer's mass while silent (:attr:`NeighbourRecord.taken`), except those a probe is due
        to (peer/gossip/sinks.py). A sink flagged now starts being routed around. With the rule off (``enabled``
        False) nothing is: the paper's plain schedule."""
        excluded: set[str] = set()
        for peer_id, rec in self.neighbours.items():
            if not self.config.enabled or rec.quarantined_since is not None \
                    or rec.silent_rounds < self.config.sink_rounds:
                continue
            if rec.route is None:
                if rec.taken == 0:
                    continue  # took nothing: down, cut off or restarting, not draining this peer
                rec.route = SinkRoute.start(round_index, self.config.sink_probe_rounds)
                self.route_events.append(RouteEvent(peer_id, ROUTED, round_index, round_index, rec.route.probe_at,
                                                    rec.silent_rounds))
            if rec.route.excluded(round_index):
                excluded.add(peer_id)
        return excluded

    def sent_to(self, receivers: set[str], round_index: int) -> None:
        """This peer sent messages to ``receivers`` in ``round_index``: a probe due to any of them went out."""
        for peer_id in receivers:
            rec = self.neighbours.get(peer_id)
            if rec is not None and rec.route is not None:
                rec.route.probed(round_index, self.config.sink_backoff_cap)

    # --- quarantine notices (peer/gossip/notices.py) ----------------------------------------------------------
    def note_notice(self, notifier: str, quarantined: Collection[str]) -> None:
        """``notifier``'s QuarantineNotice arrived (this peer's current round dates it). Ignored with the rule off,
        and from a notifier this peer quarantined."""
        if self.config.enabled and not self.is_quarantined(notifier):
            self.notices.note(notifier, quarantined, self.round)

    def excluded_on_notice(self, me: str, round_index: int, view: Collection[str],
                           sends_to: Callable[[str], Collection[str]]) -> set[str]:
        """The suspects of the live set ``view`` excluded from the schedule in ``round_index`` on the notices
        (:meth:`NoticeBook.exclude`; ``sends_to``: a peer's out-neighbours over one period of the schedule, over
        ``view``)."""
        if not self.config.enabled:
            return set()
        return self.notices.exclude(me, round_index, self.config.notice_quorum, self.config.notice_ttl, view,
                                    sends_to)

    def notice_due(self, round_index: int) -> bool:
        """Whether this peer sends a QuarantineNotice in ``round_index`` (:meth:`NoticeBook.due`)."""
        return self.config.enabled and self.notices.due(self.quarantined(), round_index, self.config.notice_every)

    def forget(self, peer_id: str) -> None:
        """A neighbour left: drop its record, unless it is quarantined (a quarantine outlives a departure, so a
        returning insider is still refused); its notices no longer count."""
        self.notices.forget(peer_id)
        if not self.is_quarantined(peer_id):
            self.neighbours.pop(peer_id, None)

    # --- divergence -------------------------------------------------------------------------------------------
    def healthy_round(self) -> None:
        """The peer's round was healthy: contributions so far are not suspects of a later divergence."""
        for rec in self.neighbours.values():
            rec.charged, rec.charged_messages, rec.moved = 0.0, 0, 0.0

    def gossip_moved(self) -> float:
        """How far the neighbours' contributions applied since the last healthy round could have moved this peer
        (their norms summed, model units)."""
        return sum(rec.moved for rec in self.neighbours.values())

    def suspect(self, own_before: float = 0.0) -> str | None:
        """What a divergence is charged to before this peer halves its own gamma or lr: the neighbour whose
        messages applied since the last healthy round came, on average, closest to the radius - if that average is
        at least :data:`SUSPECT_FRACTION` of it, and if together they moved this peer farther than ``own_before``,
        its own training in the round before (the last one judged healthy, whose step the next round's loss
        judges; model units). An honest neighbour's contributions sit well inside the radius, so a peer that
        diverged by its own learning rate blames nobody (None); and one whose own step threw its model farther
        than a neighbour may move it (the radius's ``max_relative`` cap) sees its honest neighbours' next messages
        clipped - far from the thrown model, not from the fleet - and blames none of them either (a simulated lr
        spike charged the one in-neighbour of a directed ring without that test)."""
        candidates = [(rec.charged / rec.charged_messages, p) for p, rec in self.neighbours.items()
                      if rec.charged_messages and rec.quarantined_since is None and rec.moved > own_before]
        if not candidates:
            return None
        fraction, peer_id = max(candidates)
        return peer_id if fraction >= SUSPECT_FRACTION else None

    def charge_divergence(self, sender: str, reason: str) -> bool:
        """The peer diverged after ``sender``'s contributions: a strike (``severe`` on its score), and a quarantine
        at the config's ``divergence_strikes`` within ``strike_rounds`` (or at the score's threshold). Returns
        whether it is quarantined now."""
        rec = self.record(sender)
        rec.strikes = [r for r in rec.strikes if self.round - r < self.config.strike_rounds] + [self.round]
        rec.score += self.config.severe
        rec.why = f"divergence: {reason}"
        rec.charged, rec.charged_messages, rec.moved = 0.0, 0, 0.0
        if len(rec.strikes) >= self.config.divergence_strikes or rec.score >= self.config.quarantine_score:
            self.quarantine(sender, rec.why, f"{len(rec.strikes)} divergence(s) charged to it within "
                                             f"{self.config.strike_rounds} rounds, score {rec.score:.3g}")
        return rec.quarantined_since is not None

    # --- status and persistence -------------------------------------------------------------------------------
    def snapshot(self, me: str = "") -> dict[str, dict[str, Any]]:
        """Per neighbour: score, clipped (or refused) fraction, quarantined since (round or None), last reason, the
        rounds of the divergence strikes against it, whether it is a sink, routed around since (round or None), the
        round its next probe is due, how far its last message's implied model was (relative; None: not known), the
        fraction of the radius and share it gets as an outlier (1: none), the round it became a persistent one (None:
        it is not), the cosine of its travel with this peer's (None: not judged) and the fraction of the radius that
        gives it (1: none cut), the peers whose
        quarantine notices name it (``me``, this peer's id, where its own does) and since when the schedule excludes it
        on them (None: it does not)."""
        sinks = self.sinks()
        noticed = self.notices.snapshot(me, self.round + 1, self.config.notice_ttl)
        return {p: {"score": round(rec.score, 3), "clipped_fraction": round(rec.clipped_fraction, 4),
                    "accepted": rec.accepted, "clipped": rec.clipped, "refused": rec.refused,
                    "quarantined_since": rec.quarantined_since, "reason": rec.why,
                    "strikes": list(rec.strikes),
                    "sink": p in sinks, "silent_rounds": rec.silent_rounds,
                    "routed_around_since": rec.route.since if rec.route is not None else None,
                    "next_probe": rec.route.probe_at if rec.route is not None else None,
                    "implied_distance": None if rec.implied is None else round(rec.implied[1], 6),
                    "outlier_factor": round(rec.narrowed, 6),
                    "outlier_since": None if rec.outlier_since is None else rec.outlier_since[0],
                    "heading": None if rec.heading is None else round(rec.heading, 4),
                    "heading_factor": 1.0 if rec.heading is None else round(self.heading_cut_to(rec.heading), 4),
                    "named_by": noticed.get(p, {}).get("named_by", []),
                    "left_out_on_notice_since": self.notices.left_out.get(p)}
                for p, rec in self.neighbours.items()}

    def state_dict(self) -> dict[str, Any]:
        return {p: {"score": rec.score, "accepted": rec.accepted, "clipped": rec.clipped, "refused": rec.refused,
                    "quarantined_since": rec.quarantined_since, "why": rec.why, "silent_rounds": rec.silent_rounds,
                    "taken": rec.taken, "route": rec.route.to_list() if rec.route is not None else None,
                    "strikes": list(rec.strikes)}
                for p, rec in self.neighbours.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`, or an older checkpoint's records (no silence counts, no routes)."""
        self.neighbours = {p: NeighbourRecord(score=float(r["score"]), accepted=int(r["accepted"]),
                                              clipped=int(r.get("clipped", 0)), refused=int(r["refused"]),
                                              quarantined_since=r["quarantined_since"],
                                              why=str(r["why"]), silent_rounds=int(r.get("silent_rounds", 0)),
                                              taken=int(r.get("taken", 0)),
                                              strikes=[int(x) for x in r.get("strikes", [])],
                                              route=None if r.get("route") is None
                                              else SinkRoute.from_list(r["route"]))
                           for p, r in state.items()}
