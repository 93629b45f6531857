"""Flags for config fields: every field of :class:`peer.config.RunSpec` (train, simulate, start, fleet) and the
machinery start uses for its [node] flags.

The flags default to None so a config file or the environment can supply a value (flags win); the help shows the
default that applies when nothing does, read from the spec dataclass or the command's own defaults (``fleet``:
4 epochs), never typed here. Choices come from the enumerations of the domain modules.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import click

from peer.compress.kinds import ROUNDINGS
from peer.config import DEFAULT_GAMMA_RULE, ConfigError, RunSpec, load_run_spec
from peer.daemon.config import DAEMON_SECTIONS, DaemonConfig, load_daemon_config
from peer.gossip.kinds import ALGORITHMS, TOPOLOGIES
from peer.gossip.ledger import MAX_WINDOW
from peer.lowp.kinds import NORM_KINDS, PRECISION_MODES
from peer.models.kinds import KEEP_NORM

#: Per-command defaults below the config file: {section: {field: value}}.
Defaults = dict[str, dict[str, Any]]


@dataclass(frozen=True)
class SpecFlag:
    """One config field as a flag.

    Attributes:
        flag: the option ("--epochs"), or "--on/--off" for a boolean.
        section: config section (model, data, optim, gossip, node).
        field: field of that section.
        kind: click type; None for a boolean on/off pair.
        help: what the flag sets, with units.
        unset: what applies when the field's default is None or empty (shown as the default; "" = nothing shown).
    """

    flag: str
    section: str
    field: str
    kind: Any
    help: str
    unset: str = ""

    @property
    def param(self) -> str:
        """The click parameter name of the flag."""
        return self.flag.split("/")[0].lstrip("-").replace("-", "_")

    def default_text(self, defaults: Defaults | None = None) -> str:
        """The default as the help shows it: the command's own, else the spec's; a boolean by its flag."""
        value = (defaults or {}).get(self.section, {}).get(self.field, _spec_default(self.section, self.field))
        if value is None or value in ("", ()):
            return self.unset
        if isinstance(value, bool):
            on, _, off = self.flag.partition("/")
            return on if value else off
        if isinstance(value, tuple):
            return ",".join(value)
        return f"{value:g}" if isinstance(value, float) else str(value)


def _spec_default(section: str, field_name: str) -> Any:
    spec_field = next(f for f in dataclasses.fields(DAEMON_SECTIONS[section]) if f.name == field_name)
    return spec_field.default


RUN_FLAGS: list[SpecFlag] = [
    SpecFlag("--model", "model", "name", str, "Model: mnist-cnn, resnet20, resnet54, vgg11, resnet18, or your own: "
             "torchvision:NAME, MODULE:CALLABLE or path/to/file.py:CALLABLE (converted for the precision)."),
    SpecFlag("--model-options", "model", "options", str, "KEY=VALUE,... keyword options for your model's builder "
             "(torchvision:mobilenet_v3_small: width_mult=0.75)."),
    SpecFlag("--model-weights", "model", "weights", click.Path(dir_okay=False),
             "State dict (safetensors or torch file) your model starts from; entries of another shape are skipped."),
    SpecFlag("--norm", "model", "norm", click.Choice((*NORM_KINDS, KEEP_NORM)),
             "Normalisation-activation layers; 'keep' keeps your own model's BatchNorm (fp32)."),
    SpecFlag("--precision", "model", "precision", click.Choice(PRECISION_MODES), "Training precision."),
    SpecFlag("--bits", "model", "bits", int, "sim8 bit width, 2..8."),
    SpecFlag("--dataset", "data", "dataset", str, "mnist5k (bundled), cifar10, imagefolder, synthetic, or your own: "
             "MODULE:CALLABLE or path/to/file.py:CALLABLE returning (train, test)."),
    SpecFlag("--data-root", "data", "root", str, "Dataset directory (cifar10, imagefolder; passed to your dataset "
             "callable as root=)."),
    SpecFlag("--image-size", "data", "image_size", int, "Side in pixels image folders are resized to.", "64"),
    SpecFlag("--batch-size", "data", "batch_size", int, "Samples per local step."),
    SpecFlag("--skew", "data", "skew", float, "Non-IID degree of skew in [0, 1]."),
    SpecFlag("--augment/--no-augment", "data", "augment", None, "Random crop + flip.", "dataset default"),
    SpecFlag("--seed", "data", "seed", int, "Seed shared by all peers."),
    SpecFlag("--lr", "optim", "lr", float, "Base learning rate (the paper used 0.1)."),
    SpecFlag("--epochs", "optim", "epochs", float, "Epochs of one peer's shard."),
    SpecFlag("--warmup-epochs", "optim", "warmup_epochs", float, "Epochs at 0.1 x lr at the start."),
    SpecFlag("--momentum", "optim", "momentum", float, "Nesterov momentum."),
    SpecFlag("--weight-decay", "optim", "weight_decay", float, "Weight decay."),
    SpecFlag("--qgm/--no-qgm", "optim", "qgm", None, "Quasi-global momentum."),
    SpecFlag("--algorithm", "gossip", "algorithm", click.Choice(ALGORITHMS), "Gossip algorithm."),
    SpecFlag("--compression", "gossip", "compression", float, "Fraction dropped by top-k, 0.99 keeps 1%."),
    SpecFlag("--comm-bits", "gossip", "bits", int, "Bits per sent value, 2..8 or 32."),
    SpecFlag("--rounding", "gossip", "rounding", click.Choice(ROUNDINGS), "Rounding of sent values."),
    SpecFlag("--gamma", "gossip", "gamma", float, "Consensus step size.", DEFAULT_GAMMA_RULE),
    SpecFlag("--topology", "gossip", "topology", click.Choice(TOPOLOGIES), "Topology."),
    SpecFlag("--rotating/--static", "gossip", "rotating", None, "Rotate the graph every round."),
    SpecFlag("--out-degree", "gossip", "k", int, "Out-degree of the random topology."),
    SpecFlag("--local-steps", "gossip", "local_steps", int, "Local steps between gossip rounds."),
    SpecFlag("--window", "gossip", "window", click.IntRange(1, MAX_WINDOW),
            "Updates in flight per directed edge, not yet settled (the exactly-once window)."),
    SpecFlag("--window-mib", "gossip", "window_mib", click.FloatRange(min=0, min_open=True),
             "MiB of update payloads in flight per directed edge at most (one update always goes)."),
    SpecFlag("--consensus-rounds", "gossip", "consensus_rounds", click.IntRange(min=0),
             "Rounds of gossip without training at most when training ends, until the neighbours heard from "
             "since the last round are within --consensus-tolerance of the peer's own model; 0 = none."),
    SpecFlag("--consensus-tolerance", "gossip", "consensus_tolerance", click.FloatRange(min=0, min_open=True),
             "Relative distance ||z_j - z_i|| / ||z_i|| that ends the consensus phase."),
    SpecFlag("--consensus-every", "gossip", "consensus_every", click.FloatRange(min=0),
             "Also run a consensus phase every this many epochs (0 = only when training ends)."),
]


def spec_options(flags: list[SpecFlag], defaults: Defaults | None = None) -> Callable[[Callable], Callable]:
    """Decorator adding ``flags`` to a click command, each defaulting to None, its help showing ``defaults``."""

    def decorate(func: Callable) -> Callable:
        for f in reversed(flags):
            shown = f.default_text(defaults)  # in click's own style; the real default is None (file, env may set it)
            help_text = f"{f.help}  [default: {shown}]" if shown else f.help
            if f.kind is None:
                func = click.option(f.flag, default=None, help=help_text)(func)
            else:
                func = click.option(f.flag, type=f.kind, default=None, help=help_text)(func)
        return func

    return decorate


def pop_flags(kwargs: dict[str, Any], flags: list[SpecFlag]) -> Defaults:
    """Remove ``flags`` from click's ``kwargs``: {section: {field: value}} of those given on the command line."""
    given: Defaults = {}
    for f in flags:
        value = kwargs.pop(f.param)
        if value is not None:
            given.setdefault(f.section, {})[f.field] = value
    return given


