"""Write the bundled MNIST digits as per-device image folders (``DEVICE/train/<digit>/*.png``, ``DEVICE/val/...``).

Stands in for a device's own camera images: each device's folder holds a different slice of the training digits
(no image on two devices) and the same validation digits, so devices' accuracies compare. Needs the `demo` extra
(the digits) and Pillow (the `vision` extra).

    python examples/digit_folders.py OUT_DIR --devices 3
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from PIL import Image

from peer.data import load_dataset


def write_digit_folders(out: Path, devices: int, per_device: int | None = None, val: int = 500) -> list[Path]:
    """One image folder per device under ``out`` (``device0`` ...); returns their paths."""
    splits = load_dataset("mnist5k")
    order = np.random.default_rng(0).permutation(len(splits.train))
    shares = np.array_split(order, devices)
    val_rows = np.random.default_rng(1).permutation(len(splits.test))[:val]
    roots = []
    for device, rows in enumerate(shares):
        root = out / f"device{device}"
        for split, data, picked in (("train", splits.train, rows[:per_device]), ("val", splits.test, val_rows)):
            for row in picked:
                label = int(data.labels[row])
                folder = root / split / str(label)
                folder.mkdir(parents=True, exist_ok=True)
                Image.fromarray(data.images[row, 0].numpy()).save(folder / f"{row:05d}.png")
        roots.append(root)
    return roots


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--devices", type=int, default=3)
    parser.add_argument("--per-device", type=int, default=None, help="training images per device (default: all)")
    args = parser.parse_args()
    for root in write_digit_folders(args.out, args.devices, args.per_device):
        print(root)


if __name__ == "__main__":
    main()
