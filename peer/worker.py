"""One peer's learning state: model, data shard, push-sum optimizer and gossip engine.

The simulator, the daemon and centralised training all drive this class; they differ only in how the gossip
engine's messages travel (in memory, gRPC, or nowhere). A round is: ``train_steps(H)`` -> engine.send_round ->
deliver/receive -> ``end_round()``.

Thread-safety: the daemon applies received messages from its network thread while this worker trains; every write
to the engine's x/w happens under ``lock`` (the forward/backward pass itself runs outside it, on the model's z).
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from peer.compress.codec import CodecConfig
from peer.config import GossipSpec, ModelSpec, OptimSpec
from peer.data.tensors import DatasetSplits
from peer.flat import FlatModel
from peer.gossip.engine import GossipEngine
from peer.gossip.optim import OptimConfig, PushSumSGD
from peer.lowp.precision import PrecisionConfig, ResolvedPrecision, resolve_precision
from peer.models import build_model, model_fingerprint
from peer.schedule import lr_at


@dataclass
class BuiltModel:
    """A model plus what peers must agree on and what status reports."""

    model: nn.Module
    fingerprint: str
    precision: ResolvedPrecision


def build_peer_model(spec: ModelSpec, splits: DatasetSplits, device: torch.device, seed: int = 0) -> BuiltModel:
    """Build the configured model for a dataset, resolving the precision mode (int8 falls back if the probe fails).

    All peers build from the same seed, so they start from the same model (the paper's setting).
    """
    resolved = resolve_precision(PrecisionConfig(mode=spec.precision, bits=spec.bits), device)
    torch.manual_seed(seed)
    model = build_model(spec.name, num_classes=splits.num_classes, in_channels=splits.in_channels, norm=spec.norm,
                        precision=resolved.config_in_use, groups=spec.groups).to(device)
    fingerprint = model_fingerprint(spec.name, num_classes=splits.num_classes, in_channels=splits.in_channels,
                                    norm=spec.norm, groups=spec.groups)
    return BuiltModel(model=model, fingerprint=fingerprint, precision=resolved)


def codec_config(spec: GossipSpec) -> CodecConfig:
    return CodecConfig(compression=spec.compression, bits=spec.bits, rounding=spec.rounding)


class PeerWorker:
    """Local training on z = x / w; the step moves z and is written into x (see :mod:`peer.gossip.optim`).

    Args:
        peer_id: this peer's id.
        model: the model (its parameters are rebound to a flat buffer).
        batches: endless iterator of (x, y) training batches from this peer's shard.
        steps_per_epoch: local steps that make one epoch of this peer's shard (drives the lr schedule).
        optim: optimizer and schedule.
        gossip: algorithm and compression.
        seed: seeds stochastic rounding in the codec.
        lock: guards the engine's x/w (the daemon passes a real lock; the simulator none).
    """

    def __init__(self, peer_id: str, model: nn.Module, batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
                 steps_per_epoch: int, optim: OptimSpec, gossip: GossipSpec, seed: int = 0,
                 lock: threading.Lock | None = None) -> None:
        self.peer_id = peer_id
        self.flat = FlatModel(model)
        self.model = model
        self.batches = batches
        self.steps_per_epoch = max(1, steps_per_epoch)
        self.optim_spec = optim
        self.engine = GossipEngine(peer_id, self.flat.layout, self.flat.z, gossip.algorithm, codec_config(gossip),
                                   gamma=gossip.effective_gamma, seed=seed, replica_init=self.flat.z)
        self.optimizer = PushSumSGD(self.flat.z.numel(), OptimConfig(
            momentum=optim.momentum, weight_decay=optim.weight_decay, nesterov=optim.nesterov, qgm=optim.qgm),
            device=self.flat.z.device)
        self.lock = lock if lock is not None else contextlib.nullcontext()
        self.steps = 0
        self.last_loss = math.nan

    @property
    def epoch(self) -> float:
        """Epochs of this peer's shard done so far (fractional)."""
        return self.steps / self.steps_per_epoch

    def lr(self) -> float:
        o = self.optim_spec
        return lr_at(self.epoch, o.lr, o.epochs, o.warmup_epochs)

    def train_steps(self, n: int) -> float:
        """Run ``n`` local SGD steps; returns their mean training loss."""
        self.model.train()
        losses = []
        for _ in range(n):
            x, y = next(self.batches)
            lr = self.lr()
            self.flat.zero_grad()
            loss = nn.functional.cross_entropy(self.model(x), y)
            loss.backward()
            grad = self.flat.gradient()
            with self.lock:
                self.optimizer.step(self.engine.x, self.flat.z, grad, lr, self.engine.w)
                self.engine.state.debias_into(self.flat.z)
            self.steps += 1
            losses.append(float(loss.detach()))
        self.last_loss = sum(losses) / len(losses) if losses else math.nan
        return self.last_loss

    def end_round(self) -> None:
        """After gossip: load the de-biased model z = x / w and let QGM fold the gossip movement in."""
        with self.lock:
            self.engine.state.debias_into(self.flat.z)
        self.optimizer.after_gossip(self.flat.z, self.lr())

    def load_model_vector(self, z: torch.Tensor) -> None:
        """Start from a given model (a joiner's pulled model): x = z, w = 1, edges untouched."""
        with self.lock:
            self.engine.state.x.copy_(z)
            self.engine.state.w = 1.0
            self.flat.z.copy_(z)
