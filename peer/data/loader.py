"""Mini-batch iteration over a peer's share of an in-memory dataset.

Images stay uint8 until a batch is drawn; each batch is converted to float32 on the 0..1 scale (float32 images of a
plug-in dataset are taken as they are), augmented (crop with
black padding + flip, like torchvision's RandomCrop on PIL images), then normalised per channel.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch

from peer.data.augment import augment_batch
from peer.data.tensors import TensorData


class BatchLoader:
    """Iterate (x, y) batches over `data` restricted to `indices`, one pass per `iter()`.

    x: float32 [B, C, H, W], normalised with `mean`/`std` (per channel, 0..1 pixel scale); y: int64 [B].
    With shuffle=True each epoch uses a fresh permutation from the loader's own generator (seeded with `seed`), so two
    loaders built with the same arguments yield the same batches in the same order.
    """

    def __init__(
        self,
        data: TensorData,
        indices: np.ndarray | torch.Tensor | Sequence[int] | None = None,
        *,
        batch_size: int = 32,
        mean: Sequence[float] = (0.0,),
        std: Sequence[float] = (1.0,),
        shuffle: bool = True,
        augment: bool = False,
        drop_last: bool = False,
        seed: int = 0,
        device: torch.device | str = "cpu",
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size: expected >= 1, got {batch_size}")
        if indices is None:
            idx = torch.arange(len(data), dtype=torch.int64)
        else:
            idx = torch.as_tensor(np.asarray(indices), dtype=torch.int64).reshape(-1)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= len(data)):
            raise ValueError(f"indices: expected values in [0, {len(data)}), got [{int(idx.min())}, {int(idx.max())}]")
        channels = data.images.shape[1]
        if len(mean) != channels or len(std) != channels:
            raise ValueError(f"mean/std: expected {channels} values each, got {len(mean)} and {len(std)}")
        self.data = data
        self.indices = idx
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.augment = augment
        self.drop_last = drop_last
        self.device = torch.device(device)
        self.generator = torch.Generator().manual_seed(seed)
        self._mean = torch.tensor(mean, dtype=torch.float32, device=self.device).view(1, -1, 1, 1)
        self._std = torch.tensor(std, dtype=torch.float32, device=self.device).view(1, -1, 1, 1)

    def __len__(self) -> int:
        """Batches per epoch."""
        n = self.indices.numel()
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        order = self.indices
        if self.shuffle:
            order = order[torch.randperm(order.numel(), generator=self.generator)]
        for start in range(0, len(self) * self.batch_size, self.batch_size):
            yield self._batch(order[start : start + self.batch_size])

    def stream(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Endless batches, epoch after epoch, for step-based training; empty index sets raise instead of hanging."""
        if len(self) == 0:
            raise ValueError(
                "stream: the loader yields no batch per epoch (no indices, or fewer than batch_size with drop_last)"
            )
        while True:
            yield from self

    def _batch(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.data.images[idx].to(self.device, non_blocking=True)
        x = x.float().div_(255.0) if x.dtype == torch.uint8 else x.clone()
        if self.augment:
            x = augment_batch(x, self.generator)
        x = (x - self._mean) / self._std
        y = self.data.labels[idx].to(self.device, non_blocking=True)
        return x, y
