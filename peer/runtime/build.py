"""Assembling a peer from a spec - written once, for the daemon, the simulator, ``train`` and ``fleet``.

    dataset -> shard (skew partition) -> BatchLoader -> model (same seed everywhere) -> Peer;  test batches

Every seed is derived here, so peers built by different drivers from the same spec and shard are identical.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from peer.config import ModelSpec, RunSpec
from peer.data import BatchLoader, DatasetSplits, TensorData, skew_partition
from peer.gossip.topology import Topology
from peer.lowp.precision import PrecisionConfig, ResolvedPrecision, resolve_precision
from peer.models import build_model, model_fingerprint
from peer.runtime.peer import Peer

#: Test-set batch size for evaluation (samples; memory only, accuracy does not depend on it).
EVAL_BATCH_SIZE = 64


@dataclass
class BuiltModel:
    """A model plus what peers must agree on (fingerprint) and what status reports (precision in use)."""

    model: nn.Module
    fingerprint: str
    precision: ResolvedPrecision


def build_peer_model(spec: ModelSpec, splits: DatasetSplits, device: torch.device, seed: int = 0) -> BuiltModel:
    """Build the configured model for a dataset, resolving the precision mode (int8 falls back if the probe fails).

    All peers build from the same seed, so they start from the same model (the paper's setting, and the common
    start of Choco's replicas).
    """
    resolved = resolve_precision(PrecisionConfig(mode=spec.precision, bits=spec.bits), device)
    torch.manual_seed(seed)
    model = build_model(spec.name, num_classes=splits.num_classes, in_channels=splits.in_channels, norm=spec.norm,
                        precision=resolved.config_in_use, groups=spec.groups).to(device)
    fingerprint = model_fingerprint(spec.name, num_classes=splits.num_classes, in_channels=splits.in_channels,
                                    norm=spec.norm, groups=spec.groups)
    return BuiltModel(model=model, fingerprint=fingerprint, precision=resolved)


def loader_seed(spec: RunSpec, rank: int) -> int:
    """Seed of peer ``rank``'s batch order (distinct per peer, shared by every driver)."""
    return spec.data.seed + 1000 + rank


def build_peer(spec: RunSpec, peer_id: str, shard: tuple[int, int], splits: DatasetSplits, device: torch.device,
               built: BuiltModel) -> Peer:
    """The peer of rank ``shard[0]`` of ``shard[1]``, training a private copy of ``built.model`` on its shard."""
    rank, total = shard
    d = spec.data
    indices = skew_partition(splits.train.labels.numpy(), total, d.skew, seed=d.seed)[rank]
    augment = splits.augment if d.augment is None else d.augment
    loader = BatchLoader(shard_of(splits.train, indices), batch_size=d.batch_size, mean=splits.mean, std=splits.std,
                         augment=augment, drop_last=len(indices) >= d.batch_size, seed=loader_seed(spec, rank),
                         device=device)
    g = spec.gossip
    topology = Topology(kind=g.topology, rotating=g.rotating, k=g.k, seed=d.seed)
    return Peer(peer_id, copy.deepcopy(built.model), loader.stream(), len(loader), spec.optim, g, topology,
                seed=d.seed + rank)


def shard_of(data: TensorData, indices: np.ndarray) -> TensorData:
    """A compact copy of the rows ``indices`` of ``data``, in that order: a peer's loader then holds its own shard
    only, and the full split can be freed (a quarter of CIFAR-10's 150 MiB of uint8 images for one of four peers).
    Batches are the same as a loader over ``data`` restricted to ``indices`` with the same seed."""
    rows = torch.as_tensor(np.asarray(indices), dtype=torch.int64).reshape(-1)
    return TensorData(data.images[rows], data.labels[rows])


def eval_loader(splits: DatasetSplits, device: torch.device, batch_size: int = EVAL_BATCH_SIZE) -> BatchLoader:
    """The test split in evaluation order, each batch normalised to float32 when drawn: re-iterable, and only one
    fp32 batch exists at a time (the whole split in fp32 is 4x its uint8 size: 117 MiB for CIFAR-10's test set).

    The daemon evaluates at its training batch size: an int8 model's forward kernels are then the ones planned for
    training, where a new batch size made the first evaluation probe kernels for new shapes (README fleet daemon:
    +30 MiB of peak RSS, the largest transient it had)."""
    return BatchLoader(splits.test, batch_size=batch_size, mean=splits.mean, std=splits.std, shuffle=False,
                       device=device)


def test_batches(splits: DatasetSplits, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The normalised test split, batched once: for drivers that evaluate many models on it (the simulator's peers,
    the fleet report's checkpoints), trading its fp32 size for one conversion."""
    return list(eval_loader(splits, device))
