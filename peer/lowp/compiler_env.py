"""Inductor's on-disk cache, one per CPU, for the compiled quantization passes (passes.py), shared by every process
of the host: the first one to need a graph compiles it under a file lock, the others wait and load it.

Inductor's FX graph cache key includes neither the vector ISA it generated code for nor the host's instruction set
(it compiles with ``-march=native``), so a cache shared across CPUs (an NFS home, a volume mounted into containers on
different hosts, an ``ATEN_CPU_CAPABILITY`` restricted process) could hand AVX-512 code to a CPU without it. Unless
the user set ``TORCHINDUCTOR_CACHE_DIR``, the cache lives in a subdirectory of inductor's default named after the ISA,
a hash of the CPU's flags and the code generator patches in force (torch_patches.py). Set once per process, before
the first pass is compiled.

N daemons starting together on one host would otherwise all miss the cache at once and each generate every kernel
(about 1 s of CPU per graph, 40+ graphs for the MNIST CNN): :func:`graph_lock` serialises the compilation of one
graph across processes, so it is generated once and loaded by the rest. History: docs/decisions/lowp-passes.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
from pathlib import Path

from peer.lowp.host_lock import host_lock
from peer.lowp.torch_patches import codegen_tag

_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
_LOCKS = "lpdl-graph-locks"  # subdirectory of the cache directory: one lock file per graph
#: Seconds a process waits for another one's compilation of the same graph before compiling it itself (a compile
#: takes 1-10 s; a holder that died releases its lock at once).
LOCK_WAIT_S = 600.0
_OWN_NAME = re.compile(r"[A-Za-z0-9_]+-[0-9a-f]{12}")  # per_cpu_cache_dir's subdirectory names


def cpuinfo_field(names: tuple[str, ...], cpuinfo: str = "/proc/cpuinfo") -> str:
    """The first CPU's value of the first /proc/cpuinfo line starting with one of ``names`` ('' where none)."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith(names):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The first CPU's feature flags line (what ``-march=native`` code depends on), '' where not readable."""
    return cpuinfo_field(("flags", "Features"), cpuinfo)


def per_cpu_cache_dir(isa: str, flags: str) -> str:
    """Inductor's default cache directory with a subdirectory for this vector ISA, CPU flag set and the code
    generator patches in force (the cache key does not see them)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    digest = hashlib.sha256(f"{flags} {codegen_tag()}".encode()).hexdigest()[:12]
    name = re.sub(r"[^A-Za-z0-9_]+", "_", isa) or "scalar"  # the path goes into compiler command lines
    return str(Path(default_cache_dir()) / f"{name}-{digest}")


def use_per_cpu_cache() -> tuple[str, str]:
    """Point inductor's cache at :func:`per_cpu_cache_dir` unless the user set ``TORCHINDUCTOR_CACHE_DIR``; returns
    (the vector ISA inductor generates CPU code for here: "avx512", "avx2", "asimd", ... or "" for none, the cache
    directory). Importing inductor sets the variable to its default directory, so that value counts as unset, and so
    does one of this function's own directories inherited from a parent process."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    picked = pick_vec_isa()
    isa = str(picked) if picked else ""
    default = os.path.abspath(default_cache_dir())
    current = os.path.abspath(os.environ[_CACHE_ENV]) if os.environ.get(_CACHE_ENV) else ""
    # ours when inherited from a parent process that set it: recomputed, the child may run another ISA
    ours = bool(current) and os.path.dirname(current) == default and _OWN_NAME.fullmatch(os.path.basename(current))
    if current in ("", default) or ours:
        os.environ[_CACHE_ENV] = per_cpu_cache_dir(isa, cpu_flags())
    return isa, os.environ[_CACHE_ENV]


def _cache_dir() -> Path:
    """The inductor cache directory in force (this process's per-CPU one once :func:`use_per_cpu_cache` ran)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir())


def graph_lock(key: str, wait_s: float = LOCK_WAIT_S) -> contextlib.AbstractContextManager[bool]:
    """Hold the host-wide lock of graph ``key`` (any string naming the graph and its inputs) for its compilation;
    yields whether it is held. A process that finds it taken waits, then finds the graph in the on-disk cache. After
    ``wait_s`` (a holder stuck compiling) or where no lock file can be made (a read-only cache) it compiles without
    the lock: the same graph, compiled twice at worst."""
    digest = hashlib.sha256(key.encode()).hexdigest()[:32]
    return host_lock(_cache_dir() / _LOCKS / f"{digest}.lock", wait_s, f"graph {digest}")
