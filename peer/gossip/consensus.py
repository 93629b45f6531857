"""The consensus phase: no training, only gossip, until every peer's own model is near the average
(docs/method.md#the-consensus-phase).

Training under skew leaves the peers' models apart (the average is good, each device's own model is not), and
99%-compressed gossip at its training gamma closes that gap slowly. When training ends (and, if configured, every K
epochs) each peer stops its local steps and gossips with the phase's own mixing - a larger kept fraction at the
largest gamma measured stable for it on pure consensus - until its neighbours' models are all within ``tolerance``
of its own for ``patience`` rounds in a row, or ``max_rounds`` ran out. Nothing central decides: each peer judges
from what it receives (:class:`NeighbourDistances`), and mass stays exact because the phase only changes the
codec and the step size of messages that carry their own scale.

Everything here is pure: tensors and numbers, no network, no clock.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from peer.gossip.kinds import PhaseName
from peer.gossip.topology import Topology

__all__ = ["ConsensusPhase", "ConsensusSettings", "Mixing", "NeighbourDistances", "PhaseEnd", "PhaseName",
           "relative_distance"]

#: A model norm below this is treated as this (a relative distance to an all-zero model is meaningless).
MIN_NORM = 1e-12
#: Times a phase peer that heard nothing since its last round waits (declines a round) before it sends one anyway:
#: two peers that each wait for the other would otherwise wait forever once the neighbours that carried the news
#: ended their phases (a daemon retries every few tens of ms, so about a second; the simulator once per round).
MAX_WAITS = 50


def relative_distance(other: torch.Tensor, own: torch.Tensor) -> float:
    """``||other - own|| / ||own||`` (dimensionless): how far a neighbour's model is from this peer's."""
    return float(torch.linalg.vector_norm(other - own)) / max(float(torch.linalg.vector_norm(own)), MIN_NORM)


class NeighbourDistances:
    """The last relative distance of every sender's model from this peer's, as the messages tell it.

    A Choco receiver holds a replica of each sender's de-biased model (the sum of everything that sender sent it),
    a dense SGP message carries the sender's numerator and weight; either gives the sender's model at no extra
    bytes. ``fresh`` counts the observations since :meth:`restart`, so a phase judges only what it saw itself.
    """

    def __init__(self) -> None:
        self.latest: dict[str, float] = {}
        self.fresh: dict[str, int] = {}
        #: Count only dense messages as fresh (a dense phase runs): a neighbour still training sends 1%-compressed
        #: messages, whose replica says little of its model, and its model moves on - no evidence of agreement.
        self.dense_only = False

    def observe(self, sender: str, view: torch.Tensor | None, own: torch.Tensor, dense: bool = True) -> None:
        """Record ``sender``'s model ``view`` against this peer's model ``own`` (``view`` None: not estimable -
        the message still counts as heard, so a phase that cannot judge runs its budget instead of waiting;
        ``dense``: the message carried every coordinate)."""
        if view is not None:
            self.latest[sender] = relative_distance(view, own)
        if dense or not self.dense_only:
            self.fresh[sender] = self.fresh.get(sender, 0) + 1

    def observe_distance(self, sender: str, distance: float) -> None:
        """Record ``sender``'s relative ``distance`` as a consensus probe estimated it (peer/gossip/sketch.py): the
        whole model's, so it counts as fresh even where only dense messages do."""
        self.latest[sender] = distance
        self.fresh[sender] = self.fresh.get(sender, 0) + 1

    def restart(self, dense_only: bool = False) -> None:
        """Start counting fresh observations again (the phase begins; ``dense_only``: its messages are dense, and
        only those count)."""
        self.fresh.clear()
        self.dense_only = dense_only

    def forget(self, peer_id: str) -> None:
        self.latest.pop(peer_id, None)
        self.fresh.pop(peer_id, None)

    def fresh_distances(self) -> dict[str, float]:
        """Distances observed since the last :meth:`restart`, by sender."""
        return {p: d for p, d in self.latest.items() if self.fresh.get(p, 0) > 0}

    def heard(self) -> dict[str, int]:
        """Observations since the last :meth:`restart`, by sender (a judge compares two of these to find the
        senders heard from in between)."""
        return dict(self.fresh)


