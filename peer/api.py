"""The Python API for researchers: a simulation or a single training from a model factory and datasets in code.

The same runtime as the CLI, no second code path: a :class:`peer.config.RunSpec` is built from the keyword
arguments (validated field by field, errors name the field), the datasets go through the plug-in reader
(peer/data/plugin.py) and the model through the converter (peer/lowp/convert.py), then
:class:`peer.sim.simulation.Simulation` or :func:`peer.train.run_training` runs exactly as ``lpdl-peer simulate`` /
``lpdl-peer train`` would. Example::

    from peer.api import simulate
    rows = simulate(model=lambda num_classes: MyNet(num_classes), train_set=train, test_set=test,
                    peers=16, algorithm="choco", compression=0.99, epochs=5)
    print(rows[-1]["avg_model_acc"], rows[-1]["mean_peer_acc"])

``model`` is a callable returning an ``nn.Module`` (called with ``num_classes`` / ``in_channels`` where it accepts
them) or any ``--model`` text (``"mnist-cnn"``, ``"torchvision:resnet18"``, ``"nets.py:Net"``). The data is either
``dataset=`` a ``--dataset`` name, or ``train_set`` and ``test_set``: map-style torch Datasets of (image, label)
items or ``(images, labels)`` tensor pairs, with ``classes``, ``mean`` and ``std`` optional. Any other keyword is a
RunSpec field by its name in the TOML tables (``lr``, ``skew``, ``topology``, ``batch_size``, ``gamma``, ``root``,
...); ``bits`` is the model's sim8 bit width and ``comm_bits`` the bits per sent value, as on the command line.
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from torch import nn

from peer.config import RUN_SECTIONS, ConfigError, RunSpec, load_run_spec
from peer.data import DatasetSplits
from peer.data.plugin import splits_from
from peer.models.kinds import parse_options
from peer.models.source import ModelSource
from peer.runtime.build import load_splits

ModelArg = str | Callable[..., nn.Module]


def simulate(model: ModelArg, train_set: Any = None, test_set: Any = None, *, peers: int = 8,
             dataset: str | None = None, classes: Sequence[str] = (), mean: Sequence[float] | None = None,
             std: Sequence[float] | None = None, drop: float = 0.0, delay: int = 0, churn: float = 0.0,
             device: str = "cpu", **fields: Any) -> list[dict[str, float | str]]:
    """Simulate ``peers`` peers (the daemon's round over the in-memory transport) and return one record per epoch:
    epoch, round, avg_model_acc and mean_peer_acc (in [0, 1]), train_loss, bytes_per_peer, consensus_distance,
    wall_s, recoveries, phase ("consensus" for the row after the final consensus phase), consensus_rounds,
    consensus_bytes_per_peer. ``drop`` / ``delay`` / ``churn`` inject transport faults (peer/sim/transport.py)."""
    from peer.sim.simulation import Simulation
    from peer.sim.transport import ChaosSpec

    spec, source = _spec_and_source(model, dataset, fields)
    splits = _splits(spec, train_set, test_set, classes, mean, std)
    sim = Simulation(spec, splits, peers, chaos=ChaosSpec(drop=drop, delay=delay, churn=churn), device=device,
                     source=source)
    return [row.as_dict() for row in sim.run(spec.optim.epochs)]


def train(model: ModelArg, train_set: Any = None, test_set: Any = None, *, dataset: str | None = None,
          classes: Sequence[str] = (), mean: Sequence[float] | None = None, std: Sequence[float] | None = None,
          out_dir: str | Path | None = None, max_steps: int | None = None, device: str = "cpu",
          **fields: Any) -> list[dict[str, Any]]:
    """Train one model on the whole training set (the centralised baseline) and return one record per epoch:
    epoch, step, lr, train_loss, test_loss, test_acc. ``out_dir`` keeps metrics.json and checkpoint.pt (a
    temporary directory, removed at the end, where None)."""
    from peer.train import run_training

    spec, source = _spec_and_source(model, dataset, fields)
    splits = _splits(spec, train_set, test_set, classes, mean, std)
    if out_dir is not None:
        return run_training(spec, device, Path(out_dir), max_steps, splits, source)["epochs"]
    with tempfile.TemporaryDirectory(prefix="lpdl-train-") as tmp:
        return run_training(spec, device, Path(tmp), max_steps, splits, source)["epochs"]


def _spec_and_source(model: ModelArg, dataset: str | None, fields: dict[str, Any]) -> tuple[RunSpec,
                                                                                           ModelSource | None]:
    """The RunSpec the keywords describe (each placed in its section by field name) and, for a callable model,
    its source."""
    sections: dict[str, dict[str, Any]] = {}
    owners: dict[str, tuple[str, str]] = {"comm_bits": ("gossip", "bits")}  # as the CLI's --comm-bits
    for section, cls in RUN_SECTIONS.items():  # model first: ``bits`` is the model's (sim8) bit width
        for f in dataclasses.fields(cls):
            owners.setdefault(f.name, (section, f.name))
    allowed = set(owners) - {"name", "dataset"}  # the model and dataset arguments give those
    for key, value in fields.items():
        if key not in allowed:
            raise ConfigError(f"{key}: not a run setting; known: {', '.join(sorted(allowed))}")
        section, field = owners[key]
        sections.setdefault(section, {})[field] = value
    model_fields = sections.setdefault("model", {})
    model_fields["name"] = model if isinstance(model, str) else ModelSource.from_callable(model).ref
    if dataset is not None:
        sections.setdefault("data", {})["dataset"] = dataset
    spec = load_run_spec(flags=sections, environ={})
    if isinstance(model, str):
        return spec, None
    return spec, ModelSource.from_callable(model, parse_options(spec.model.options), spec.model.weights)


def _splits(spec: RunSpec, train_set: Any, test_set: Any, classes: Sequence[str],
            mean: Sequence[float] | None, std: Sequence[float] | None) -> DatasetSplits:
    if train_set is None and test_set is None:
        return load_splits(spec.data)
    if train_set is None or test_set is None:
        raise ValueError("train_set and test_set: give both, or dataset= a dataset name")
    given: dict[str, Any] = {"train": train_set, "test": test_set, "classes": list(classes)}
    given.update({k: v for k, v in (("mean", mean), ("std", std)) if v is not None})
    return splits_from(given, "python")
