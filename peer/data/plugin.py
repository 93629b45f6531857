"""A user's own dataset: ``--dataset MODULE:CALLABLE`` or ``--dataset path/to/file.py:CALLABLE``.

The callable (called with ``root=`` the ``--data-root`` where it accepts it) returns the train and test splits, as

* a pair ``(train, test)``, or
* a dict with ``train`` and ``test`` and optionally ``classes`` (names), ``mean`` and ``std`` (per channel),

where each split is a map-style torch Dataset of ``(image, label)`` items (image a [C, H, W] or [H, W] tensor or
array, or a PIL image; label an integer) or a pair of tensors ``(images [N, C, H, W], labels [N])``.

Images are held in memory like the built-in readers': uint8 pixels stay 1 byte each (the loader scales them to 0..1),
float images are kept as float32. Normalisation travels with the model (an exported model's card), so it must be
the same on every device - never computed from one device's private data: ``mean``/``std`` as the dataset states
them, else 0.5 / 0.5 per channel for uint8 pixels (to [-1, 1]) and none (0 / 1) for float images.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from peer.data.tensors import DatasetError, DatasetSplits, TensorData
from peer.plugins import PluginError, accepted_kwargs, import_callable

_FORM = "(train, test) or {'train': ..., 'test': ...[, 'classes', 'mean', 'std']}"


def is_plugin(name: str) -> bool:
    """True for a ``MODULE:CALLABLE`` / ``file.py:CALLABLE`` dataset (built-in names have no colon)."""
    return ":" in name


def load_plugin(ref: str, root: str | None = None) -> DatasetSplits:
    """Call the dataset callable ``ref`` names and hold its splits in memory (see module doc)."""
    target, _, attr = ref.rpartition(":")
    try:
        loader = import_callable(target, attr, f"dataset {ref}")
    except PluginError as exc:
        raise DatasetError(str(exc)) from None
    kwargs = accepted_kwargs(loader, {"root": root}) if root is not None else {}
    try:
        result = loader(**kwargs)
    except Exception as exc:  # the user's code: report it by name, one line
        raise DatasetError(f"dataset {ref}: calling it failed: {type(exc).__name__}: {exc}") from None
    return splits_from(result, ref)


def splits_from(result: Any, ref: str) -> DatasetSplits:
    """Splits held in memory from what a dataset callable returned (the module doc's forms); ``ref`` names the
    dataset in messages. The Python API passes its train and test sets through here too."""
    if isinstance(result, dict):
        missing = {"train", "test"} - set(result)
        if missing:
            raise DatasetError(f"dataset {ref}: the dict lacks {', '.join(sorted(missing))}; expected {_FORM}")
        train_split, test_split = result["train"], result["test"]
    elif isinstance(result, (tuple, list)) and len(result) == 2:
        train_split, test_split, result = result[0], result[1], {}
    else:
        raise DatasetError(f"dataset {ref}: returned {type(result).__name__}; expected {_FORM}")
    train, test = _tensors(train_split, f"{ref} train"), _tensors(test_split, f"{ref} test")
    if train.images.shape[1:] != test.images.shape[1:] or train.images.dtype != test.images.dtype:
        raise DatasetError(f"dataset {ref}: train images {train.images.dtype} {tuple(train.images.shape[1:])} but "
                           f"test images {test.images.dtype} {tuple(test.images.shape[1:])}")
    classes = tuple(str(c) for c in result.get("classes", ()))
    top_label = int(max(train.labels.max(), test.labels.max()))
    num_classes = len(classes) or top_label + 1
    if top_label >= num_classes:
        raise DatasetError(f"dataset {ref}: labels go up to {top_label} but {num_classes} classes are named")
    channels, height, width = train.images.shape[1:]
    pixels = train.images.dtype == torch.uint8
    mean = _per_channel(result.get("mean", 0.5 if pixels else 0.0), channels, f"{ref} mean")
    std = _per_channel(result.get("std", 0.5 if pixels else 1.0), channels, f"{ref} std")
    if any(s <= 0 for s in std):
        raise DatasetError(f"dataset {ref}: std must be > 0 per channel, got {std}")
    return DatasetSplits(train=train, test=test, num_classes=num_classes, in_channels=int(channels),
                         image_size=int(height), mean=mean, std=std, augment=False, name=ref, classes=classes)


def _tensors(split: Any, what: str) -> TensorData:
    """One split as TensorData: from a pair of tensors, or by reading every item of a map-style Dataset once."""
    if isinstance(split, (tuple, list)) and len(split) == 2 and isinstance(split[0], torch.Tensor):
        images, labels = split
    else:
        if not hasattr(split, "__len__") or not hasattr(split, "__getitem__"):
            raise DatasetError(f"dataset {what}: expected a map-style Dataset or (images, labels) tensors, got "
                               f"{type(split).__name__}")
        if len(split) == 0:
            raise DatasetError(f"dataset {what}: the split is empty")
        items = [split[i] for i in range(len(split))]
        images = torch.stack([_image(item[0], what) for item in items])
        labels = torch.tensor([_label(item[1], what) for item in items], dtype=torch.int64)
    images = torch.as_tensor(images)
    if images.dim() == 3:
        images = images.unsqueeze(1)  # [N, H, W] greyscale
    if images.dim() != 4 or images.shape[0] == 0:
        raise DatasetError(f"dataset {what}: expected images [N, C, H, W] or [N, H, W], got {tuple(images.shape)}")
    if images.dtype != torch.uint8:
        if not images.is_floating_point():
            raise DatasetError(f"dataset {what}: images must be uint8 pixels or floats, got {images.dtype}")
        images = images.float()
    labels = torch.as_tensor(labels)
    if labels.is_floating_point() or labels.is_complex() or labels.dim() != 1:
        raise DatasetError(f"dataset {what}: labels must be integers [N], got {labels.dtype} {tuple(labels.shape)}")
    labels = labels.to(torch.int64)
    if labels.numel() != images.shape[0]:
        raise DatasetError(f"dataset {what}: {images.shape[0]} images but {labels.numel()} labels")
    if int(labels.min()) < 0:
        raise DatasetError(f"dataset {what}: labels must be >= 0, got {int(labels.min())}")
    return TensorData(images.contiguous(), labels)


def _image(image: Any, what: str) -> torch.Tensor:
    if not isinstance(image, torch.Tensor):
        array = np.asarray(image)
        if array.ndim == 3 and array.shape[-1] in (1, 3, 4) and array.shape[0] not in (1, 3, 4):
            array = array.transpose(2, 0, 1)  # a PIL / HWC image
        image = torch.from_numpy(np.ascontiguousarray(array))
    if image.dim() == 2:
        image = image.unsqueeze(0)
    if image.dim() != 3:
        raise DatasetError(f"dataset {what}: expected each image [C, H, W] or [H, W], got {tuple(image.shape)}")
    return image


def _label(label: Any, what: str) -> int:
    try:
        value = int(label)
    except (TypeError, ValueError):
        raise DatasetError(f"dataset {what}: labels must be integers, got {label!r}") from None
    if value != label:
        raise DatasetError(f"dataset {what}: labels must be integers, got {label!r}")
    return value


def _per_channel(value: Any, channels: int, what: str) -> tuple[float, ...]:
    values = [float(value)] * channels if isinstance(value, (int, float, np.number)) else [float(v) for v in value]
    if len(values) != channels:
        raise DatasetError(f"dataset {what}: expected {channels} values (one per channel), got {len(values)}")
    return tuple(values)
