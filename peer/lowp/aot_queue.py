"""The queue of pass graphs a process wants in the host's ahead-of-time store, and the background process that
compiles them (``LPDL_LOWP_AOT=background``, aot_graphs.py; the process: aot_fill.py).

Why: compiling the MNIST CNN's 55 pass graphs ahead of time took the README fleet's first run from about 23 s to
305 s (bench/RESULTS-fleet.md), so nobody would leave it on by default. In background mode a process that misses a
graph runs that pass eagerly (the same bits) and leaves a request here; one filler process per store compiles the
requests at the lowest CPU priority (SCHED_IDLE: it runs only on cores nobody else wants) and exits when the queue
is empty. Later processes, and the requesting ones once they look again, load the stored graphs.

A request is ``wanted/<name digest>.pt``: the pass function and its arguments (tensors as zero-filled placeholders
of the same dtype, shape and strides: a static graph does not depend on values), written atomically; one that
failed to compile moves to ``failed/`` with its reason beside it and is not asked for again. The filler holds
``filler.lock`` (a flock: released when it exits or dies) while it works, so a second one exits at once.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from peer.lowp.compile_policy import ENV_AOT

log = logging.getLogger(__name__)

WANTED = "wanted"
FAILED = "failed"
FILLER_LOCK = "filler.lock"
FILLER_LOG = "filler.log"
#: A process starts a filler at most this often (seconds): a filler just started takes a moment to hold its lock.
SPAWN_EVERY_S = 60.0


def request_path(directory: Path, name: str) -> Path:
    return directory / WANTED / f"{hashlib.sha256(name.encode()).hexdigest()[:24]}.pt"


def failed_path(directory: Path, name: str) -> Path:
    return directory / FAILED / request_path(directory, name).name


def write_request(directory: Path, name: str, fn: Any, args: tuple[object, ...]) -> bool:
    """Ask for graph ``name`` (``fn`` on arguments of ``args``' signature); False where it cannot be asked for (it
    failed before, a function without an importable name, an unwritable store), logged at debug level."""
    import torch

    path = request_path(directory, name)
    if path.exists() or failed_path(directory, name).exists():
        return path.exists()
    placeholders = tuple(torch.empty_strided(a.shape, a.stride(), dtype=a.dtype).zero_()
                         if isinstance(a, torch.Tensor) else a for a in args)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:
            torch.save({"name": name, "fn": fn, "args": placeholders}, f)
        os.replace(tmp, path)
    except Exception as exc:  # pickling a local function, a full or read-only disk: the pass stays eager
        log.debug("no background compile of %s: %s: %s", name, type(exc).__name__, exc)
        return False
    return True


def pending(directory: Path) -> list[Path]:
    """The requests waiting, oldest first."""
    try:
        paths = [p for p in (directory / WANTED).glob("*.pt")]
        return sorted(paths, key=lambda p: p.stat().st_mtime_ns)
    except OSError:
        return []


def mark_failed(request: Path, reason: str) -> None:
    """Move a request that cannot be compiled to ``failed/`` (never asked for again), its reason beside it."""
    target = request.parent.parent / FAILED / request.name
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.with_suffix(".txt").write_text(reason + "\n")
        os.replace(request, target)
    except OSError as exc:
        log.warning("request %s could not be set aside (%s)", request, exc)


def try_filler_lock(directory: Path) -> int | None:
    """The filler lock's descriptor, held, or None where another process holds it (or no lock file can be made)."""
    try:
        fd = os.open(directory / FILLER_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


class Filler:
    """Starts the store's filler process from a process that asked for graphs: at most once per ``every_s``, and
    only while no filler holds the lock."""

    def __init__(self, directory: Path, every_s: float = SPAWN_EVERY_S) -> None:
        self.directory = directory
        self.every_s = every_s
        self._last = -float("inf")
        self.started = 0  # filler processes this process started (tests)

    def ensure(self) -> None:
        now = time.monotonic()
        if now - self._last < self.every_s:
            return
        self._last = now
        fd = try_filler_lock(self.directory)
        if fd is None:
            return  # a filler is at work: it looks at the queue again before it exits
        os.close(fd)
        env = {k: v for k, v in os.environ.items() if k != ENV_AOT}
        env["TORCHINDUCTOR_COMPILE_THREADS"] = "1"  # no pool of compile workers beside the daemons
        try:
            with open(self.directory / FILLER_LOG, "ab") as out:
                subprocess.Popen([sys.executable, "-m", "peer.lowp.aot_fill", str(self.directory)],
                                 stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                                 start_new_session=True, cwd=str(Path(__file__).resolve().parents[2]))
        except OSError as exc:
            log.warning("background compile of pass graphs not started (%s): they run eagerly", exc)
            return
        self.started += 1
        log.info("pass graphs compiled in the background into %s (log %s)", self.directory, FILLER_LOG)
