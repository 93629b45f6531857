"""In-memory dataset containers shared by every reader.

Images are kept as uint8 [N, C, H, W] (1 byte per pixel) so a whole CIFAR-10 training set costs 150 MiB rather than
600 MiB in fp32; the loader converts one batch at a time to normalised float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from peer.errors import PeerError


class DatasetError(PeerError, ValueError):
    """A dataset directory or file is missing or not in the expected format (the message names path and format)."""

    default_reason = "dataset"


@dataclass
class TensorData:
    """One split of a dataset.

    images: uint8 [N, C, H, W], pixel values 0..255 (the loader scales them to 0..1), or float32 [N, C, H, W] taken
        as they are (a plug-in dataset's own tensors: 4x the memory of uint8).
    labels: int64 [N], class ids 0..num_classes-1.
    """

    images: torch.Tensor
    labels: torch.Tensor

    def __post_init__(self) -> None:
        if self.images.dtype not in (torch.uint8, torch.float32) or self.images.dim() != 4:
            raise ValueError(
                f"images: expected uint8 or float32 [N,C,H,W], got {self.images.dtype} {tuple(self.images.shape)}"
            )
        if self.labels.dtype != torch.int64 or self.labels.dim() != 1:
            raise ValueError(f"labels: expected int64 [N], got {self.labels.dtype} {tuple(self.labels.shape)}")
        if self.images.shape[0] != self.labels.shape[0]:
            raise ValueError(
                f"images/labels: {self.images.shape[0]} images but {self.labels.shape[0]} labels"
            )

    def __len__(self) -> int:
        return int(self.labels.shape[0])


@dataclass
class DatasetSplits:
    """Train and test splits plus what a model and a loader need to know about them.

    mean, std: per-channel statistics on the 0..1 pixel scale (uint8 images) or the images' own scale (float32),
        used by the loader to normalise; they travel with an exported model (its card).
    augment: whether random crop + horizontal flip suit this dataset (False for digits, where a flip changes meaning).
    name: what messages call the dataset (``mnist5k``, ``data.py:load``).
    classes: class names where the dataset has them (image folders: the directory names), else empty.
    """

    train: TensorData
    test: TensorData
    num_classes: int
    in_channels: int
    image_size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    augment: bool
    name: str = "dataset"
    classes: tuple[str, ...] = ()

    @property
    def input_shape(self) -> tuple[int, int, int]:
        """One sample's [C, H, W]."""
        c, h, w = self.train.images.shape[1:]
        return int(c), int(h), int(w)
