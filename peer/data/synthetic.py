"""A tiny generated dataset for tests and benchmarks: deterministic, needs no files, and learnable in a few steps.

Each class has a fixed random prototype image; a sample is its class prototype plus independent pixel noise. With the
default noise a linear model separates the classes, so a short training run must lower the loss.
"""

from __future__ import annotations

import math

import torch

from peer.data.tensors import DatasetSplits, TensorData


def _draw(prototypes: torch.Tensor, n: int, noise: float, generator: torch.Generator) -> TensorData:
    num_classes = prototypes.shape[0]
    labels = torch.arange(n, dtype=torch.int64) % num_classes
    labels = labels[torch.randperm(n, generator=generator)]
    jitter = torch.randn((n, *prototypes.shape[1:]), generator=generator) * noise
    images = (prototypes[labels] + jitter).round_().clamp_(0, 255).to(torch.uint8)
    return TensorData(images, labels)


def load_synthetic(
    num_classes: int = 10,
    n_train: int = 1000,
    n_test: int = 200,
    image_size: int = 16,
    in_channels: int = 3,
    noise: float = 40.0,
    seed: int = 0,
) -> DatasetSplits:
    """Generate train/test splits with balanced classes (labels cycle 0..num_classes-1, then shuffled).

    noise: standard deviation of the per-pixel Gaussian noise, in 0..255 pixel units.
    """
    if num_classes < 2:
        raise ValueError(f"num_classes: expected >= 2, got {num_classes}")
    if n_train < 1 or n_test < 1:
        raise ValueError(f"n_train/n_test: expected >= 1, got {n_train}/{n_test}")
    generator = torch.Generator().manual_seed(seed)
    # pixel = uniform(0, 255) prototype + N(0, noise^2): mean 0.5 and this std on the 0..1 scale (before clamping)
    std = math.sqrt(1.0 / 12.0 + (noise / 255.0) ** 2)
    prototypes = torch.rand((num_classes, in_channels, image_size, image_size), generator=generator) * 255.0
    return DatasetSplits(
        train=_draw(prototypes, n_train, noise, generator),
        test=_draw(prototypes, n_test, noise, generator),
        num_classes=num_classes,
        in_channels=in_channels,
        image_size=image_size,
        mean=(0.5,) * in_channels,
        std=(std,) * in_channels,
        augment=False,
    )
