"""Batched augmentation (crop with zero padding, flip) and BatchLoader coverage / determinism."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from peer.data.augment import augment_batch, random_crop, random_hflip
from peer.data.loader import BatchLoader
from peer.data.tensors import TensorData


def _batch(b: int = 6, c: int = 2, h: int = 8, w: int = 8) -> torch.Tensor:
    return torch.arange(1, b * c * h * w + 1, dtype=torch.float32).view(b, c, h, w)


def test_flip_exactly_mirrors_or_keeps() -> None:
    x = _batch(b=64)
    y = random_hflip(x, torch.Generator().manual_seed(0))
    assert y.shape == x.shape
    flipped = [bool(torch.equal(y[i], x[i].flip(2))) for i in range(64)]
    kept = [bool(torch.equal(y[i], x[i])) for i in range(64)]
    assert all(f != k for f, k in zip(flipped, kept))
    assert 10 < sum(flipped) < 54


def test_crop_is_shifted_window_with_zeros() -> None:
    x = _batch(b=32)
    pad = 4
    y = random_crop(x, pad, torch.Generator().manual_seed(1))
    assert y.shape == x.shape
    padded = torch.nn.functional.pad(x, (pad,) * 4)
    shifts = set()
    for i in range(32):
        matches = [
            (dy, dx)
            for dy in range(2 * pad + 1)
            for dx in range(2 * pad + 1)
            if torch.equal(y[i], padded[i, :, dy : dy + 8, dx : dx + 8])
        ]
        assert len(matches) == 1
        shifts.add(matches[0])
    assert len(shifts) > 5
    assert (y == 0).any()  # some windows reach into the zero border


def test_augmentation_is_deterministic_with_seed() -> None:
    x = _batch()
    a = augment_batch(x, torch.Generator().manual_seed(5))
    b = augment_batch(x, torch.Generator().manual_seed(5))
    c = augment_batch(x, torch.Generator().manual_seed(6))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def _data(n: int = 50) -> TensorData:
    images = torch.arange(n, dtype=torch.uint8).view(n, 1, 1, 1).expand(n, 1, 4, 4).contiguous()
    return TensorData(images, torch.arange(n, dtype=torch.int64) % 3)


def test_loader_covers_indices_once_per_epoch() -> None:
    data = _data()
    indices = np.array([3, 7, 8, 20, 21, 22, 30, 41, 42, 49, 0])
    loader = BatchLoader(data, indices, batch_size=4, shuffle=True, seed=2)
    assert len(loader) == 3
    epochs = []
    for _ in range(2):
        seen = []
        for x, y in loader:
            assert x.dtype == torch.float32 and x.shape[1:] == (1, 4, 4) and y.dtype == torch.int64
            ids = x[:, 0, 0, 0].mul(255).round().long()  # mean 0, std 1: x is pixel/255
            assert torch.equal(y, ids % 3)
            seen.extend(ids.tolist())
        assert sorted(seen) == sorted(indices.tolist())
        epochs.append(seen)
    assert epochs[0] != epochs[1]  # reshuffled per epoch
    again = [v for x, _ in BatchLoader(data, indices, batch_size=4, seed=2) for v in x[:, 0, 0, 0].tolist()]
    assert [round(v * 255) for v in again] == epochs[0]


def test_loader_drop_last_normalisation_and_stream() -> None:
    data = _data()
    loader = BatchLoader(data, torch.arange(10), batch_size=4, drop_last=True, shuffle=False, mean=(0.5,), std=(0.25,))
    batches = list(loader)
    assert len(loader) == len(batches) == 2 and all(x.shape[0] == 4 for x, _ in batches)
    assert torch.allclose(batches[0][0][1, 0, 0, 0], torch.tensor((1 / 255 - 0.5) / 0.25))
    stream = loader.stream()
    assert sum(1 for _ in zip(range(7), stream)) == 7


def test_loader_augment_keeps_shape_and_rejects_bad_args() -> None:
    data = _data()
    x, _ = next(iter(BatchLoader(data, batch_size=8, augment=True)))
    assert x.shape == (8, 1, 4, 4)
    with pytest.raises(ValueError, match="indices"):
        BatchLoader(data, [0, 50])
    with pytest.raises(ValueError, match="batch_size"):
        BatchLoader(data, batch_size=0)
    with pytest.raises(ValueError, match="mean/std"):
        BatchLoader(data, mean=(0.1, 0.2), std=(1.0, 1.0))
