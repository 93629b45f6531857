"""Which malloc the daemon runs on, chosen before anything allocates much: glibc's, or tcmalloc / jemalloc.

Why: a training daemon frees and re-allocates the same multi-MiB tensors every step, and glibc's malloc keeps
what fragments, growing the RSS by hundreds of MiB; tcmalloc keeps it to tens at the same CPU
(docs/decisions/allocator.md#allocators-compared).

An allocator can only be swapped before the process starts, so ``reexec_with`` re-executes the daemon's own
command line once, same PID (systemd and the fleet launcher see no difference), with the library in LD_PRELOAD.
The re-executed process then puts LD_PRELOAD back as it was (``settle``), so what the daemon starts - the C++
compiler of torch.compile, another daemon - is not handed the library. Nothing happens where the library is not
installed (``auto`` then stays on glibc), and it never loops: the re-executed process finds its own PID in
``REEXEC_ENV``. Linux only; elsewhere the system allocator stays.
"""

from __future__ import annotations

import logging
import os
import sys
import sysconfig
from collections.abc import Callable, Mapping, MutableMapping
from pathlib import Path

from peer.errors import PeerError

log = logging.getLogger(__name__)

#: Shared library (soname) of each replaceable allocator, in the order ``auto`` tries them.
ALLOCATOR_LIBRARIES: dict[str, str] = {"tcmalloc": "libtcmalloc_minimal.so.4", "jemalloc": "libjemalloc.so.2"}
#: Debian / Raspberry Pi OS package of each (named in messages: what an operator installs).
ALLOCATOR_PACKAGES: dict[str, str] = {"tcmalloc": "libtcmalloc-minimal4", "jemalloc": "libjemalloc2"}
#: Set for the re-executed process only: its PID (the same before and after exec) and the LD_PRELOAD to restore.
REEXEC_ENV = "_LPDL_REEXEC_PID"
PRELOAD_BEFORE_ENV = "_LPDL_PRELOAD_BEFORE"


class AllocatorError(PeerError, RuntimeError):
    """A named allocator was asked for but is not installed."""

    default_reason = "allocator"


def library_dirs() -> list[Path]:
    """Where the system's shared libraries live (Debian multiarch first: x86_64-linux-gnu, aarch64-linux-gnu)."""
    multiarch = sysconfig.get_config_var("MULTIARCH") or ""
    dirs = [f"/usr/lib/{multiarch}", f"/lib/{multiarch}"] if multiarch else []
    return [Path(d) for d in (*dirs, "/usr/lib64", "/usr/lib", "/lib", "/usr/local/lib")]


def find_library(soname: str, dirs: list[Path] | None = None) -> str | None:
    """Path of ``soname`` in the system library directories, or None. A plain lookup (no ldconfig or compiler
    run: ctypes.util.find_library falls back to gcc, seconds on a small board)."""
    for directory in library_dirs() if dirs is None else dirs:
        path = directory / soname
        if path.is_file():
            return str(path)
    return None


def library_for(choice: str, find: Callable[[str], str | None] = find_library) -> tuple[str, str] | None:
    """``(allocator, library path)`` that ``choice`` preloads, or None (``glibc`` asked, not Linux, or ``auto`` with
    nothing installed). Raises AllocatorError for a named allocator that is not installed."""
    if choice == "glibc" or not sys.platform.startswith("linux"):
        return None
    for name in ALLOCATOR_LIBRARIES if choice == "auto" else (choice,):
        path = find(ALLOCATOR_LIBRARIES[name])
        if path:
            return name, path
    if choice != "auto":
        raise AllocatorError(f"node.allocator: {choice} requested but {ALLOCATOR_LIBRARIES[choice]} is not "
                             f"installed (Debian: apt install {ALLOCATOR_PACKAGES[choice]}); use auto or glibc")
    return None


def with_preload(environ: Mapping[str, str], path: str) -> dict[str, str]:
    """``environ`` with the library ``path`` first in LD_PRELOAD."""
    preload = environ.get("LD_PRELOAD", "")
    return {**environ, "LD_PRELOAD": f"{path}:{preload}" if preload else path}


def mark_preloaded(environ: MutableMapping[str, str], pid: int, preload_before: str) -> None:
    """Mark process ``pid`` as already running on its allocator (``start`` will not re-execute it, and ``settle``
    puts LD_PRELOAD back to ``preload_before`` for its children)."""
    environ[PRELOAD_BEFORE_ENV] = preload_before
    environ[REEXEC_ENV] = str(pid)


def plan(choice: str, environ: Mapping[str, str], pid: int,
         find: Callable[[str], str | None] = find_library) -> tuple[str, dict[str, str]] | None:
    """``(allocator, environment)`` to re-execute with, or None to stay as we are (``glibc`` asked, this process
    already re-executed, or ``auto`` with nothing installed). Raises AllocatorError for a named allocator that is not
    installed."""
    if environ.get(REEXEC_ENV) == str(pid):
        return None
    found = library_for(choice, find)
    if found is None:
        return None
    name, path = found
    env = with_preload(environ, path)
    mark_preloaded(env, pid, environ.get("LD_PRELOAD", ""))
    return name, env


def reexec_with(choice: str) -> None:
    """Re-execute this process with the allocator ``choice`` preloaded (see ``plan``); returns when staying (also
    when the exec itself fails: logged, glibc stays). Call before torch, gRPC or any thread starts, and only from
    the process's own entry point (the command line re-executed is this process's)."""
    planned = plan(choice, os.environ, os.getpid())
    if planned is None:
        settle()
        return
    name, env = planned
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
    except OSError as exc:
        log.warning("could not re-execute with %s preloaded (%s); staying on the system allocator", name, exc)


def settle() -> None:
    """In the re-executed process: restore LD_PRELOAD and drop the markers, so children are not handed the
    library (it stays loaded here)."""
    if os.environ.get(REEXEC_ENV) != str(os.getpid()):
        return
    before = os.environ.pop(PRELOAD_BEFORE_ENV, "")
    if before:
        os.environ["LD_PRELOAD"] = before
    else:
        os.environ.pop("LD_PRELOAD", None)
    del os.environ[REEXEC_ENV]


def in_use(maps: Path = Path("/proc/self/maps")) -> str:
    """The allocator this process really runs on: ``tcmalloc`` / ``jemalloc`` when its library is mapped (a
    preload the dynamic loader ignored does not count), else ``glibc`` (``system`` where /proc is absent)."""
    try:
        mapped = maps.read_text()
    except OSError:
        return "system"
    for name, soname in ALLOCATOR_LIBRARIES.items():
        if soname.rsplit(".so", 1)[0] + ".so" in mapped:
            return name
    return "glibc"
