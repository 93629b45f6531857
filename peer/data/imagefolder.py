"""Reader for Imagenette-style image folders: root/train/<class>/*.JPEG and root/val/<class>/*.JPEG.

Every image is decoded once at load time, its shorter side resized to `image_size` and the centre cut square, and
kept as uint8 [N, 3, S, S]: training then never touches the disk or a decoder. Class ids follow the sorted class
directory names of train/. Decoding needs Pillow (the `vision` extra); the daemon's core install stays without it.
An optional cache file (torch.save of the decoded tensors) skips decoding on the next start.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from peer.data.tensors import DatasetError, DatasetSplits, TensorData

IMAGE_SUFFIXES = (".jpeg", ".jpg", ".png")
MEAN = (0.485, 0.456, 0.406)  # ImageNet statistics, the usual choice for Imagenette
STD = (0.229, 0.224, 0.225)
_LAYOUT = "root/train/<class>/*.JPEG|*.jpg|*.png and root/val/<class>/... with the same class directories"


def _decoder() -> Callable[[Path], torch.Tensor]:
    """Return a function decoding an image file to uint8 [3, H, W] RGB, or explain how to get a decoder.

    Pillow is used directly (it comes with torchvision, the `vision` extra); torchvision.io's decoders are deprecated
    since torchvision 0.29.
    """
    try:
        from PIL import Image
    except ImportError as exc:
        raise DatasetError(
            "image folders need Pillow to decode JPEG/PNG: install the `vision` extra (pip install 'lpdl-peer[vision]')"
        ) from exc

    def decode(path: Path) -> torch.Tensor:
        with Image.open(path) as image:
            pixels = np.asarray(image.convert("RGB"), dtype=np.uint8)
        return torch.from_numpy(pixels.copy()).permute(2, 0, 1)

    return decode


def _resize_center(image: torch.Tensor, size: int) -> torch.Tensor:
    """Resize uint8 [3, H, W] so the shorter side is `size` (bilinear, antialiased), then cut the centre square."""
    _, h, w = image.shape
    scale = size / min(h, w)
    new_h, new_w = max(size, round(h * scale)), max(size, round(w * scale))
    resized = F.interpolate(image[None].float(), size=(new_h, new_w), mode="bilinear", antialias=True,
                            align_corners=False)[0]
    top, left = (new_h - size) // 2, (new_w - size) // 2
    return resized[:, top : top + size, left : left + size].round_().clamp_(0, 255).to(torch.uint8)


def _class_dirs(split_dir: Path) -> list[str]:
    if not split_dir.is_dir():
        raise DatasetError(f"image folder: missing directory {split_dir}; expected {_LAYOUT}")
    classes = sorted(p.name for p in split_dir.iterdir() if p.is_dir())
    if not classes:
        raise DatasetError(f"image folder: {split_dir} has no class directories; expected {_LAYOUT}")
    return classes


def _read_split(split_dir: Path, classes: list[str], size: int) -> TensorData:
    decode = _decoder()
    images: list[torch.Tensor] = []
    labels: list[int] = []
    for label, name in enumerate(classes):
        files = sorted(p for p in (split_dir / name).iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
        for path in files:
            try:
                images.append(_resize_center(decode(path), size))
            except Exception as exc:  # a corrupt image names itself rather than failing somewhere in torchvision
                raise DatasetError(f"image folder: cannot decode {path} ({exc})") from exc
            labels.append(label)
    if not images:
        raise DatasetError(f"image folder: no {'/'.join(IMAGE_SUFFIXES)} files under {split_dir}; expected {_LAYOUT}")
    return TensorData(torch.stack(images), torch.tensor(labels, dtype=torch.int64))


def load_imagefolder(root: str | Path, image_size: int = 64, cache: str | Path | None = None) -> DatasetSplits:
    """Load root/train and root/val as 3-channel uint8 images of image_size x image_size pixels.

    cache: optional file; when it exists and was written for the same root and image_size it is loaded instead of
    decoding, otherwise it is (re)written after decoding.
    """
    root = Path(root).expanduser()
    if image_size < 1:
        raise ValueError(f"image_size: expected >= 1, got {image_size}")
    if not root.is_dir():
        raise DatasetError(f"image folder: {root} is not a directory; expected {_LAYOUT}")
    key = {"root": str(root.resolve()), "image_size": image_size}
    cache_path = Path(cache).expanduser() if cache is not None else None
    if cache_path is not None and cache_path.is_file():
        saved = torch.load(cache_path, weights_only=True)
        if saved.get("key") == key and "classes" in saved:
            return _splits(TensorData(*saved["train"]), TensorData(*saved["val"]), saved["classes"], image_size)
    classes = _class_dirs(root / "train")
    val_classes = _class_dirs(root / "val")
    if val_classes != classes:
        raise DatasetError(
            f"image folder: {root / 'val'} classes {val_classes} differ from {root / 'train'} classes {classes}"
        )
    train = _read_split(root / "train", classes, image_size)
    val = _read_split(root / "val", classes, image_size)
    if cache_path is not None:
        torch.save({"key": key, "classes": classes, "train": (train.images, train.labels),
                    "val": (val.images, val.labels)}, cache_path)
    return _splits(train, val, classes, image_size)


def _splits(train: TensorData, test: TensorData, classes: list[str], image_size: int) -> DatasetSplits:
    return DatasetSplits(train=train, test=test, num_classes=len(classes), in_channels=3, image_size=image_size,
                         mean=MEAN, std=STD, augment=True, name="imagefolder", classes=tuple(classes))
