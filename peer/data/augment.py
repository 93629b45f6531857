"""Batched data augmentation for CIFAR-style training: random crop with zero padding and random horizontal flip.

Works on a whole [B, C, H, W] float batch at once with one gather (no per-sample Python loop), so it stays cheap on a
Raspberry Pi class CPU and runs on whatever device the batch is on. Randomness comes from a caller-owned CPU
torch.Generator, so a seeded run is reproducible on any device.
"""

from __future__ import annotations

import torch


def random_crop(x: torch.Tensor, pad: int, generator: torch.Generator) -> torch.Tensor:
    """Pad each image with `pad` zero pixels on every side and cut an H x W window at a random offset per sample.

    Equivalent to torchvision's RandomCrop(size=(H, W), padding=pad) applied per image. Offsets are uniform in
    [0, 2*pad] for rows and columns independently. Returns a new tensor of x's shape and dtype.
    """
    if x.dim() != 4:
        raise ValueError(f"x: expected a [B,C,H,W] batch, got shape {tuple(x.shape)}")
    if pad < 0:
        raise ValueError(f"pad: expected >= 0, got {pad}")
    if pad == 0:
        return x.clone()
    b, c, h, w = x.shape
    padded = torch.nn.functional.pad(x, (pad, pad, pad, pad))
    offsets = torch.randint(0, 2 * pad + 1, (2, b), generator=generator).to(x.device)
    rows = offsets[0][:, None] + torch.arange(h, device=x.device)  # [B, H]
    cols = offsets[1][:, None] + torch.arange(w, device=x.device)  # [B, W]
    batch_idx = torch.arange(b, device=x.device)[:, None, None, None]
    chan_idx = torch.arange(c, device=x.device)[None, :, None, None]
    return padded[batch_idx, chan_idx, rows[:, None, :, None], cols[:, None, None, :]]


def random_hflip(x: torch.Tensor, generator: torch.Generator, p: float = 0.5) -> torch.Tensor:
    """Mirror each image left-right with probability p (independently per sample)."""
    if x.dim() != 4:
        raise ValueError(f"x: expected a [B,C,H,W] batch, got shape {tuple(x.shape)}")
    flip = (torch.rand(x.shape[0], generator=generator) < p).to(x.device)
    return torch.where(flip[:, None, None, None], x.flip(3), x)


def augment_batch(x: torch.Tensor, generator: torch.Generator, pad: int = 4) -> torch.Tensor:
    """Random crop (zero padding `pad`; the paper uses 4, docs/method.md#models-and-hyper-parameters) followed by a random horizontal flip."""
    return random_hflip(random_crop(x, pad, generator), generator)
