"""Which malloc the daemon runs on, chosen before anything allocates much: glibc's, or tcmalloc / jemalloc.

Why: a training daemon frees and re-allocates the same multi-MiB tensors every step. glibc's malloc raises its
mmap threshold after the first such free (up to 32 MiB), serves them from its heap from then on, and keeps what
fragments: a solo mnist-cnn daemon's RSS grew by 200-290 MiB during training while its working set is a few MiB.
Measured on the same daemon (bench/RESULTS-fleet.md): tcmalloc keeps the growth to ~30 MiB at the same CPU per
round, jemalloc to ~30-55 MiB for ~1.35x the CPU, a fixed glibc mmap threshold to ~20 MiB for ~3x the CPU.

An allocator can only be swapped before the process starts, so ``reexec_with`` re-executes the daemon's own
command line once, same PID (systemd and the fleet launcher see no difference), with the library in LD_PRELOAD.
It is a no-op where the library is not installed (``auto`` then stays on glibc and says so) and never loops: the
child finds LPDL_ALLOCATOR set. Linux only; elsewhere the system allocator stays.
"""

from __future__ import annotations

import ctypes.util
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

#: Library (ctypes.util.find_library name) of each replaceable allocator, in the order ``auto`` tries them.
ALLOCATOR_LIBRARIES: dict[str, str] = {"tcmalloc": "tcmalloc_minimal", "jemalloc": "jemalloc"}
#: Debian / Raspberry Pi OS package of each (named in messages: what an operator installs).
ALLOCATOR_PACKAGES: dict[str, str] = {"tcmalloc": "libtcmalloc-minimal4", "jemalloc": "libjemalloc2"}
ALLOCATORS: tuple[str, ...] = ("auto", "glibc", *ALLOCATOR_LIBRARIES)
#: Set in the re-executed daemon to the allocator it was started with (guards against a second re-exec).
GUARD_ENV = "LPDL_ALLOCATOR"


class AllocatorError(RuntimeError):
    """A named allocator was asked for but is not installed."""


def plan(choice: str, environ: Mapping[str, str],
         find: Callable[[str], str | None] = ctypes.util.find_library) -> tuple[str, dict[str, str]] | None:
    """``(allocator, environment)`` to re-execute with, or None to stay as we are (``glibc`` asked, already
    re-executed, or ``auto`` with nothing installed). Raises AllocatorError for a named allocator not installed."""
    if choice == "glibc" or GUARD_ENV in environ or not sys.platform.startswith("linux"):
        return None
    for name in ALLOCATOR_LIBRARIES if choice == "auto" else (choice,):
        soname = find(ALLOCATOR_LIBRARIES[name])
        if soname:
            env = dict(environ)
            preload = environ.get("LD_PRELOAD", "")
            env["LD_PRELOAD"] = f"{soname}:{preload}" if preload else soname
            env[GUARD_ENV] = name
            return name, env
    if choice != "auto":
        raise AllocatorError(f"node.allocator: {choice} requested but its library is not installed "
                             f"(Debian: apt install {ALLOCATOR_PACKAGES[choice]}); use auto or glibc")
    return None


def reexec_with(choice: str) -> None:
    """Re-execute this process with the allocator ``choice`` preloaded (see ``plan``); returns only when staying.
    Call before torch, gRPC or any thread starts."""
    planned = plan(choice, os.environ)
    if planned is None:
        return
    _, env = planned
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def in_use(maps: Path = Path("/proc/self/maps")) -> str:
    """The allocator this process really runs on: ``tcmalloc`` / ``jemalloc`` when its library is mapped (a
    preload the dynamic loader ignored does not count), else ``glibc`` (``system`` where /proc is absent)."""
    try:
        mapped = maps.read_text()
    except OSError:
        return "system"
    for name, library in ALLOCATOR_LIBRARIES.items():
        if f"lib{library}.so" in mapped:
            return name
    return "glibc"
