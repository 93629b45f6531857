"""Prepare a host for its daemons: compile every int8 pass graph a daemon of a given config runs into the host's
ahead-of-time store before the first daemon starts (``lpdl-peer prepare``).

Why: a daemon never compiles (``LPDL_LOWP_AOT=background``, peer/lowp/aot_queue.py): on a host whose store is
empty it runs the eager passes, 1.15x fp32's step on an Intel Xeon with AMX, while one process compiles the graphs
at idle priority, mostly after the run. So the first int8 fleet on a fresh host took 1.48x fp32's time to 90%
where every later one took 0.73-0.87x (bench/RESULTS-fleet.md). Compiling at install, in the foreground, moves that
cost to where an operator expects it (a provisioning script, a device image's first boot, ``scripts/setup.sh``
with ``LPDL_PREPARE=1``).

How: the process compiles as a daemon would load - it builds the peer of the config (the same builder as the
daemon, the simulator and ``train``), runs two training steps and the evaluations (the daemon's: the training batch
size, padded; the fleet report's and ``train``'s: :data:`~peer.runtime.build.EVAL_BATCH_SIZE` and the test split's
remainder) with the store in inline mode, where each missing graph is compiled under its host-wide lock. Then it
checks the result the way a daemon meets it: the same steps on a new model in background mode, which must find every
graph stored (anything it queues is compiled here too, and counted), and counts what a daemon would still run
eagerly. While it compiles the config's graphs it holds the store's filler lock, so no background filler compiles
beside it (the bit-exactness check's three graphs come first, before the lock). Nothing of a daemon's state is
read or written.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from peer.config import RunSpec
from peer.data import DatasetSplits
from peer.errors import PeerError
from peer.lowp.aot_fill import compile_pending
from peer.lowp.aot_queue import FAILED, pending, try_filler_lock
from peer.lowp.compile_policy import AOT_BACKGROUND, AOT_INLINE, ENV_AOT, ENV_EAGER
from peer.lowp.passes import FusedPasses
from peer.models.kinds import parse_model_ref
from peer.runtime.build import BuiltModel, build_peer, build_peer_model, eval_loader, load_splits
from peer.runtime.evaluation import Evaluation

log = logging.getLogger(__name__)

#: Longest wait (s) for a background filler at work on the store before compiling beside it.
LOCK_WAIT_S = 600.0
#: Training steps run per pass: the first step of a model and a later one may meet different passes (a plan made at
#: the first step, the fused backward once its graph is stored).
TRAIN_STEPS = 2


class PrepareError(PeerError, OSError):
    """The host cannot be prepared (its store cannot be made or written by this user)."""

    default_reason = "prepare"


@dataclass
class Preparation:
    """What ``prepare`` did.

    Attributes:
        store: the host's store of pass graphs, None where nothing is stored (fp32, CUDA, eager passes).
        compiled: graphs compiled by this run.
        loaded: graphs the check found stored (a daemon's first steps load them).
        left: pass signatures a daemon would still run eagerly after this run compiled (0 when prepared).
        failed: pass or request -> why it could not be compiled (a daemon runs those passes eagerly); "the passes"
            where none can be (the small-case check failed: no C++ compiler, a disagreement).
        seconds: wall time of the whole preparation (s).
        skipped: why there is nothing to compile (empty when there was).
    """

    store: Path | None = None
    compiled: int = 0
    loaded: int = 0
    left: int = 0
    failed: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    skipped: str = ""


def prepare_host(run: RunSpec, device: torch.device, shard: tuple[int, int] = (0, 1),
                 lock_wait_s: float = LOCK_WAIT_S) -> Preparation:
    """Compile the int8 pass graphs a daemon of ``run`` on ``device`` runs into this host's store (module
    docstring); ``shard`` only picks which training samples the steps run on. Raises PrepareError where the
    store cannot be written."""
    started = time.monotonic()
    report = Preparation()
    if device.type != "cpu":
        report.skipped = f"passes on {device.type} are compiled just in time in the daemon; nothing is stored"
        return report
    splits = load_splits(run.data)
    try:
        with _environment(compiling_environment(run)):
            built = build_peer_model(run.model, splits, device, seed=run.data.seed)
            passes = _passes(built)
            if passes is None:
                report.skipped = f"precision {built.precision.config_in_use.mode}: no int8 pass graphs to compile"
                return report
            if not passes.compiled:
                if passes.check_failure is not None:
                    report.failed["the passes"] = passes.check_failure
                else:
                    report.skipped = f"int8 passes run eagerly on this host ({passes.info.reason})"
                return report
            if passes.aot is None:
                raise PrepareError("the host's store of pass graphs could not be made (the log above says why)")
            report.store = store = passes.aot.directory
            lock = _filler_lock(store, lock_wait_s)
            try:
                _exercise(run, built, splits, device, shard)
                report.compiled = passes.aot.compiled
                report.failed.update(passes.fallbacks)
                # as a daemon meets them: background mode (never load-only here - registry models compile with
                # LPDL_LOWP_EAGER=0 above, and plug-in models only where the operator set it), compiling what it
                # queues, then once more to count what still runs eagerly
                with _environment({ENV_AOT: AOT_BACKGROUND}):
                    check = _exercised_passes(run, splits, device, shard)
                    report.loaded = check.aot.loaded if check.aot else 0
                    queued = pending(store)
                    report.compiled += compile_pending(store, wait_for_idle=False)
                    for request in queued:
                        reason = store / FAILED / request.with_suffix(".txt").name
                        if reason.exists():
                            report.failed[request.stem] = reason.read_text().strip()
                    report.left = _exercised_passes(run, splits, device, shard).waiting_graphs()
            finally:
                if lock is not None:
                    os.close(lock)
    finally:
        report.seconds = time.monotonic() - started
    return report


def _filler_lock(store: Path, wait_s: float) -> int | None:
    """The store's filler lock, held (no background filler compiles beside this run); None after ``wait_s``
    seconds behind a filler at work (it waits for idle cores, which this process leaves it): each graph's own
    host-wide lock still keeps the two from compiling one graph twice. PrepareError where this user cannot write
    the store."""
    if not os.access(store, os.W_OK):
        raise PrepareError(f"the store {store} is not writable by this user: run prepare as the daemons' user, "
                           "with their LPDL_CACHE_DIR")
    deadline = time.monotonic() + wait_s
    lock = try_filler_lock(store)
    if lock is None:
        log.info("a background compile works on %s: waiting for it (at most %.0f s)", store, wait_s)
    while lock is None and time.monotonic() < deadline:
        time.sleep(2.0)
        lock = try_filler_lock(store)
    if lock is None:
        log.warning("the background compile on %s still works after %.0f s: compiling beside it", store, wait_s)
    return lock


def compiling_environment(run: RunSpec) -> dict[str, str]:
    """The environment this process compiles in: the store inline; and where the operator left LPDL_LOWP_EAGER
    unset, ``0`` for a registry model - the rule that keeps a machine under 4 GiB from compiling is for a compiler
    beside its daemons, and this process runs alone (a plug-in model's passes stay as its daemon runs them: eager
    unless the operator asks to compile)."""
    env = {ENV_AOT: AOT_INLINE}
    if not os.environ.get(ENV_EAGER) and parse_model_ref(run.model.name).kind == "registry":
        env[ENV_EAGER] = "0"
    return env


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """Environment variables set to ``values`` inside the block, as they were after it."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _passes(built: BuiltModel) -> FusedPasses | None:
    """The model's fused int8 passes, None for a model without them (fp32)."""
    config = built.precision.config_in_use
    return config.passes if config.mode == "int8" else None


def _exercised_passes(run: RunSpec, splits: DatasetSplits, device: torch.device,
                      shard: tuple[int, int]) -> FusedPasses:
    """The passes of a new model of ``run`` after :func:`_exercise` (int8: the caller checked)."""
    built = build_peer_model(run.model, splits, device, seed=run.data.seed)
    _exercise(run, built, splits, device, shard)
    passes = _passes(built)
    assert passes is not None
    return passes


def _exercise(run: RunSpec, built: BuiltModel, splits: DatasetSplits, device: torch.device,
              shard: tuple[int, int]) -> None:
    """Run what a daemon's and a fleet report's passes meet: training steps, then the evaluations of the trained
    model (whose quantizers then hold running ranges: evaluation quantizes with those, not the batch's) at the
    training batch size (the daemon's) and at EVAL_BATCH_SIZE (the fleet report's and train's)."""
    peer = build_peer(run, "prepare", shard, splits, device, built)
    peer.train_steps(TRAIN_STEPS)
    for loader in (eval_loader(splits, device, batch_size=run.data.batch_size), eval_loader(splits, device)):
        Evaluation(peer.model, itertools.islice(loader, 1)).advance(None)