class PhaseEnd(enum.Enum):
    """Why a consensus phase ended."""

    CONVERGED = "converged"  # every neighbour within tolerance for ``patience`` rounds
    BUDGET = "budget"        # ``max_rounds`` ran out first
    ALONE = "alone"          # no live neighbour is left to agree with (they ended their phases and left)


@dataclass(frozen=True)
class Mixing:
    """The codec and step size a round gossips with.

    Attributes:
        compression: fraction of entries top-k drops (0 = dense).
        gamma: consensus step size (dimensionless, (0, 1]).
        bits: value width of the messages (2..8, or 32 for raw fp32); None = the training's.
        deflate: entropy-code the messages when that makes them smaller (peer/compress/deflate.py).
        step_floor: the coarsest grid's step relative to each tensor's RMS in the model (CodecConfig.step_floor;
            0: none).
    """

    compression: float
    gamma: float
    bits: int | None = None
    deflate: bool = False
    step_floor: float = 0.0


@dataclass(frozen=True)
class ConsensusSettings:
    """How a consensus phase runs, when it stops and when periodic ones start (built from ``gossip.consensus_*``,
    peer/config.py).

    Attributes:
        tolerance: relative distance (``||z_j - z_i|| / ||z_i||``) every neighbour's model must be within.
        patience: consecutive rounds all neighbours must be within it.
        max_rounds: rounds of one phase at most (the byte budget: a phase never costs more than this many rounds
            of messages at its mixing).
        mixing: the codec and gamma of the phase's rounds (dense at gamma 1 by default: the widest codec at its
            stability limit, docs/decisions/gamma.md; deflated, at the training's bits, raw fp32 for SGP).
        topology: the phase's out-neighbour schedule (the rotating exponential graph by default: one message per
            round, exact averaging of 2^k peers in k synchronous dense rounds).
        every_epochs: also run a phase every this many epochs of training (0 = only when training ends).
        probe: once the phase graph's horizon has passed, every other round sends a probe (a 4 KiB sketch of the
            model, peer/gossip/sketch.py) instead of a dense update: the round after the averaging only has to
            tell the neighbours that it is done; a peer that ends converged sends its out-neighbours of one cycle
            a last one (False, the default: dense rounds unless over ``budget``; ``gossip.consensus_probe``).
        budget: the phase's bytes relative to the training's before it (``gossip.consensus_budget``, 0 = none):
            past the horizon, a round whose dense message would take the phase over it sends a probe instead, as
            ``probe`` does (dense rounds still follow a probe that finds the neighbours apart).
    """

    tolerance: float
    patience: int
    max_rounds: int
    mixing: Mixing
    topology: Topology = field(default_factory=lambda: Topology("exponential", rotating=True))
    every_epochs: float = 0.0
    probe: bool = False
    budget: float = 0.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.tolerance) and self.tolerance > 0):
            raise ValueError(f"tolerance: expected a relative distance > 0, got {self.tolerance!r}")
        if self.patience < 1:
            raise ValueError(f"patience: expected >= 1 round, got {self.patience!r}")
        if self.max_rounds < 1:
            raise ValueError(f"max_rounds: expected >= 1 round, got {self.max_rounds!r}")
        if not (0.0 < self.mixing.gamma <= 1.0):
            raise ValueError(f"gamma: expected (0, 1], got {self.mixing.gamma!r}")
        if not (0.0 <= self.mixing.compression < 1.0):
            raise ValueError(f"compression: expected [0, 1), got {self.mixing.compression!r}")
        bits = self.mixing.bits
        if bits is not None and not (2 <= bits <= 8 or bits == 32):
            raise ValueError(f"bits: expected 2..8 or 32, got {bits!r}")
        floor = self.mixing.step_floor
        if not (math.isfinite(floor) and 0.0 <= floor <= 1.0):
            raise ValueError(f"step_floor: expected a relative step in [0, 1], got {floor!r}")
        if not (math.isfinite(self.budget) and self.budget >= 0):
            raise ValueError(f"budget: expected >= 0 times the training's bytes, got {self.budget!r}")
        if not (math.isfinite(self.every_epochs) and self.every_epochs >= 0):
            raise ValueError(f"every_epochs: expected >= 0 epochs, got {self.every_epochs!r}")

    def periodic_due(self, epoch: float, total_epochs: float, phases_run: int) -> bool:
        """Whether a periodic phase is due at ``epoch`` (epochs trained) after ``phases_run`` periodic phases:
        every ``every_epochs`` epochs, never at or after the end of training (the final phase runs there)."""
        if self.every_epochs <= 0 or epoch >= total_epochs:
            return False
        return epoch >= (phases_run + 1) * self.every_epochs


