"""One typed configuration for training, simulation and the daemon: TOML file + environment + flags.

Every section is a frozen dataclass whose fields are validated on construction; a bad value raises
:class:`ConfigError` naming the dotted field (``gossip.compression``), the value and what is allowed. The same
objects are built from a TOML file (``[model]``, ``[data]``, ``[optim]``, ``[gossip]`` tables), from
``LPDL_<SECTION>_<FIELD>`` environment variables and from CLI flags, in that order of precedence (flags win), and
written back as TOML (:func:`toml_text`). The daemon's own tables (``[node]``, ``[net]``) and the one object it loads
live with the daemon and the transport (peer/daemon/config.py, peer/net/config.py), which stand on this floor.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from peer.compress.kinds import ROUNDINGS
from peer.errors import PeerError
from peer.gossip.kinds import ALGORITHMS, TOPOLOGIES, Algorithm
from peer.gossip.ledger import DEFAULT_WINDOW, MAX_WINDOW
from peer.lowp.kinds import NORM_KINDS, PRECISION_MODES
from peer.models.kinds import KEEP_NORM, parse_model_ref, parse_options


class ConfigError(PeerError, ValueError):
    """A configuration value is wrong; the message names the field."""

    default_reason = "config"


def check(ok: bool, name: str, value: Any, expected: str) -> None:
    """Raise :class:`ConfigError` ``"<name>: <expected>, got <value>"`` unless ``ok``."""
    if not ok:
        raise ConfigError(f"{name}: {expected}, got {value!r}")


def one_of(kinds: tuple[str, ...]) -> str:
    """``expected a, b or c`` for an enumeration defined in its domain module."""
    return f"expected {', '.join(kinds[:-1])} or {kinds[-1]}" if len(kinds) > 1 else f"expected {kinds[0]}"


def _check_kind(value: str, kinds: tuple[str, ...], name: str) -> None:
    check(value in kinds, name, value, one_of(kinds))


@dataclass(frozen=True)
class ModelSpec:
    """Which model, and in which precision, a peer trains.

    Attributes:
        name: a registry name (mnist-cnn, resnet20, resnet54, vgg11, resnet18), ``torchvision:NAME``,
            ``MODULE:CALLABLE`` or ``path/to/file.py:CALLABLE`` (peer/models/kinds.py); the last three are the
            user's own models, converted for the precision (peer/lowp/convert.py).
        options: keyword options for a plug-in model's builder, ``KEY=VALUE`` entries (``width_mult=0.75``).
        weights: a local state dict (safetensors or torch file) a plug-in model starts from (fine-tuning); entries
            whose shape differs (another class count's head) are skipped and logged.
        norm: range-evonorm (8-bit models), evonorm (fp32 models) or batchnorm (comparison only); for plug-in
            models also ``keep`` (their own BatchNorm layers stay, in fp32).
        precision: fp32, sim8 (fake-quant reference) or int8 (real int8 kernels where the probe passes).
        bits: bit width of sim8 (2..8), for studies below 8 bits.
        groups: EvoNorm groups.
    """

    name: str = "mnist-cnn"
    options: tuple[str, ...] = ()
    weights: str | None = None
    norm: str = "range-evonorm"
    precision: str = "int8"
    bits: int = 8
    groups: int = 8

    def __post_init__(self) -> None:
        try:
            ref = parse_model_ref(self.name)
        except ValueError as exc:
            raise ConfigError(f"model.name: {exc}") from None
        try:
            parse_options(self.options)
        except ValueError as exc:
            raise ConfigError(f"model.options: {exc}") from None
        for name, value in (("options", self.options), ("weights", self.weights)):
            check(ref.kind != "registry" or not value, f"model.{name}", value,
                  "applies to torchvision / module / file models, not registry ones")
        _check_kind(self.norm, NORM_KINDS + ((KEEP_NORM,) if ref.kind != "registry" else ()), "model.norm")
        _check_kind(self.precision, PRECISION_MODES, "model.precision")
        check(2 <= self.bits <= 8, "model.bits", self.bits, "expected 2..8")
        check(self.groups >= 1, "model.groups", self.groups, "expected >= 1")


@dataclass(frozen=True)
class DataSpec:
    """Dataset, this peer's shard and batching.

    Attributes:
        dataset: mnist5k (bundled real MNIST subset), cifar10, imagefolder, synthetic, or the user's own:
            ``MODULE:CALLABLE`` / ``path/to/file.py:CALLABLE`` returning the train and test splits
            (peer/data/plugin.py).
        root: dataset directory (ignored for mnist5k / synthetic; a plug-in's callable gets it as ``root=``).
        image_size: side in pixels image folders are resized and centre-cut to (None = the reader's 64).
        batch_size: samples per local step (paper: 32 per peer).
        skew: non-IID degree of skew s in [0, 1] (docs/method.md#non-iid-skew); 0 = IID.
        augment: random crop + flip; None = the dataset's default (off for digits).
        seed: shared by all peers (the skew partition's random pool must agree).
    """

    dataset: str = "mnist5k"
    root: str | None = None
    image_size: int | None = None
    batch_size: int = 32
    skew: float = 0.0
    augment: bool | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        check(self.image_size is None or self.image_size >= 1, "data.image_size", self.image_size, "expected >= 1")
        check(self.image_size is None or self.dataset == "imagefolder", "data.image_size", self.image_size,
              "applies to the imagefolder dataset only")
        check(self.batch_size >= 1, "data.batch_size", self.batch_size, "expected >= 1")
        check(0.0 <= self.skew <= 1.0, "data.skew", self.skew, "expected a number in [0, 1]")


@dataclass(frozen=True)
class OptimSpec:
    """Local optimizer and schedule (paper: lr 0.1, Nesterov 0.9, wd 1e-4, x0.1 at 50% and 75%).

    Attributes:
        lr: base learning rate. Default 0.05, not the paper's 0.1, which diverged with 99%-compressed Choco between
            asynchronous daemons (docs/decisions/optim-defaults.md#learning-rate); --lr 0.1 is the paper's setting.
        epochs: length of training in epochs of the peer's own shard (sets the schedule's decay points).
        warmup_epochs: epochs at 0.1 x lr at the start (the paper's one; more did not help skewed data:
            docs/decisions/optim-defaults.md#warm-up).
        momentum, weight_decay, nesterov, qgm: see :class:`peer.gossip.optim.OptimConfig`.
    """

    lr: float = 0.05
    epochs: float = 10.0
    warmup_epochs: float = 1.0
    momentum: float = 0.9
    weight_decay: float = 1e-4
    nesterov: bool = True
    qgm: bool = False

    def __post_init__(self) -> None:
        check(math.isfinite(self.lr) and self.lr >= 0, "optim.lr", self.lr, "expected a finite number >= 0")
        check(self.epochs > 0, "optim.epochs", self.epochs, "expected > 0")
        check(self.warmup_epochs >= 0, "optim.warmup_epochs", self.warmup_epochs, "expected >= 0")
        check(0.0 <= self.momentum < 1.0, "optim.momentum", self.momentum, "expected [0, 1)")
        check(self.weight_decay >= 0, "optim.weight_decay", self.weight_decay, "expected >= 0")


@dataclass(frozen=True)
class GossipSpec:
    """What peers exchange and with whom.

    Attributes:
        algorithm: sgp (dense), deepsqueeze or choco.
        compression: fraction of entries dropped by layer-wise top-k (0.99 keeps 1%); 0 = dense.
        bits: bits per transmitted value (2..8), or 32 for raw fp32 values.
        rounding: nearest or stochastic rounding of transmitted values.
        gamma: consensus step size; None = :func:`default_gamma` (1 for dense, 0.16 at 90%, 0.05 at 99%).
        topology: ring, undirected-ring, torus, exponential, random.
        rotating: vary the graph every round.
        k: out-degree of the random topology.
        local_steps: local SGD steps between gossip rounds (H).
        window: exactly-once window: most updates one directed edge may have sent and not yet settled (acked, or
            resolved by the reconnect handshake), 1..64. More than one keeps a link busy while acks travel
            (docs/design.md#exactly-once-mass-transfer; why 32: docs/decisions/window.md#the-count). Memory: per
            directed edge the sender holds at most
            ``window`` unsettled updates - each its payload until the Ack plus the engine's record of the mass
            moved (the decoded values: 12 bytes per kept entry, a few times the int8 payload, or 4 bytes per
            parameter for dense sgp; Choco's undo as much again): window x that per edge.
        window_mib: and at most this many MiB of update payloads in flight per directed edge (a new update goes
            while the unsettled ones add up to less; one always goes): the count alone would let a slow link queue
            dozens of dense updates (why 8: docs/decisions/window.md#the-byte-cap).
        max_halvings: divergence recoveries a peer may make; each rolls the model back to a recent healthy
            snapshot and halves the learning rate (a divergence of its own training step) or gamma (peer/runtime/
            recovery.py). One divergence more is an error.
        robust: the robust receive rule (peer/gossip/robust.py): each neighbour's contribution bounded, a neighbour
            that keeps pushing against the bound quarantined (docs/design.md#byzantine-robust-receive-rule). On by
            default; off gives the paper's plain receive (a quarantine from an earlier run's checkpoint still holds
            until released).
        consensus_rounds: rounds of gossip without local steps at most in one consensus phase, run when training
            ends (and every ``consensus_every`` epochs) so every device's own model comes near the average
            (docs/method.md#the-consensus-phase); 0 = no phase.
        consensus_tolerance: a phase ends once the in-neighbours heard from since the last judgement are within
            this relative distance (``||z_j - z_i|| / ||z_i||``) of the peer's own, ``consensus_patience``
            judgements in a row, and not before the phase graph reached every peer (its horizon: log2(n) rounds
            on the exponential graph). Why 0.02: asynchronous daemons close their distances by about half a
            round instead of averaging exactly, and at 0.01 a peer's last rounds hovered at 0.008-0.012 (README
            fleet, skew 0.9: the phase at 1.47-2.27x the training's bytes, median 1.72x over 12 runs, against
            2.02x and 2.06x at 0.01; devices within 0.9 point of the averaged model; the synchronous simulator
            takes its 4 rounds at both, 3 epochs); docs/decisions/consensus-phase.md.
        consensus_patience: consecutive judgements the tolerance must hold (1: the first calm one ends the phase;
            each more costs a dense round, docs/decisions/consensus-phase.md).
        consensus_compression: top-k compression of the phase's messages (0 = dense, at
            :attr:`effective_consensus_bits`).
        consensus_gamma: the phase's consensus step; None = :func:`default_gamma` of ``consensus_compression`` (1
            dense: bench/consensus_gamma.py, docs/decisions/gamma.md).
        consensus_bits: value width of the phase's messages (2..8, or 32 for raw fp32); None = 32 for sgp (it
            sends the model itself, and 8-bit rounding alone puts a message's model 1% of its norm from the
            sender's: at the tolerance of 0.01 an int8 SGP phase never converged, and it never averages exactly;
            raw fp32 does, in log2(n) to log2(n) + 1 rounds), else ``bits`` (Choco and Deep-Squeeze send
            differences, whose rounding the next message corrects).
        consensus_deflate: entropy-code the phase's messages with zlib when that makes them smaller (dense 8-bit
            Choco phase messages: 0.68x in the simulator, 0.79x in the README fleet; peer/compress/deflate.py).
        consensus_step_floor: Choco's phase messages are quantised on a grid no finer than this fraction of each
            tensor's RMS in the sender's model (CodecConfig.step_floor; 0 = the plain grid, None = the tolerance;
            SGP and Deep-Squeeze send models, not differences, and ignore it). A difference the grid can barely
            resolve is mostly zero codes, which deflate shrinks; the rounding it adds is about 0.3 of a step
            (RMS), a third of the tolerance at the default, and can cost a round where a neighbour sat at the
            tolerance. Choco, skew 0.9:
            README fleet (6 runs) 1.03-1.69x the training's bytes against 1.88-2.43x at 0; 8-peer simulator,
            3 epochs, 2.58x against 2.94x (4 rounds, the same accuracy), 10 epochs, 3 seeds: 0.78x, 0.84x and
            1.07x against 0.87x, 0.96x and 0.96x (the last a fifth round: a neighbour judged just outside the
            tolerance); at 0.048 peers never judged their neighbours calm (docs/decisions/consensus-phase.md).
        consensus_every: also run a phase every this many epochs of training (0 = only when training ends).
        consensus_topology: the phase's graph, rotating every round: the rotating exponential graph (default)
            sends one message per round like the ring but averages 2^k peers exactly in k dense rounds, where the
            ring's spectral gap (0.076 at 8 peers) needs tens.
        consensus_probe: past the phase graph's horizon every other phase round sends a 4 KiB sketch of the model
            (a ConsensusProbe) instead of an update, from which the neighbours judge their distance
            (peer/gossip/sketch.py), and a peer that ends converged sends one to the peers its graph sends to. Off
            by default: in the synchronous simulator the round that only confirms the averaging is done then costs
            4 KiB instead of a dense message (8 peers, 3 epochs: 1.93x the training's bytes instead of 2.57x, the
            same rounds and devices), but in the asynchronous README fleet (skew 0.9) probe-ended phases left the
            devices about twice as far apart (0.010-0.023 of the average, the mean device up to 1.6 points below
            it, against 0.006-0.016 and 0.4 points) for 0.6-0.7x the phase bytes
            (docs/decisions/consensus-phase.md).
        consensus_budget: a phase's bytes at most about this many times the update bytes this peer sent in
            training before it (0 = no bound): past the horizon a round whose dense message would go over it sends
            a probe instead, as consensus_probe does, so a phase after a short training confirms with 4 KiB probes
            and one after a long training stays dense (8 peers, 3 epochs: 1.93x instead of 2.57x; 10 epochs and
            the README fleet: within 2x dense anyway). Rounds that must still mix go on densely past it.
    """

    algorithm: str = Algorithm.CHOCO.value  # kept a plain str: run specs go into weights-only checkpoints
    compression: float = 0.99
    bits: int = 8
    rounding: str = "nearest"
    gamma: float | None = None
    topology: str = "ring"
    rotating: bool = False
    k: int = 2
    local_steps: int = 1
    window: int = DEFAULT_WINDOW
    window_mib: float = 8.0
    max_halvings: int = 4
    robust: bool = True
    consensus_rounds: int = 0
    consensus_tolerance: float = 0.02
    consensus_patience: int = 1
    consensus_compression: float = 0.0
    consensus_gamma: float | None = None
    consensus_bits: int | None = None
    consensus_deflate: bool = True
    consensus_step_floor: float | None = None
    consensus_every: float = 0.0
    consensus_topology: str = "exponential"
    consensus_probe: bool = False
    consensus_budget: float = 2.0

    def __post_init__(self) -> None:
        _check_kind(self.algorithm, ALGORITHMS, "gossip.algorithm")
        check(0.0 <= self.compression < 1.0, "gossip.compression", self.compression, "expected [0, 1)")
        check(self.algorithm != Algorithm.SGP or self.compression == 0.0, "gossip.compression", self.compression,
              "sgp sends the dense model: use 0 (or choose deepsqueeze/choco)")
        check(2 <= self.bits <= 8 or self.bits == 32, "gossip.bits", self.bits, "expected 2..8 or 32")
        _check_kind(self.rounding, ROUNDINGS, "gossip.rounding")
        check(self.gamma is None or 0.0 < self.gamma <= 1.0, "gossip.gamma", self.gamma, "expected (0, 1]")
        _check_kind(self.topology, TOPOLOGIES, "gossip.topology")
        check(self.k >= 1, "gossip.k", self.k, "expected >= 1")
        check(self.local_steps >= 1, "gossip.local_steps", self.local_steps, "expected >= 1")
        check(1 <= self.window <= MAX_WINDOW, "gossip.window", self.window, f"expected 1..{MAX_WINDOW}")
        check(self.window_mib > 0, "gossip.window_mib", self.window_mib, "expected > 0 MiB")
        check(0 <= self.max_halvings <= 30, "gossip.max_halvings", self.max_halvings, "expected 0..30")
        check(self.consensus_rounds >= 0, "gossip.consensus_rounds", self.consensus_rounds, "expected >= 0 rounds")
        check(math.isfinite(self.consensus_tolerance) and self.consensus_tolerance > 0, "gossip.consensus_tolerance",
              self.consensus_tolerance, "expected a relative distance > 0")
        check(self.consensus_patience >= 1, "gossip.consensus_patience", self.consensus_patience,
              "expected >= 1 round")
        check(0.0 <= self.consensus_compression < 1.0, "gossip.consensus_compression", self.consensus_compression,
              "expected [0, 1)")
        check(self.algorithm != "sgp" or self.consensus_compression == 0.0, "gossip.consensus_compression",
              self.consensus_compression, "sgp sends the dense model: use 0")
        check(self.consensus_gamma is None or 0.0 < self.consensus_gamma <= 1.0, "gossip.consensus_gamma",
              self.consensus_gamma, "expected (0, 1]")
        check(self.consensus_bits is None or 2 <= self.consensus_bits <= 8 or self.consensus_bits == 32,
              "gossip.consensus_bits", self.consensus_bits, "expected 2..8 or 32 (or unset: 32 for sgp, else bits)")
        check(isinstance(self.consensus_probe, bool), "gossip.consensus_probe", self.consensus_probe,
              "expected true or false")
        check(isinstance(self.consensus_budget, (int, float)) and math.isfinite(self.consensus_budget)
              and self.consensus_budget >= 0, "gossip.consensus_budget", self.consensus_budget,
              "expected >= 0 times the training's bytes (0: no bound)")
        check(isinstance(self.consensus_deflate, bool), "gossip.consensus_deflate", self.consensus_deflate,
              "expected true or false")
        floor = self.consensus_step_floor
        check(floor is None or (isinstance(floor, (int, float)) and not isinstance(floor, bool)
                                and math.isfinite(floor) and 0.0 <= floor <= 1.0),
              "gossip.consensus_step_floor", floor, "expected a relative step in [0, 1] (or unset: the tolerance)")
        check(math.isfinite(self.consensus_every) and self.consensus_every >= 0, "gossip.consensus_every",
              self.consensus_every, "expected >= 0 epochs")
        _check_kind(self.consensus_topology, TOPOLOGIES, "gossip.consensus_topology")

    @property
    def effective_gamma(self) -> float:
        """The configured gamma, or the compression-dependent default."""
        return self.gamma if self.gamma is not None else default_gamma(self.compression)

    @property
    def effective_consensus_gamma(self) -> float:
        """The consensus phase's gamma: the configured one, or the default of its compression."""
        return self.consensus_gamma if self.consensus_gamma is not None else default_gamma(self.consensus_compression)

    @property
    def effective_consensus_step_floor(self) -> float:
        """The phase's coarsest quantisation step relative to each tensor's RMS: the configured one, or the
        tolerance (at most 1: a tolerance above it judges nothing a step of the model's RMS could not)."""
        if self.consensus_step_floor is None:
            return min(self.consensus_tolerance, 1.0)
        return self.consensus_step_floor

    @property
    def effective_consensus_bits(self) -> int:
        """The consensus phase's value width: the configured one, or 32 for sgp and ``bits`` otherwise."""
        if self.consensus_bits is not None:
            return self.consensus_bits
        return 32 if self.algorithm == Algorithm.SGP else self.bits


#: :func:`default_gamma` in words, for help texts.
DEFAULT_GAMMA_RULE = "1 dense, else min(1, 0.5*sqrt(1-compression))"


def default_gamma(compression: float) -> float:
    """The default consensus step: 1 for dense gossip, ``min(1, 0.5 * sqrt(1 - compression))`` with top-k (0.05 at
    99%, 0.16 at 90%).

    Why: a larger gamma lets skewed peers agree sooner, but compressed Choco is only stable below a limit that
    shrinks with the kept fraction; the square root of the kept fraction stays a factor 2 inside it
    (docs/decisions/gamma.md#measurements).
    """
    return 1.0 if compression == 0.0 else min(1.0, 0.5 * math.sqrt(1.0 - compression))


@dataclass(frozen=True)
class RunSpec:
    """The parts every decentralized run shares (simulator and daemon)."""

    model: ModelSpec = field(default_factory=ModelSpec)
    data: DataSpec = field(default_factory=DataSpec)
    optim: OptimSpec = field(default_factory=OptimSpec)
    gossip: GossipSpec = field(default_factory=GossipSpec)

    def sections(self) -> dict[str, Any]:
        """Each section by its table name (``model``, ``data``, ``optim``, ``gossip``)."""
        return {name: getattr(self, name) for name in RUN_SECTIONS}


def build_section(cls: type, values: dict[str, Any], prefix: str) -> Any:
    """Instantiate a spec dataclass from a mapping, naming unknown keys and wrongly typed values."""
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"{prefix}: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    coerced = {k: _coerce(v, hints[k], f"{prefix}.{k}") for k, v in values.items()}
    return cls(**coerced)


def _coerce(value: Any, hint: Any, name: str) -> Any:
    """Coerce TOML/env values to the field's type (str -> int/float/bool for env vars); reject the rest."""
    is_union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    options = typing.get_args(hint) if is_union else (hint,)
    if value is None and type(None) in options:
        return None
    for option in options:
        if option is type(None):
            continue
        try:
            if option is bool:
                if isinstance(value, bool):
                    return value
                if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
                    return value.lower() in ("1", "true", "yes", "on")
                continue
            if option is int and isinstance(value, (int, str)) and not isinstance(value, bool):
                return int(value)
            if option is float and isinstance(value, (int, float, str)) and not isinstance(value, bool):
                return float(value)
            if option is str and isinstance(value, (str, int, float)) and not isinstance(value, bool):
                return str(value)
            if option is tuple or typing.get_origin(option) is tuple:
                if isinstance(value, str):
                    return tuple(v.strip() for v in value.split(",") if v.strip())
                if isinstance(value, (list, tuple)):
                    return tuple(str(v) for v in value)
        except (TypeError, ValueError):
            continue
    raise ConfigError(f"{name}: expected {getattr(hint, '__name__', hint)}, got {value!r}")


def read_toml(path: str | Path) -> dict[str, Any]:
    """Read a TOML config file with errors that name the file."""
    p = Path(path)
    try:
        with p.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file {p}: not found") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {p}: not valid TOML ({exc})") from None


def env_prefix(section: str) -> str:
    """``LPDL_<SECTION>_``: what the environment variables of one section's fields start with."""
    return f"LPDL_{section.upper()}_"


def env_overrides(section: str, cls: type, environ: dict[str, str] | None = None) -> dict[str, str]:
    """``LPDL_<SECTION>_<FIELD>`` variables for one section (strings, coerced later)."""
    env = os.environ if environ is None else environ
    out = {}
    for f in dataclasses.fields(cls):
        key = f"{env_prefix(section)}{f.name.upper()}"
        if key in env:
            out[f.name] = env[key]
    return out


def merge_sections(layers: list[dict[str, dict[str, Any]]], sections: dict[str, type]) -> dict[str, Any]:
    """Merge config layers (later wins, ``None`` values skipped) and build every section's dataclass."""
    for layer in layers:
        unknown = sorted(set(layer) - set(sections))
        if unknown:
            raise ConfigError(f"unknown config section(s) {', '.join(unknown)}; known: {', '.join(sections)}")
    built = {}
    for name, cls in sections.items():
        merged: dict[str, Any] = {}
        for layer in layers:
            merged.update({k: v for k, v in (layer.get(name) or {}).items() if v is not None})
        built[name] = build_section(cls, merged, name)
    return built


RUN_SECTIONS: dict[str, type] = {"model": ModelSpec, "data": DataSpec, "optim": OptimSpec, "gossip": GossipSpec}
#: Every table a config file may hold (the daemon adds ``node`` and ``net``, peer/daemon/config.py); a file may serve
#: several commands.
ALL_SECTIONS = (*RUN_SECTIONS, "node", "net")


def load_sections(sections: dict[str, type], path: str | Path | None = None,
                  flags: dict[str, dict[str, Any]] | None = None, environ: dict[str, str] | None = None,
                  defaults: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """Build ``sections`` from defaults, then the TOML file, then the environment, then flags (flags win).

    Tables of other commands (listed in ALL_SECTIONS) are ignored; any other table is an unknown-section error.
    """
    file_layer = read_toml(path) if path else {}
    file_layer = {k: v for k, v in file_layer.items() if k in sections or k not in ALL_SECTIONS}
    env_layer = {name: env_overrides(name, cls, environ) for name, cls in sections.items()}
    return merge_sections([defaults or {}, file_layer, env_layer, flags or {}], sections)


def load_run_spec(path: str | Path | None = None, flags: dict[str, dict[str, Any]] | None = None,
                  environ: dict[str, str] | None = None,
                  defaults: dict[str, dict[str, Any]] | None = None) -> RunSpec:
    """The model/data/optim/gossip sections of a config."""
    return RunSpec(**load_sections(RUN_SECTIONS, path, flags, environ, defaults))


def toml_text(sections: dict[str, Any]) -> str:
    """``sections`` (section dataclasses by table name) as a TOML document, one table each with every field, that
    :func:`load_sections` reads back into equal sections. A field at None is left out: TOML has no null, and every
    field that may be None defaults to None."""
    lines: list[str] = []
    for name, section in sections.items():
        lines.append(f"[{name}]")
        for f in dataclasses.fields(section):
            value = getattr(section, f.name)
            if value is not None:
                lines.append(f"{f.name} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)  # inf and nan are TOML's too; a float's repr keeps its point or exponent
    if isinstance(value, str):
        # a JSON string is a TOML basic string once DEL, which JSON leaves bare and TOML refuses, is escaped
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML form for {value!r}")
