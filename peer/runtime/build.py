"""Assembling a peer from a spec - written once, for the daemon, the simulator, ``train`` and ``fleet``.

    dataset -> shard (skew partition) -> BatchLoader -> model (same seed everywhere) -> Peer;  test batches

Every seed is derived here, so peers built by different drivers from the same spec and shard are identical.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from peer.config import DataSpec, ModelSpec, RunSpec
from peer.data import BatchLoader, DatasetSplits, TensorData, load_dataset, skew_partition
from peer.gossip.ledger import DEFAULT_MAX_PEERS
from peer.gossip.topology import Topology
from peer.lowp.convert import Conversion
from peer.lowp.passes import passes_for
from peer.lowp.precision import PrecisionConfig, ResolvedPrecision, resolve_precision
from peer.models import build_model, model_fingerprint
from peer.models.plugin import DataShape, build_plugin
from peer.models.source import ModelSource
from peer.runtime.peer import Peer

log = logging.getLogger(__name__)

#: Why a converted model's int8 passes run eagerly unless LPDL_LOWP_EAGER=0: torch.compile makes one graph per
#: layer shape, and a converted torchvision model has dozens (docs/decisions/eager-passes.md#converted-models).
CONVERTED_EAGER_WHY = ("compiling one graph per layer shape took minutes at the first step for converted models "
                       "(MobileNetV3-Small: 531 s vs 0.9 s eager); LPDL_LOWP_EAGER=0 compiles anyway")

#: Test-set batch size for evaluation (samples; memory only, accuracy does not depend on it).
EVAL_BATCH_SIZE = 64


@dataclass
class BuiltModel:
    """A model plus what peers must agree on (fingerprint), what status reports (precision in use, source, the
    layer table) and what an exported model's card says (data shape and normalisation).

    Attributes:
        conversion: the converter's account of a plug-in model (layers, precision paths, fp32 leftovers), None for
            the registry's hand-written 8-bit models.
    """

    model: nn.Module
    fingerprint: str
    precision: ResolvedPrecision
    source: ModelSource
    data: DataShape
    conversion: Conversion | None = None

    def layer_report(self) -> dict[str, str]:
        """The converter's layer table and its one-line summary (empty for the registry's models)."""
        if self.conversion is None:
            return {}
        return {"layers": self.conversion.render(), "layers_summary": self.conversion.summary()}

    def info(self) -> dict[str, object]:
        """What a checkpoint keeps beside the weights so the model can be exported without the data: the source,
        the data's classes, input shape and normalisation."""
        return {"source": self.source.ref, "source_kind": self.source.kind, **self.data.as_dict()}


def data_shape(splits: DatasetSplits) -> DataShape:
    """What a model must take and give for ``splits`` (classes, input shape, normalisation)."""
    return DataShape(splits.name, splits.num_classes, *splits.input_shape, mean=tuple(splits.mean),
                     std=tuple(splits.std), classes=splits.classes,
                     pixels=splits.train.images.dtype == torch.uint8)


def load_splits(data: DataSpec) -> DatasetSplits:
    """The configured dataset (a built-in reader or the user's plug-in), with its reader options."""
    opts = {"image_size": data.image_size} if data.image_size is not None else {}
    return load_dataset(data.dataset, data.root, **opts)


def build_peer_model(spec: ModelSpec, splits: DatasetSplits, device: torch.device, seed: int = 0,
                     source: ModelSource | None = None) -> BuiltModel:
    """Build the configured model for a dataset, resolving the precision mode (int8 falls back if the probe fails).

    ``source`` (the Python API's callable) overrides ``spec.name``. All peers build from the same seed, so they
    start from the same model (the paper's setting, and the common start of Choco's replicas). A plug-in model is
    checked against the data (one line naming both sides on a mismatch) and converted for the precision.
    """
    return build_model_for(spec, data_shape(splits), device, seed, source)


def build_model_for(spec: ModelSpec, data: DataShape, device: torch.device, seed: int = 0,
                    source: ModelSource | None = None) -> BuiltModel:
    """:func:`build_peer_model` from the data's shape alone (a checkpoint's ``info``), without loading the data:
    what ``lpdl-peer export`` rebuilds a trained model with."""
    source = source or ModelSource.parse(spec.name, spec.options, spec.weights)
    eager_why = CONVERTED_EAGER_WHY if source.plugin and spec.precision == "int8" else None
    resolved = resolve_precision(PrecisionConfig(mode=spec.precision, bits=spec.bits, passes=passes_for(eager_why)),
                                 device)
    if eager_why is not None and resolved.config_in_use.passes.info.reason == eager_why:
        log.warning("int8 quantization passes: eager for a converted model (%s)", CONVERTED_EAGER_WHY)
    torch.manual_seed(seed)
    if not source.plugin:
        model = build_model(spec.name, num_classes=data.num_classes, in_channels=data.in_channels,
                            norm=spec.norm, precision=resolved.config_in_use, groups=spec.groups).to(device)
        fingerprint = model_fingerprint(spec.name, num_classes=data.num_classes, in_channels=data.in_channels,
                                        norm=spec.norm, groups=spec.groups)
        return BuiltModel(model, fingerprint, resolved, source, data)
    conversion, fingerprint = build_plugin(source, data, norm=spec.norm, precision=resolved.config_in_use,
                                           groups=spec.groups)
    model = conversion.model.to(device)
    if resolved.config_in_use.step_check is not None:
        fp32 = PrecisionConfig("fp32", resolved.config_in_use.bits)
        resolved.config_in_use.step_check.attach(
            model, lambda: build_plugin(source, data, norm=spec.norm, precision=fp32, groups=spec.groups)[0].model)
    return BuiltModel(model, fingerprint, resolved, source, data, conversion)


def loader_seed(spec: RunSpec, rank: int) -> int:
    """Seed of peer ``rank``'s batch order (distinct per peer, shared by every driver)."""
    return spec.data.seed + 1000 + rank


def build_peer(spec: RunSpec, peer_id: str, shard: tuple[int, int], splits: DatasetSplits, device: torch.device,
               built: BuiltModel, max_peers: int = DEFAULT_MAX_PEERS) -> Peer:
    """The peer of rank ``shard[0]`` of ``shard[1]``, training a private copy of ``built.model`` on its shard
    (``max_peers``: see :class:`Peer`)."""
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
                seed=d.seed + rank, max_peers=max_peers)


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
