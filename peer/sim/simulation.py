"""Many peers in one process over the in-memory transport, running the daemon's round (docs/design.md#simulation).

Each simulated peer is built by :func:`peer.runtime.build.build_peer` and driven by
:func:`peer.runtime.round.run_round`, exactly like a daemon; only the transport and the scheduling differ: rounds are
synchronous here (every online peer runs its round, then the transport delivers), for reproducibility.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import torch

from peer.config import RunSpec
from peer.data import DatasetSplits
from peer.gossip.consensus import PhaseName
from peer.gossip.engine import OutMessage
from peer.gossip.kinds import Algorithm
from peer.models.source import ModelSource
from peer.runtime import state
from peer.runtime.build import build_peer, build_peer_model, test_batches
from peer.runtime.consensus import begin_phase, run_peer_round
from peer.runtime.evaluation import evaluate
from peer.runtime.peer import Peer
from peer.runtime.recovery import PeerDiverged, RecoveryEvent
from peer.runtime.round import SettleReport, Transport
from peer.sim.attacks import Attack
from peer.sim.transport import ChaosSpec, InMemoryTransport


class SimulationDiverged(PeerDiverged):
    """A peer diverged past its bounded recoveries (peer/runtime/recovery.py); the rows measured so far stay in
    ``Simulation.rows``."""


@dataclass
class EpochRow:
    """One line of the simulator's table (accuracies in [0, 1], bytes by the transport's frame rule)."""

    epoch: float
    round: int
    avg_model_acc: float
    mean_peer_acc: float
    train_loss: float
    bytes_per_peer: float
    consensus_distance: float
    wall_s: float
    recoveries: int = 0  # divergence recoveries (roll-back + gamma halved) of all peers so far
    phase: str = "training"  # "consensus": measured after the final consensus phase
    consensus_rounds: int = 0  # consensus rounds so far (the most any peer ran, all phases)
    consensus_bytes_per_peer: float = 0.0  # bytes sent during consensus phases, mean over peers (in bytes_per_peer)

    def as_dict(self) -> dict[str, float | str]:
        return dict(self.__dict__)


class Simulation:
    """A fleet of simulated peers built from one :class:`RunSpec`.

    Args:
        spec: what every peer runs (seeds come from ``spec.data.seed``).
        splits: the dataset.
        n_peers: fleet size; peer ids are ``peer-000`` ...
        chaos: transport faults.
        device: torch device of every peer.
        source: the model, where it is not ``spec.model.name`` (the Python API's callable).
        attacks: insiders by peer id and what each sends (peer/sim/attacks.py; testing only). The table's
            accuracies and consensus distance are then the honest peers' alone.
    """

    def __init__(self, spec: RunSpec, splits: DatasetSplits, n_peers: int, chaos: ChaosSpec | None = None,
                 device: str = "cpu", source: ModelSource | None = None,
                 attacks: dict[str, Attack] | None = None) -> None:
        if n_peers < 1:
            raise ValueError(f"peers: need at least 1, got {n_peers}")
        self.spec = spec
        self.n_peers = n_peers
        self.chaos = chaos or ChaosSpec()
        dev = torch.device(device)
        built = build_peer_model(spec.model, splits, dev, seed=spec.data.seed, source=source)
        self.precision = built.precision
        #: The converter's layer table and summary for a plug-in model (empty for the registry's).
        self.layer_report = built.layer_report()
        self.eval_model = copy.deepcopy(built.model)
        self.ids = [f"peer-{r:03d}" for r in range(n_peers)]
        self.peers: dict[str, Peer] = {
            peer_id: build_peer(spec, peer_id, (rank, n_peers), splits, dev, built)
            for rank, peer_id in enumerate(self.ids)}
        self.test_batches = test_batches(splits, dev)
        self.transport = InMemoryTransport(self.peers, self.chaos, seed=spec.data.seed)
        self.attacks = dict(attacks or {})
        unknown = set(self.attacks) - set(self.ids)
        if unknown:
            raise ValueError(f"attacks: no such peer {', '.join(sorted(unknown))} (peers are {self.ids[0]} ...)")
        #: The peers the table measures: all but the insiders.
        self.honest = [p for p in self.ids if p not in self.attacks]
        self.round = 0
        self.rows: list[EpochRow] = []
        #: Every divergence recovery of every peer, in order (the round logs each one too).
        self.recoveries: list[RecoveryEvent] = []
        #: Whether a peer ran a consensus round (not a training one) in the last round, and how many such rounds
        #: ran (they advance no epoch).
        self.consensus_last_round = False
        self.consensus_round_count = 0

    @property
    def rounds_per_epoch(self) -> int:
        first = next(iter(self.peers.values()))
        return max(1, math.ceil(first.steps_per_epoch / self.spec.gossip.local_steps))

    def step_round(self) -> float:
        """One synchronous round over the online peers (training or consensus, each as its phase says; the final
        phase begins only in :meth:`converge`); returns their mean training loss (NaN where none
        trained)."""
        t = self.round
        self.transport.begin_round(t)
        online = self.transport.online(t)
        if any(a.needs_spread for a in self.attacks.values()):
            spread = self.honest_spread()
            for insider in self.attacks.values():
                insider.spread = spread
        losses = []
        in_consensus = False
        for peer_id in online:
            peer = self.peers[peer_id]
            consensus = peer.consensus is not None or peer.phase is not PhaseName.TRAINING
            attack = self.attacks.get(peer_id)
            others = [p for p in online if p != peer_id]
            transport: Transport = self.transport if attack is None else _Tampering(self.transport, attack, peer)
            if attack is not None and (named := attack.false_notice(t)) is not None:
                self.transport.notify(peer_id, others, named)
            try:
                result = run_peer_round(peer, transport, others, t, self.spec.gossip.local_steps, math.inf)
            except PeerDiverged as exc:
                raise SimulationDiverged(str(exc)) from exc
            consensus = consensus or peer.consensus is not None
            in_consensus = in_consensus or consensus
            if result is None or consensus:
                continue
            if result.recovery is not None:
                self.recoveries.append(result.recovery)
            else:
                losses.append(result.loss)
        self.transport.deliver(t)
        self.round += 1
        self.consensus_last_round = in_consensus
        self.consensus_round_count += in_consensus
        return sum(losses) / len(losses) if losses else math.nan

    def honest_spread(self) -> torch.Tensor:
        """Per-coordinate standard deviation of the honest peers' de-biased models (what an omniscient "a little is
        enough" insider shifts by; peer/sim/attacks.py)."""
        with torch.no_grad():
            return torch.stack([self.peers[p].engine.state.debiased() for p in self.honest]).std(0)

    def converge(self) -> int:
        """The final consensus phase of every peer (``gossip.consensus_rounds`` > 0), run until each one's phase
        ended (at most twice its round budget: a peer churned offline may not finish); returns the rounds it took
        (0 without a phase)."""
        if any(p.consensus_settings is None for p in self.peers.values()):
            return 0
        for peer in self.peers.values():
            begin_phase(peer, final=True)
        rounds = 0
        settings = next(iter(self.peers.values())).consensus_settings
        assert settings is not None
        limit = 2 * (settings.max_rounds + settings.patience)  # a peer offline (churn) may never finish its phase
        while rounds < limit and any(p.phase is not PhaseName.CONVERGED for p in self.peers.values()):
            self.step_round()
            rounds += 1
        return rounds

    def measure(self, train_loss: float, started: float) -> EpochRow:
        """Accuracy of the averaged model and of each peer, bytes, consensus distance."""
        peers = [self.peers[p] for p in self.honest]
        for peer in peers:
            peer.prepare_evaluation()
        zs = [p.flat.z for p in peers]
        with torch.no_grad():
            for p, v in zip(self.eval_model.parameters(), peers[0].flat.layout.views(state.average_model(zs))):
                p.copy_(v)
        state.load_buffers(self.eval_model, state.average_buffers([dict(p.model.named_buffers()) for p in peers]))
        _, avg_acc = evaluate(self.eval_model, self.test_batches)
        peer_accs = [evaluate(p.model, self.test_batches)[1] for p in peers]
        phases = [p.status_snapshot() for p in peers]
        return EpochRow(epoch=(self.round - self.consensus_round_count) / self.rounds_per_epoch, round=self.round,
                        avg_model_acc=avg_acc,
                        mean_peer_acc=sum(peer_accs) / len(peer_accs), train_loss=train_loss,
                        bytes_per_peer=sum(self.transport.bytes_sent(p) for p in self.honest) / len(peers),
                        consensus_distance=state.consensus_distance(zs), wall_s=time.perf_counter() - started,
                        recoveries=len(self.recoveries),
                        phase="consensus" if all(p.phase == PhaseName.CONVERGED.value for p in phases) else "training",
                        consensus_rounds=max(p.consensus_rounds for p in phases),
                        consensus_bytes_per_peer=sum(p.consensus_bytes for p in phases) / len(peers))

    def run(self, epochs: float, on_row: Callable[[EpochRow], None] | None = None,
            on_round: Callable[[int], None] | None = None) -> list[EpochRow]:
        """Run ``epochs`` epochs (of one peer's shard; rounds of periodic consensus phases come on top), measuring
        after each whole epoch and at the end, then the final consensus phase (with ``gossip.consensus_rounds``),
        measured in one more row."""
        total = max(1, round(epochs * self.rounds_per_epoch))
        started = time.perf_counter()
        losses: list[float] = []
        r = 0
        while r < total:
            loss = self.step_round()
            if self.consensus_last_round:
                continue
            losses.append(loss)
            if on_round:
                on_round(r)
            r += 1
            if r % self.rounds_per_epoch == 0 or r == total:
                finite = [v for v in losses if math.isfinite(v)]
                row = self.measure(sum(finite) / len(finite) if finite else math.nan, started)
                losses.clear()
                self.rows.append(row)
                if on_row:
                    on_row(row)
        if self.converge():
            row = self.measure(math.nan, started)
            self.rows.append(row)
            if on_row:
                on_row(row)
        return self.rows


class _Tampering:
    """An insider's view of the transport: its messages pass through its :class:`Attack` on the way out."""

    def __init__(self, inner: InMemoryTransport, attack: Attack, peer: Peer) -> None:
        self.inner = inner
        self.attack = attack
        self.layout = peer.flat.layout
        self.replicated = peer.engine.algorithm.name is Algorithm.CHOCO

    def ready(self, sender: str, receivers: Sequence[str]) -> set[str]:
        return self.inner.ready(sender, receivers)

    def submit(self, messages: Sequence[OutMessage]) -> None:
        hostile = (self.attack.tamper(m, self.layout, self.replicated) for m in messages)
        self.inner.submit([m for m in hostile if m is not None])

    def notify(self, sender: str, receivers: Collection[str], quarantined: Sequence[str]) -> None:
        self.inner.notify(sender, receivers, quarantined)

    def probe(self, sender: str, receivers: Collection[str], sketch: bytes, round_index: int) -> None:
        self.inner.probe(sender, receivers, sketch, round_index)

    async def settle(self, timeout_s: float) -> SettleReport:
        return await self.inner.settle(timeout_s)
