"""One peer's learning state: model, data shard, push-sum optimizer, gossip engine, and the lock around them.

Every driver holds peers of this class: the daemon one, the simulator n, ``train`` one with no neighbours. The
transports (the gRPC server and edges, the simulator's in-memory transport) reach the engine only through the
exactly-once entry points below, each atomic under :attr:`Peer.lock`; the slow work (local training, encoding,
decoding, serialising the model) runs outside the lock, so a daemon keeps applying its neighbours' messages while it
trains or compresses.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from peer.compress.codec import CodecConfig
from peer.config import GossipSpec, OptimSpec
from peer.finite import all_finite
from peer.gossip.algorithms import Sent
from peer.gossip.consensus import ConsensusPhase, ConsensusSettings, Mixing, PhaseName
from peer.gossip.engine import GossipEngine, GossipInputError, OutMessage
from peer.gossip.ledger import Hello, HelloReply, Settlement
from peer.gossip.notices import NoticeEvent
from peer.gossip.optim import OptimConfig, PushSumSGD
from peer.gossip.pushsum import MIN_WEIGHT
from peer.gossip.reach import max_insiders_bounded
from peer.gossip.robust import RobustConfig
from peer.gossip.sinks import RouteEvent
from peer.gossip.sketch import SketchError, decode_sketch, encode_sketch
from peer.gossip.topology import Topology
from peer.runtime.evaluation import refresh_batchnorm
from peer.runtime.flat import FlatModel
from peer.runtime.recovery import Recovery
from peer.runtime.schedule import lr_at

Batches = Iterator[tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class PeerStatus:
    """The engine's figures for a status document, read together under the peer's lock (one consistent state,
    not w from before an update and in-flight counts from after it)."""

    w: float                       # push-sum weight (dimensionless; a fleet's weights sum to its peer count)
    gamma: float                   # consensus step size in use (the configured one, halved by recoveries)
    in_flight: dict[str, int]      # receiver -> messages sent and not yet settled
    known_peers: frozenset[str]    # peers the engine keeps edge state for
    gossip_state_bytes: int        # the algorithm's own state (Choco's replicas), in bytes
    phase: str                     # training, consensus or converged (docs/method.md#the-consensus-phase)
    distances: dict[str, float]    # sender -> relative distance of its model from this peer's, by its messages
    consensus_rounds: int          # consensus rounds run, all phases
    consensus_bytes: int           # update payload bytes of this peer's consensus phases' own messages
    robust: bool                   # the robust receive rule is on (gossip.robust)
    #: distinct peers the schedule has send to this peer within one period of the graph, quarantined ones not
    #: counted (peer/gossip/reach.py); None while no peer is scheduled to send here (alone, or not computed yet)
    senders: int | None
    #: the most insiders within the honest spread any local rule could bound here (None: rule off, or no senders)
    max_insiders: int | None


def codec_config(spec: GossipSpec) -> CodecConfig:
    """The payload codec a gossip spec asks for."""
    return CodecConfig(compression=spec.compression, bits=spec.bits, rounding=spec.rounding)


def consensus_settings(spec: GossipSpec, seed: int = 0) -> ConsensusSettings | None:
    """The consensus phase a gossip spec asks for (None: ``consensus_rounds`` 0, no phase); ``seed`` seeds a
    random phase topology (all peers agree on it)."""
    if spec.consensus_rounds == 0:
        return None
    return ConsensusSettings(tolerance=spec.consensus_tolerance, patience=spec.consensus_patience,
                             max_rounds=spec.consensus_rounds,
                             mixing=Mixing(spec.consensus_compression, spec.effective_consensus_gamma,
                                           spec.effective_consensus_bits, spec.consensus_deflate,
                                           spec.effective_consensus_step_floor),
                             topology=Topology(spec.consensus_topology, rotating=True, k=spec.k, seed=seed),
                             every_epochs=spec.consensus_every, probe=spec.consensus_probe,
                             budget=spec.consensus_budget)


def _no_certificate(peer_id: str) -> str | None:
    """Certificate serial lookup without certificates (the simulator, ``train``): never known."""
    return None


class Peer:
    """Local training on z = x / w plus push-sum gossip (see :mod:`peer.gossip.optim` for the step on z).

    Args:
        peer_id: this peer's id.
        model: the model (its parameters are rebound to a flat buffer).
        batches: endless iterator of (x, y) training batches from this peer's shard.
        steps_per_epoch: local steps that make one epoch of this peer's shard (drives the lr schedule).
        optim: optimizer and schedule.
        gossip: algorithm, compression, window and topology.
        topology: the out-neighbour schedule.
        seed: seeds stochastic rounding in the codec.
        max_peers: most peers the engine keeps edge state for; it also bounds the push-sum weight a sender may
            claim (a fleet's weights sum to its number of peers). A daemon passes its ``net.max_peers``.
    """

    def __init__(self, peer_id: str, model: nn.Module, batches: Batches, steps_per_epoch: int, optim: OptimSpec,
                 gossip: GossipSpec, topology: Topology, seed: int = 0, *, max_peers: int) -> None:
        self.peer_id = peer_id
        self.model = model
        self.flat = FlatModel(model)
        self.batches = batches
        self.steps_per_epoch = max(1, steps_per_epoch)
        self.optim_spec = optim
        self.topology = topology
        self.engine = GossipEngine(peer_id, self.flat.layout, self.flat.z, gossip.algorithm, codec_config(gossip),
                                   gamma=gossip.effective_gamma, window=gossip.window, seed=seed,
                                   replica_init=self.flat.z, max_in_flight_bytes=int(gossip.window_mib * 2**20),
                                   max_peers=max_peers, robust=RobustConfig(enabled=gossip.robust))
        self.optimizer = PushSumSGD(self.flat.z.numel(), OptimConfig(
            momentum=optim.momentum, weight_decay=optim.weight_decay, nesterov=optim.nesterov, qgm=optim.qgm),
            device=self.flat.z.device)
        self.lock = threading.Lock()
        self.steps = 0
        self.last_loss = math.nan
        #: How far the last round's own training moved the model, relative to its norm before (the divergence
        #: policy's ``moved``; received gossip excluded), and the round before's in model units (what a divergence
        #: judged now is weighed against: :meth:`divergence_suspect`, :meth:`own_step_diverged`).
        self.last_move = 0.0
        self.move_before = 0.0
        self._move_now = 0.0
        self.num_classes = 0  # from the model's output, at the first step (the loss-explosion floor uses it)
        #: The divergence policy the round consults (peer/runtime/recovery.py); it owns the gamma in use.
        self.recovery = Recovery(peer_id, self.engine.gamma, max_halvings=gossip.max_halvings)
        #: The consensus phase's settings (None: no phase), where the peer is, and the phase running now.
        self.consensus_settings = consensus_settings(gossip, topology.seed)
        self.training_compression = gossip.compression
        self.training_bits = gossip.bits
        self.training_window = gossip.window
        self.phase = PhaseName.TRAINING
        self.consensus: ConsensusPhase | None = None
        #: Finished consensus phases, oldest first (their rounds and bytes; periodic ones counted for the schedule).
        self.consensus_done: list[ConsensusPhase] = []
        #: Update payload bytes sent in training since the last consensus phase began (a phase's byte budget is
        #: relative to them; this process's only: a restarted daemon counts afresh).
        self.training_bytes = 0
        #: The serial (hex) of the certificate a neighbour authenticated with, for the quarantine log line (None:
        #: not known - the simulator, no TLS, no stream from it yet). A daemon sets its server's lookup here, so the
        #: runtime names the certificate without importing the transport.
        self.certificate_serial: Callable[[str], str | None] = _no_certificate
        #: What the log last said the graph lets a local rule bound here: (every sender quarantined, max insiders)
        #: (peer/gossip/reach.py; None: not said yet).
        self.reach_reported: tuple[bool, int] | None = None

    # --- training ----------------------------------------------------------------------------------------------
    @property
    def epoch(self) -> float:
        """Epochs of this peer's shard done so far (fractional)."""
        return self.steps / self.steps_per_epoch

    def lr(self) -> float:
        """The schedule's learning rate now, times the divergence policy's factor (halved once per divergence of
        the training step itself)."""
        o = self.optim_spec
        return lr_at(self.epoch, o.lr, o.epochs, o.warmup_epochs) * self.recovery.lr_factor

    def begin_round(self, round_index: int = 0) -> None:
        """Load the de-biased model z = x / w (everything received so far) and let QGM fold the gossip movement
        of the last round into its momentum; ``round_index`` labels the quarantines of this round."""
        with self.lock:
            self.engine.guard.round = round_index
            self.engine.drain_held()  # what the robust rule's clipping held back, applied within its radius
        self.sync_model()
        self.optimizer.after_gossip(self.flat.z, self.lr())

    def sync_model(self) -> None:
        """Write z = x / w into the model's parameters (before training or evaluating)."""
        with self.lock:
            self.engine.state.debias_into(self.flat.z)

    def prepare_evaluation(self) -> None:
        """The model as it should be evaluated (and checkpointed): z = x / w in its parameters and, for a model
        that keeps BatchNorm layers, their statistics recomputed for these weights from its own training batches
        (peer.runtime.evaluation.refresh_batchnorm)."""
        self.sync_model()
        refresh_batchnorm(self.model, self.batches)

    def train_steps(self, n: int) -> float:
        """Run ``n`` local SGD steps; returns their mean training loss (and sets :attr:`last_move`)."""
        self.model.train()
        losses = []
        moved = torch.zeros_like(self.flat.z)  # training's own movement of z (received gossip excluded)
        with self.lock:
            norm_before = float(self.flat.z.norm())
        for _ in range(n):
            x, y = next(self.batches)
            lr = self.lr()
            self.flat.zero_grad()
            logits = self.model(x)
            self.num_classes = logits.shape[-1]
            loss = nn.functional.cross_entropy(logits, y)
            loss.backward()
            grad = self.flat.gradient()
            with self.lock:
                w = max(self.engine.w, MIN_WEIGHT)
                moved.sub_(self.engine.x, alpha=1.0 / w)
                self.optimizer.step(self.engine.x, self.flat.z, grad, lr, self.engine.w)
                moved.add_(self.engine.x, alpha=1.0 / w)
                self.engine.state.debias_into(self.flat.z)
            self.steps += 1
            losses.append(float(loss.detach()))
        moved_norm = float(moved.norm())
        with self.lock:
            self.engine.guard.record_own_move(moved_norm)  # the robust receive rule's radius scales with it
        self.last_move = moved_norm / norm_before if norm_before > 0 else 0.0
        # a step that went non-finite says nothing of how far it moved: no evidence either way
        self.move_before, self._move_now = self._move_now, moved_norm if math.isfinite(moved_norm) else 0.0
        self.last_loss = sum(losses) / len(losses) if losses else math.nan
        return self.last_loss

    def is_finite(self) -> bool:
        """Whether x is free of NaN/Inf (a peer never gossips a diverged model)."""
        with self.lock:
            return all_finite(self.engine.x)

    def good_state(self) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Copies of the de-biased model z and the model's buffers (what a roll-back returns to)."""
        with self.lock:
            z = self.engine.state.debiased()
            buffers = {n: b.detach().clone() for n, b in self.model.named_buffers()}
        return z, buffers

    def roll_back_to(self, z: torch.Tensor, buffers: dict[str, torch.Tensor]) -> None:
        """Return the model to ``z`` (and ``buffers``), keeping the current weight and edges: x := z * w_now, so
        mass moved since stays accounted for. Momentum (and QGM's pending movement) is cleared."""
        with self.lock:
            self.engine.state.x.copy_(z.to(self.engine.x.device) * self.engine.w)
            self.optimizer.reset()
            with torch.no_grad():
                for name, buf in self.model.named_buffers():
                    if name in buffers:
                        buf.copy_(buffers[name])
            self.engine.state.debias_into(self.flat.z)

    def set_gamma(self, gamma: float) -> None:
        """Gossip at consensus step size ``gamma`` from the next round on (what :attr:`Recovery.gamma` says after
        a recovery). Mass stays exact: every message carries its own scale."""
        with self.lock:
            self.engine.gamma = gamma

    def set_mixing(self, mixing: Mixing) -> None:
        """Gossip with ``mixing``'s codec and gamma from the next round on (a consensus phase begins or ends)."""
        with self.lock:
            self.engine.set_mixing(mixing.compression, mixing.gamma, mixing.bits, mixing.deflate, mixing.step_floor)

    def training_mixing(self) -> Mixing:
        """The codec and gamma training gossips with (gamma as recoveries left it)."""
        return Mixing(self.training_compression, self.recovery.gamma, self.training_bits)

    def load_model_vector(self, z: torch.Tensor) -> None:
        """Start from a given model (a joiner's pulled model): x = z, w = 1, edges untouched."""
        with self.lock:
            self.engine.state.x.copy_(z)
            self.engine.state.w = 1.0
            self.flat.z.copy_(z)

    def model_vector(self) -> torch.Tensor:
        """A copy of the de-biased model z = x / w (what a joiner pulls)."""
        with self.lock:
            return self.engine.state.debiased()

    # --- the robust receive rule's verdicts (peer/gossip/robust.py) --------------------------------------------
    def divergence_suspect(self) -> str | None:
        """The neighbour a divergence now would be charged to (None: none moved this peer farther than its own
        training of the round before, or came near the radius, since the last healthy round)."""
        with self.lock:
            return self.engine.guard.suspect(self.move_before)

    def own_step_diverged(self) -> bool:
        """Whether this peer's own training of the round before moved it farther than every message applied since
        the last healthy round could have: a divergence now is the training step's (the lr is halved, not gamma)."""
        with self.lock:
            return self.move_before > 0.0 and self.move_before >= self.engine.guard.gossip_moved()

    def healthy_round(self) -> None:
        with self.lock:
            self.engine.guard.healthy_round()

    def charge_divergence(self, neighbour: str, reason: str) -> bool:
        """This peer diverged after applying ``neighbour``'s contributions: a strike against it, and a quarantine
        at the robust rule's ``divergence_strikes``; returns whether it is quarantined now."""
        with self.lock:
            return self.engine.guard.charge_divergence(neighbour, reason)

    def quarantined(self) -> set[str]:
        with self.lock:
            return self.engine.quarantined()

    def expect_from(self, senders: set[str], view: tuple[str, ...] | None = None,
                    period_senders: Collection[str] | None = None) -> None:
        """The schedule, computed over the live set ``view``, has ``senders`` send to this peer this round
        (mass-sink detection) and ``period_senders`` within one period of the graph (the outlier rules'
        references; :meth:`peer.gossip.robust.ReceiveGuard.expect_from`)."""
        with self.lock:
            self.engine.guard.expect_from(senders, view, period_senders)

    def route_around(self, round_index: int) -> set[str]:
        """The sinks left out of this round's schedule (peer/gossip/sinks.py): not quarantined, just not sent to."""
        with self.lock:
            return self.engine.guard.route_around(round_index)

    def sent_to(self, receivers: set[str], round_index: int) -> None:
        """This round's messages went to ``receivers`` (a probe due to a routed-around sink went out)."""
        with self.lock:
            self.engine.guard.sent_to(receivers, round_index)

    def take_route_events(self) -> list[RouteEvent]:
        """Sinks routed around or let back in since the last call, for the log."""
        with self.lock:
            new, self.engine.guard.route_events = self.engine.guard.route_events, []
            return new

    def note_quarantines(self, sender: str, quarantined: list[str]) -> None:
        """``sender``'s QuarantineNotice arrived (peer/gossip/notices.py)."""
        with self.lock:
            self.engine.guard.note_notice(sender, quarantined)

    def excluded_on_notice(self, round_index: int, view: Collection[str],
                           sends_to: Callable[[str], Collection[str]]) -> set[str]:
        """The suspects every peer with these quarantine notices excludes from this round's schedule: not
        quarantined, not sent to, not expected (``view``: the live set with this peer; ``sends_to``: the schedule
        over it)."""
        with self.lock:
            return self.engine.guard.excluded_on_notice(self.peer_id, round_index, view, sends_to)

    def mark_round(self, round_index: int) -> None:
        """This peer is in ``round_index`` (a consensus round: no :meth:`begin_round`): it dates the notices and
        quarantines that come in."""
        with self.lock:
            self.engine.guard.round = round_index

    def notice_due(self, round_index: int) -> tuple[set[str], frozenset[str]] | None:
        """If this peer's QuarantineNotice is due in ``round_index`` (recorded as sent): what it names and what the
        previous one named; else None."""
        with self.lock:
            guard = self.engine.guard
            if not guard.notice_due(round_index):
                return None
            quarantined, previous = guard.quarantined(), guard.notices.last_named
            guard.notices.sent(quarantined, round_index)
            return quarantined, previous

    def take_notice_events(self) -> list[NoticeEvent]:
        """Suspects excluded on notices or taken back since the last call, for the log."""
        with self.lock:
            new, self.engine.guard.notices.events = self.engine.guard.notices.events, []
            return new

    def release(self, neighbour: str) -> bool:
        """Operator release of a quarantined neighbour (False: it was not quarantined)."""
        with self.lock:
            return self.engine.release(neighbour)

    def take_reach_change(self) -> tuple[int, int] | None:
        """(senders, max insiders) when what the graph lets a local rule bound here changed since the last call -
        the bound, or whether every sender is quarantined (peer/gossip/reach.py; the first schedule with a sender
        counts as a change) - else None; None with the rule off."""
        with self.lock:
            senders, bounded = self._reach()
            if senders is None or bounded is None:
                return None
            said = (senders == 0, bounded)
            if said == self.reach_reported:
                return None
            self.reach_reported = said
            return senders, bounded

    def take_new_quarantines(self) -> list[tuple[str, str]]:
        """Quarantines since the last call, (neighbour, reason) each, for the log."""
        with self.lock:
            new, self.engine.guard.new_quarantines = self.engine.guard.new_quarantines, []
            return new

    def robust_snapshot(self) -> dict[str, dict[str, object]]:
        """Per neighbour: anomaly score, clipped fraction, quarantined since (the status document)."""
        with self.lock:
            return self.engine.guard.snapshot(self.peer_id)

    # --- sending -----------------------------------------------------------------------------------------------
    def send(self, receivers: list[str], ready: Collection[str], round_index: int) -> list[OutMessage]:
        """This round's messages to the ``ready`` ones of ``receivers``: planned and committed under the lock,
        encoded outside it."""
        with self.lock:
            plan = self.engine.plan_round(receivers, round_index, ready)
        if plan is None:
            return []
        self.engine.encode_round(plan)
        with self.lock:
            messages = self.engine.commit_round(plan)
        if self.phase is PhaseName.TRAINING:
            self.training_bytes += sum(len(m.payload) for m in messages)
        return messages

    # --- the transport's entry points (each atomic) ------------------------------------------------------------
    def hello_for(self, receiver: str) -> Hello:
        with self.lock:
            return self.engine.hello_for(receiver)

    def on_hello_reply(self, receiver: str, hello: Hello, reply: HelloReply) -> Settlement[Sent]:
        with self.lock:
            return self.engine.on_hello_reply(receiver, hello, reply)

    def on_ack(self, receiver: str, seq: int) -> Settlement[Sent]:
        with self.lock:
            return self.engine.on_ack(receiver, seq)

    def answer_hello(self, sender: str, hello: Hello) -> HelloReply:
        with self.lock:
            return self.engine.answer_hello(sender, hello)

    def receive(self, sender: str, seq: int, weight: float, scale: float, payload: bytes | memoryview) -> bool:
        """Check and decode outside the lock, apply under it; True if applied, False if a duplicate/fenced copy.

        Raises:
            peer.gossip.engine.GossipInputError: malformed or hostile; nothing changed.
        """
        try:
            self.engine.check_update(sender, seq, weight, scale)
            decoded = self.engine.decode(payload)
        except GossipInputError as exc:
            with self.lock:
                self.engine.charge_refusal(sender, exc)
            raise
        with self.lock:
            return self.engine.apply(sender, seq, weight, scale, decoded)

    def note_probe(self, sender: str, sketch: bytes) -> None:
        """``sender``'s consensus probe arrived (peer/gossip/sketch.py): its model's estimated distance from this
        peer's is recorded for the phase's judgement.

        Raises:
            peer.gossip.engine.GossipInputError: the sketch is not one ("bad_probe"); nothing changed.
        """
        try:
            values = decode_sketch(sketch)
        except SketchError as exc:
            raise GossipInputError("bad_probe", f"consensus probe refused: {exc}") from exc
        with self.lock:
            self.engine.observe_probe(sender, values)

    def probe_sketch(self) -> bytes:
        """The wire bytes of this peer's model sketch, for a consensus probe round."""
        with self.lock:
            values = self.engine.model_sketch()
        return encode_sketch(values)

    def in_flight_count(self, receiver: str) -> int:
        """Messages to ``receiver`` sent and not yet settled."""
        with self.lock:
            edge = self.engine.out_edges.get(receiver)
            return 0 if edge is None else len(edge.in_flight)

    def forget(self, peer_id: str) -> bool:
        """Drop a departed peer's edge state once nothing is in flight to it (False: not yet)."""
        with self.lock:
            return self.engine.forget_peer(peer_id)

    def known_peers(self) -> set[str]:
        """Peers the engine keeps edge state for (ledgers, replicas)."""
        with self.lock:
            return self.engine.known_peers()

    # --- status ------------------------------------------------------------------------------------------------
    def status_snapshot(self) -> PeerStatus:
        """The engine's status figures, taken under the lock once (cheap: no tensor work)."""
        with self.lock:
            e = self.engine
            senders, bounded = self._reach()
            return PeerStatus(w=e.w, gamma=e.gamma,
                              in_flight={r: len(edge.in_flight) for r, edge in e.out_edges.items() if edge.in_flight},
                              known_peers=frozenset(e.known_peers()),
                              gossip_state_bytes=e.algorithm.state_nbytes(), phase=self.phase.value,
                              distances=dict(e.distances.latest),
                              consensus_rounds=sum(p.rounds for p in self.all_phases()),
                              consensus_bytes=sum(p.payload_bytes for p in self.all_phases()),
                              robust=e.guard.config.enabled, senders=senders, max_insiders=bounded)

    def _reach(self) -> tuple[int | None, int | None]:
        """``senders`` and ``max_insiders`` of :class:`PeerStatus` (under the lock): the distinct peers the schedule
        has send to this peer within a period, less the quarantined, and what they let a local rule bound in a
        fleet the size of the schedule's view (peer/gossip/reach.py)."""
        guard = self.engine.guard
        if not guard.schedule_senders or guard.schedule_view is None:
            return None, None
        senders = len(guard.schedule_senders - guard.quarantined())
        bounded = max_insiders_bounded(senders, len(guard.schedule_view)) if guard.config.enabled else None
        return senders, bounded

    def all_phases(self) -> list[ConsensusPhase]:
        """The finished consensus phases and the running one."""
        return [*self.consensus_done, *([self.consensus] if self.consensus is not None else [])]
