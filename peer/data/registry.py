"""Datasets by name, so config files and the CLI can say `dataset: cifar10` and a root directory."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from peer.data.cifar10 import load_cifar10
from peer.data.imagefolder import load_imagefolder
from peer.data.mnist5k import load_mnist5k
from peer.data.plugin import is_plugin, load_plugin
from peer.data.synthetic import load_synthetic
from peer.data.tensors import DatasetSplits


def _needs_root(name: str, loader: Callable[..., DatasetSplits]) -> Callable[..., DatasetSplits]:
    def load(root: str | None, **opts: Any) -> DatasetSplits:
        if root is None:
            raise ValueError(f"root: dataset {name!r} needs a root directory")
        return loader(root, **opts)

    return load


def _no_root(loader: Callable[..., DatasetSplits]) -> Callable[..., DatasetSplits]:
    def load(root: str | None, **opts: Any) -> DatasetSplits:
        return loader(**opts)

    return load


DATASETS: dict[str, Callable[..., DatasetSplits]] = {
    "mnist5k": _no_root(load_mnist5k),  # bundled with the `demo` extra; root ignored
    "cifar10": _needs_root("cifar10", load_cifar10),  # root = cifar-10-batches-py directory
    "imagefolder": _needs_root("imagefolder", load_imagefolder),  # root with train/ and val/; opts image_size, cache
    "synthetic": _no_root(load_synthetic),  # generated, for tests and benchmarks; root ignored
}


def load_dataset(name: str, root: str | None = None, **opts: Any) -> DatasetSplits:
    """Load dataset `name` (one of DATASETS, or a plug-in ``MODULE:CALLABLE`` / ``file.py:CALLABLE``, see
    peer/data/plugin.py) from `root`, passing `opts` to a built-in reader."""
    if is_plugin(name):
        return load_plugin(name, root)
    try:
        load = DATASETS[name]
    except KeyError:
        raise ValueError(f"dataset: unknown name {name!r}; expected one of {', '.join(DATASETS)}, "
                         f"MODULE:CALLABLE or path/to/file.py:CALLABLE") from None
    return dataclasses.replace(load(root, **opts), name=name)