def run_spec_options(defaults: Defaults | None = None) -> Callable[[Callable], Callable]:
    """Decorator adding every RunSpec flag plus --config to a click command.

    ``defaults`` are the command's own defaults (the same mapping it passes to :func:`pop_run_spec`); the help
    shows them.
    """

    def decorate(func: Callable) -> Callable:
        func = spec_options(RUN_FLAGS, defaults)(func)
        return click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
                            help="TOML config file ([model], [data], [optim], [gossip] tables; start and "
                                 "fleet also read [node] and [net]).")(func)

    return decorate


def pop_run_spec(kwargs: dict[str, Any], defaults: Defaults | None = None) -> RunSpec:
    """Remove the RunSpec flags from ``kwargs`` and build the spec; config errors become click usage errors.

    Precedence, lowest first: ``defaults`` (the command's own), config file, environment, flags.
    """
    flags = pop_flags(kwargs, RUN_FLAGS)
    try:
        return load_run_spec(kwargs.pop("config_path"), flags=flags, defaults=defaults)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None


def pop_daemon_config(kwargs: dict[str, Any], flags: list[SpecFlag], defaults: Defaults | None = None) -> DaemonConfig:
    """Remove --config and ``flags`` from click's ``kwargs`` and load a daemon's whole config once (the run, [node]
    and [net]); config errors become click usage errors.

    Precedence, lowest first: ``defaults`` (the command's own), config file, environment, flags.
    """
    given = pop_flags(kwargs, flags)
    try:
        return load_daemon_config(kwargs.pop("config_path"), given, defaults=defaults)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
