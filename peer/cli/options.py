"""Flags shared by train, simulate and start: every field of :class:`peer.config.RunSpec`, defaulting to None so a
config file or the environment can supply it (flags win)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from peer.config import ConfigError, RunSpec, load_run_spec

#: (flag, section, field, click type, help)
RUN_FLAGS: list[tuple[str, str, str, Any, str]] = [
    ("--model", "model", "name", str, "Model: mnist-cnn, resnet20, resnet54, vgg11, resnet18 [mnist-cnn]."),
    ("--norm", "model", "norm", click.Choice(["range-evonorm", "evonorm", "batchnorm"]), "Normalisation [range-evonorm]."),
    ("--precision", "model", "precision", click.Choice(["fp32", "sim8", "int8"]), "Training precision [int8]."),
    ("--bits", "model", "bits", int, "sim8 bit width, 2..8 [8]."),
    ("--dataset", "data", "dataset", str, "mnist5k (bundled), cifar10, imagefolder, synthetic [mnist5k]."),
    ("--data-root", "data", "root", str, "Dataset directory (cifar10, imagefolder)."),
    ("--batch-size", "data", "batch_size", int, "Samples per local step [32]."),
    ("--skew", "data", "skew", float, "Non-IID degree of skew in [0, 1] [0]."),
    ("--augment/--no-augment", "data", "augment", None, "Random crop + flip [dataset default]."),
    ("--seed", "data", "seed", int, "Seed shared by all peers [0]."),
    ("--lr", "optim", "lr", float, "Base learning rate [0.05; the paper used 0.1]."),
    ("--epochs", "optim", "epochs", float, "Epochs (of one peer's shard) [10]."),
    ("--momentum", "optim", "momentum", float, "Nesterov momentum [0.9]."),
    ("--weight-decay", "optim", "weight_decay", float, "Weight decay [1e-4]."),
    ("--qgm/--no-qgm", "optim", "qgm", None, "Quasi-global momentum [off]."),
    ("--algorithm", "gossip", "algorithm", click.Choice(["sgp", "deepsqueeze", "choco"]), "Gossip algorithm [choco]."),
    ("--compression", "gossip", "compression", float, "Fraction dropped by top-k, 0.99 keeps 1% [0.99]."),
    ("--comm-bits", "gossip", "bits", int, "Bits per sent value, 2..8 or 32 [8]."),
    ("--rounding", "gossip", "rounding", click.Choice(["nearest", "stochastic"]), "Rounding of sent values [nearest]."),
    ("--gamma", "gossip", "gamma", float, "Consensus step size [min(1, 2*(1-compression))]."),
    ("--topology", "gossip", "topology", click.Choice(["ring", "undirected-ring", "torus", "exponential", "random"]),
     "Topology [ring]."),
    ("--rotating/--static", "gossip", "rotating", None, "Rotate the graph every round [static]."),
    ("--out-degree", "gossip", "k", int, "Out-degree of the random topology [2]."),
    ("--local-steps", "gossip", "local_steps", int, "Local steps between gossip rounds [1]."),
]


def _param_name(flag: str) -> str:
    return flag.split("/")[0].lstrip("-").replace("-", "_")


def run_spec_options(func: Callable) -> Callable:
    """Add every RunSpec flag plus --config to a click command."""
    for flag, _, _, kind, help_text in reversed(RUN_FLAGS):
        if kind is None:
            func = click.option(flag, default=None, help=help_text)(func)
        else:
            func = click.option(flag, type=kind, default=None, help=help_text)(func)
    return click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
                        help="TOML config file ([model], [data], [optim], [gossip] tables).")(func)


def pop_run_spec(kwargs: dict[str, Any], defaults: dict[str, dict[str, Any]] | None = None) -> RunSpec:
    """Remove the RunSpec flags from ``kwargs`` and build the spec; config errors become click usage errors.

    Precedence, lowest first: ``defaults`` (the command's own), config file, environment, flags.
    """
    flags: dict[str, dict[str, Any]] = {}
    for flag, section, field_name, _, _ in RUN_FLAGS:
        value = kwargs.pop(_param_name(flag))
        if value is not None:
            flags.setdefault(section, {})[field_name] = value
    try:
        return load_run_spec(kwargs.pop("config_path"), flags=flags, defaults=defaults)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