@dataclass
class ConsensusPhase:
    """One consensus phase of one peer: its rounds, its calm streak and its bytes.

    Attributes:
        settings: how it runs.
        final: the phase at the end of training (the peer then stays converged) or a periodic one (training
            resumes).
        rounds: consensus rounds run so far (probe rounds included).
        probes: probe rounds among them.
        last_probe: the last round sent a probe.
        calm: consecutive judgements whose news (neighbours heard from anew) was all within tolerance.
        payload_bytes: update payload and probe sketch bytes this phase sent (the phase's own bytes: not the
            link counters' difference, which under a slow link also counts training messages queued before the
            phase began and written during it - 8-12 MB per peer for 4-13 dense rounds behind a 10 Mbit/s bucket;
            the phase's acks and framing, under 0.1% of a dense update, are not counted).
        training_bytes: update payload bytes this peer sent in training before the phase (since the previous
            phase; what ``settings.budget`` is relative to; 0: not known, no budget).
        last_dense_bytes: the payload bytes of the phase's latest dense round (what the next would cost).
        ended: why it ended, None while it runs.
        worst: the largest distance of the neighbours heard from anew at the last judgement that heard any (None
            before any observation).
        distances: the neighbours' latest relative distances at the last judgement, by peer id.
        heard: the observations of each neighbour in the phase as of the last judgement (what tells news apart).
        waits: rounds declined in a row for want of news (:meth:`waits_for_news`).
    """

    settings: ConsensusSettings
    final: bool
    rounds: int = 0
    probes: int = 0
    last_probe: bool = False
    calm: int = 0
    payload_bytes: int = 0
    training_bytes: int = 0
    last_dense_bytes: int = 0
    ended: PhaseEnd | None = None
    worst: float | None = None
    distances: dict[str, float] = field(default_factory=dict)
    heard: dict[str, int] = field(default_factory=dict)
    waits: int = 0

    def judge(self, distances: Mapping[str, float], heard: Mapping[str, int] | None = None,
              min_rounds: int = 0) -> PhaseEnd | None:
        """Judge the neighbours heard from since the last judgement, before a round; returns why the phase ends
        now, or None to run another round.

        Args:
            distances: each neighbour's latest distance observed in the phase.
            heard: observations in the phase so far by neighbour (:meth:`NeighbourDistances.heard`); None: every
                neighbour in ``distances`` counts as heard anew.
            min_rounds: rounds the phase must have run before a calm judgement ends it: the phase graph's
                :meth:`~peer.gossip.topology.Topology.horizon`. Sooner, calm neighbours say nothing of the peers
                not heard from yet: dense SGP's training keeps ring neighbours within 2% of each other while the
                fleet's models are 0.36 apart, and at a tolerance of 0.02 the 8-peer simulator's phase ended after
                one round (skew 0.9, 3 epochs: mean device 62.7% against 65.0% averaged, 65.0% after 4 rounds).

        Only news counts: a distance observed before this peer's model moved on (the rounds since mixed in other
        neighbours) says nothing about now, and waiting to hear every in-neighbour of the rotating graph again
        costs log2(n) dense rounds after the averaging is done (docs/decisions/consensus-phase.md). A round that
        brought no news leaves the calm streak as it was; a peer that heard from nobody yet is not calm.
        """
        counts = dict(heard) if heard is not None else {p: self.heard.get(p, 0) + 1 for p in distances}
        news = {p: d for p, d in distances.items() if counts.get(p, 0) > self.heard.get(p, 0)}
        self.heard = counts
        self.distances = dict(distances)
        if news:
            self.worst = max(news.values())
            # a calm judgement before the horizon counts for nothing: neither towards patience nor, kept, later
            calm = self.worst <= self.settings.tolerance and self.rounds >= min_rounds
            self.calm = self.calm + 1 if calm else 0
        if self.calm >= self.settings.patience:
            self.ended = PhaseEnd.CONVERGED
        elif self.rounds >= self.settings.max_rounds:
            self.ended = PhaseEnd.BUDGET
        return self.ended

    def has_news(self, heard: Mapping[str, int]) -> bool:
        """Whether a neighbour was heard from since the last judgement (``heard``: observations in the phase so far
        by neighbour, :meth:`NeighbourDistances.heard`)."""
        return any(n > self.heard.get(p, 0) for p, n in heard.items())

    def waits_for_news(self, heard: Mapping[str, int], busy: bool = False) -> bool:
        """Whether to decline this round: hear before speaking again. After its first round a peer sends its next
        only once a neighbour was heard from since its last judgement (a round would only repeat the last, to
        neighbours that may have ended their phases), or after :data:`MAX_WAITS` declined rounds; a declined round
        counts towards those only while none of its messages is on its way (``busy``: one is unacknowledged - the
        news it brings is not due yet)."""
        if self.rounds == 0 or self.has_news(heard) or self.waits >= MAX_WAITS:
            self.waits = 0
            return False
        if not busy:
            self.waits += 1
        return True

    def left_alone(self) -> PhaseEnd:
        """No live neighbour is left: the phase ends (nobody to agree with; waiting would only spend the budget)."""
        self.ended = PhaseEnd.ALONE
        return self.ended

    def probe_due(self, horizon: int) -> bool:
        """Whether this round sends a probe instead of an update: at or past the phase graph's ``horizon`` (its
        :meth:`~peer.gossip.topology.Topology.horizon` - before it no judgement can end the phase anyway), and not
        twice in a row (a probe moves nothing: a peer whose neighbours are not yet calm gossips again).

        Why: on the rotating exponential graph 2^k peers hold the exact average after k synchronous dense rounds,
        but each message of those rounds carries its sender's model from before it, so judging them says only
        that the averaging is not done. Another dense round to confirm it cost a quarter of the 8-peer phase's
        bytes (0.69x of a 3-epoch run's training bytes); its probe costs 4 KiB a receiver."""
        return (self.settings.probe or self.over_budget()) and self.rounds >= horizon and not self.last_probe

    def over_budget(self) -> bool:
        """Whether another dense round would take the phase's bytes past ``settings.budget`` times the training's.

        Why: after a short training the phase's dense rounds outweigh it (8 peers, 3 epochs, skew 0.9: each 0.64x
        the training's bytes, the phase 2.57x), while after a long one they are cheap (10 epochs: 0.85x in all) and
        the dense round that confirms the averaging also brings the devices closer (probe-ended phases left the
        README fleet's devices 0.4-1.6 points below the averaged model, dense ones within 0.4): so confirm densely
        while the budget allows, and with a 4 KiB probe past it."""
        budget = self.settings.budget * self.training_bytes
        return budget > 0 and self.payload_bytes + self.last_dense_bytes > budget

    def count_round(self, payload_bytes: int, probe: bool = False) -> None:
        """One round ran, sending ``payload_bytes`` of updates (``probe``: of probe sketches instead)."""
        self.rounds += 1
        self.probes += probe
        self.last_probe = probe
        self.payload_bytes += payload_bytes
        if not probe:
            self.last_dense_bytes = payload_bytes
