"""Many peers in one process on an in-memory transport, running the daemon's own gossip code (DESIGN.md 7).

Each simulated peer is a :class:`~peer.worker.PeerWorker` with its own model, shard and
:class:`~peer.gossip.engine.GossipEngine`; only the transport (:mod:`peer.simnet`: loss, delay, churn) differs from
the daemon.

Rounds are synchronous here for reproducibility; the daemon runs them asynchronously, which push-sum also handles.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from peer.config import RunSpec
from peer.data import BatchLoader, DatasetSplits, skew_partition
from peer.evaluate import evaluate
from peer.gossip.topology import Topology
from peer.simnet import ChaosSpec, InMemoryTransport
from peer.worker import PeerWorker, build_peer_model


class SimulationDiverged(RuntimeError):
    """A peer's model became NaN/Inf; the rows measured so far stay in ``Simulation.rows``."""


@dataclass
class EpochRow:
    """One line of the simulator's table."""

    epoch: float
    round: int
    avg_model_acc: float
    mean_peer_acc: float
    train_loss: float
    bytes_per_peer: float
    consensus_distance: float
    wall_s: float

    def as_dict(self) -> dict[str, float]:
        return dict(self.__dict__)


def average_model(workers: list[PeerWorker], into: torch.nn.Module) -> None:
    """Load the average of the peers' de-biased models (and floating buffers, e.g. activation ranges) into ``into``."""
    with torch.no_grad():
        z_bar = torch.stack([w.flat.z for w in workers]).mean(dim=0)
        for p, v in zip(into.parameters(), workers[0].flat.layout.views(z_bar)):
            p.copy_(v)
        buffers = [dict(w.model.named_buffers()) for w in workers]
        for name, buf in into.named_buffers():
            if buf.is_floating_point():
                buf.copy_(torch.stack([b[name] for b in buffers]).mean(dim=0))


def consensus_distance(workers: list[PeerWorker]) -> float:
    """mean_i ||z_i - z_bar|| (METHOD.md 9)."""
    zs = torch.stack([w.flat.z for w in workers])
    return float((zs - zs.mean(dim=0)).norm(dim=1).mean())


@dataclass
class Simulation:
    """A fleet of simulated peers built from one :class:`RunSpec`."""

    spec: RunSpec
    splits: DatasetSplits
    n_peers: int
    chaos: ChaosSpec = field(default_factory=ChaosSpec)
    device: str = "cpu"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.n_peers < 1:
            raise ValueError(f"peers: need at least 1, got {self.n_peers}")
        device = torch.device(self.device)
        d = self.spec.data
        shards = skew_partition(self.splits.train.labels.numpy(), self.n_peers, d.skew, seed=d.seed)
        augment = self.splits.augment if d.augment is None else d.augment
        self.ids = [f"peer-{r:03d}" for r in range(self.n_peers)]
        built = build_peer_model(self.spec.model, self.splits, device, seed=self.seed)
        self.precision = built.precision
        self.eval_model = copy.deepcopy(built.model)
        self.workers: dict[str, PeerWorker] = {}
        for rank, (peer_id, shard) in enumerate(zip(self.ids, shards)):
            loader = BatchLoader(self.splits.train, shard, batch_size=d.batch_size, mean=self.splits.mean,
                                 std=self.splits.std, augment=augment, drop_last=len(shard) >= d.batch_size,
                                 seed=d.seed + 1000 + rank, device=device)
            self.workers[peer_id] = PeerWorker(peer_id, copy.deepcopy(built.model), loader.stream(), len(loader),
                                               self.spec.optim, self.spec.gossip, seed=self.seed + rank)
        self.test_batches = list(BatchLoader(self.splits.test, batch_size=256, mean=self.splits.mean,
                                             std=self.splits.std, shuffle=False, device=device))
        g = self.spec.gossip
        self.topology = Topology(kind=g.topology, rotating=g.rotating, k=g.k, seed=d.seed)
        self.transport = InMemoryTransport({p: w.engine for p, w in self.workers.items()}, self.chaos,
                                           seed=self.seed)
        self.round = 0
        self.rows: list[EpochRow] = []

    @property
    def rounds_per_epoch(self) -> int:
        first = next(iter(self.workers.values()))
        return max(1, math.ceil(first.steps_per_epoch / self.spec.gossip.local_steps))

    def step_round(self) -> float:
        """One synchronous round over the online peers; returns their mean training loss."""
        t = self.round
        self.transport.churn(t)
        online = self.transport.online(t)
        losses = [self.workers[p].train_steps(self.spec.gossip.local_steps) for p in online]
        for peer_id in online:
            if not bool(torch.isfinite(self.workers[peer_id].engine.x).all()):
                raise SimulationDiverged(f"peer {peer_id} diverged in round {t} (training loss "
                                         f"{self.workers[peer_id].last_loss}); try a lower --lr or --gamma")
        for peer_id in online:
            out = self.topology.out_neighbours(online, peer_id, t)
            self.transport.send(self.workers[peer_id].engine.send_round(out, t), t)
        self.transport.deliver(t)
        for peer_id in online:
            self.workers[peer_id].end_round()
        self.round += 1
        return sum(losses) / len(losses)

    def measure(self, train_loss: float, started: float) -> EpochRow:
        workers = list(self.workers.values())
        average_model(workers, self.eval_model)
        _, avg_acc = evaluate(self.eval_model, self.test_batches)
        peer_accs = [evaluate(w.model, self.test_batches)[1] for w in workers]
        return EpochRow(epoch=self.round / self.rounds_per_epoch, round=self.round, avg_model_acc=avg_acc,
                        mean_peer_acc=sum(peer_accs) / len(peer_accs), train_loss=train_loss,
                        bytes_per_peer=sum(self.transport.bytes_sent.values()) / len(workers),
                        consensus_distance=consensus_distance(workers), wall_s=time.perf_counter() - started)

    def run(self, epochs: float, on_row: Callable[[EpochRow], None] | None = None,
            on_round: Callable[[int], None] | None = None) -> list[EpochRow]:
        """Run ``epochs`` epochs (of one peer's shard), measuring after each whole epoch and at the end."""
        total = max(1, round(epochs * self.rounds_per_epoch))
        started = time.perf_counter()
        rows = self.rows
        losses: list[float] = []
        for r in range(total):
            losses.append(self.step_round())
            if on_round:
                on_round(r)
            if (r + 1) % self.rounds_per_epoch == 0 or r + 1 == total:
                row = self.measure(sum(losses) / len(losses), started)
                losses.clear()
                rows.append(row)
                if on_row:
                    on_row(row)
        return rows
