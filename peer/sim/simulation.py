"""Many peers in one process over the in-memory transport, running the daemon's round (docs/design.md#simulation).

Each simulated peer is built by :func:`peer.runtime.build.build_peer` and driven by
:func:`peer.runtime.round.run_round`, exactly like a daemon; only the transport and the scheduling differ: rounds are
synchronous here (every online peer runs its round, then the transport delivers), for reproducibility.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from peer.config import RunSpec
from peer.data import DatasetSplits
from peer.gossip.engine import OutMessage
from peer.models.source import ModelSource
from peer.runtime import state
from peer.runtime.build import build_peer, build_peer_model, test_batches
from peer.runtime.evaluation import evaluate
from peer.runtime.peer import Peer
from peer.runtime.recovery import PeerDiverged, RecoveryEvent
from peer.runtime.round import SettleReport, Transport, run_round
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

    def as_dict(self) -> dict[str, float]:
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

    @property
    def rounds_per_epoch(self) -> int:
        first = next(iter(self.peers.values()))
        return max(1, math.ceil(first.steps_per_epoch / self.spec.gossip.local_steps))

    def step_round(self) -> float:
        """One synchronous round over the online peers; returns their mean training loss."""
        t = self.round
        self.transport.begin_round(t)
        online = self.transport.online(t)
        losses = []
        for peer_id in online:
            attack = self.attacks.get(peer_id)
            transport: Transport = self.transport if attack is None else _Tampering(self.transport, attack,
                                                                                    self.peers[peer_id])
            try:
                result = run_round(self.peers[peer_id], transport, [p for p in online if p != peer_id], t,
                                   self.spec.gossip.local_steps)
            except PeerDiverged as exc:
                raise SimulationDiverged(str(exc)) from exc
            if result.recovery is not None:
                self.recoveries.append(result.recovery)
            else:
                losses.append(result.loss)
        self.transport.deliver(t)
        self.round += 1
        return sum(losses) / len(losses) if losses else math.nan

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
        return EpochRow(epoch=self.round / self.rounds_per_epoch, round=self.round, avg_model_acc=avg_acc,
                        mean_peer_acc=sum(peer_accs) / len(peer_accs), train_loss=train_loss,
                        bytes_per_peer=sum(self.transport.bytes_sent(p) for p in self.honest) / len(peers),
                        consensus_distance=state.consensus_distance(zs), wall_s=time.perf_counter() - started,
                        recoveries=len(self.recoveries))

    def run(self, epochs: float, on_row: Callable[[EpochRow], None] | None = None,
            on_round: Callable[[int], None] | None = None) -> list[EpochRow]:
        """Run ``epochs`` epochs (of one peer's shard), measuring after each whole epoch and at the end."""
        total = max(1, round(epochs * self.rounds_per_epoch))
        started = time.perf_counter()
        losses: list[float] = []
        for r in range(total):
            losses.append(self.step_round())
            if on_round:
                on_round(r)
            if (r + 1) % self.rounds_per_epoch == 0 or r + 1 == total:
                finite = [v for v in losses if math.isfinite(v)]
                row = self.measure(sum(finite) / len(finite) if finite else math.nan, started)
                losses.clear()
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

    def ready(self, sender: str, receivers: Sequence[str]) -> set[str]:
        return self.inner.ready(sender, receivers)

    def submit(self, messages: Sequence[OutMessage]) -> None:
        self.inner.submit([self.attack.tamper(m, self.layout) for m in messages])

    async def settle(self, timeout_s: float) -> SettleReport:
        return await self.inner.settle(timeout_s)
