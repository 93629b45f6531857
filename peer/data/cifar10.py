"""Reader for the CIFAR-10 "python version" directory (cifar-10-batches-py), needing only numpy + torch.

Expected layout: data_batch_1 .. data_batch_5 and test_batch, each a pickled dict with "data" (uint8 [n, 3072],
rows are R, G, B planes of a 32x32 image) and "labels" (n ints in 0..9). batches.meta (class names) is not needed.
The pickles are read with an unpickler that only admits numpy array reconstruction, so a tampered file cannot run
code inside the daemon.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np
import torch

from peer.data.tensors import DatasetError, DatasetSplits, TensorData

TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_FILE = "test_batch"
MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)
_PIXELS = 3 * 32 * 32

_ALLOWED_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"),
    ("numpy.core.numeric", "_frombuffer"),  # pickle protocol 5
    ("numpy._core.numeric", "_frombuffer"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("_codecs", "encode"),  # bytes written by Python 3 with protocol <= 2
}


class _ArrayOnlyUnpickler(pickle.Unpickler):
    """Unpickler that refuses every global except what numpy needs to rebuild an array."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED_GLOBALS:
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in a CIFAR-10 batch")
        return super().find_class(module, name)


def _read_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Return (images uint8 [n,3,32,32], labels int64 [n]) from one batch file, or raise DatasetError naming it."""
    expected = 'a pickled dict with "data" (uint8 [n, 3072]) and "labels" (n ints in 0..9)'
    if not path.is_file():
        raise DatasetError(f"CIFAR-10: missing file {path}; expected {expected}")
    try:
        with path.open("rb") as f:
            batch = _ArrayOnlyUnpickler(f, encoding="bytes").load()
    except Exception as exc:  # any unpickling failure means the same thing to the operator: not a CIFAR batch
        raise DatasetError(f"CIFAR-10: cannot read {path} ({exc}); expected {expected}") from exc
    if not isinstance(batch, dict):
        raise DatasetError(f"CIFAR-10: {path} holds a {type(batch).__name__}; expected {expected}")
    entries = {k.decode() if isinstance(k, bytes) else k: v for k, v in batch.items()}
    if "data" not in entries or "labels" not in entries:
        raise DatasetError(f"CIFAR-10: {path} has keys {sorted(map(str, entries))}; expected {expected}")
    data = np.asarray(entries["data"])
    labels = np.asarray(entries["labels"])
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != _PIXELS:
        raise DatasetError(f"CIFAR-10: {path} data is {data.dtype} {data.shape}; expected {expected}")
    if labels.shape != (data.shape[0],) or not np.issubdtype(labels.dtype, np.integer):
        raise DatasetError(f"CIFAR-10: {path} labels are {labels.dtype} {labels.shape}; expected {expected}")
    if labels.size and (labels.min() < 0 or labels.max() > 9):
        raise DatasetError(f"CIFAR-10: {path} labels span {labels.min()}..{labels.max()}; expected {expected}")
    return data.reshape(-1, 3, 32, 32), labels.astype(np.int64)


def _read_split(root: Path, names: tuple[str, ...]) -> TensorData:
    parts = [_read_batch(root / name) for name in names]
    images = np.concatenate([p[0] for p in parts])
    labels = np.concatenate([p[1] for p in parts])
    return TensorData(torch.from_numpy(images), torch.from_numpy(labels))


def load_cifar10(root: str | Path) -> DatasetSplits:
    """Load CIFAR-10 from its python-format directory `root` (50,000 train / 10,000 test images at 32x32x3)."""
    root = Path(root).expanduser()
    if not root.is_dir():
        raise DatasetError(
            f"CIFAR-10: {root} is not a directory; expected the extracted cifar-10-batches-py directory with "
            f"{', '.join(TRAIN_FILES)} and {TEST_FILE}"
        )
    return DatasetSplits(
        train=_read_split(root, TRAIN_FILES),
        test=_read_split(root, (TEST_FILE,)),
        num_classes=10,
        in_channels=3,
        image_size=32,
        mean=MEAN,
        std=STD,
        augment=True,
    )
