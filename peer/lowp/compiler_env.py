"""Inductor's on-disk cache, one per CPU, for the compiled quantization passes (passes.py).

Inductor's FX graph cache key includes neither the vector ISA it generated code for nor the host's instruction set
(it compiles with ``-march=native``), so a cache shared across CPUs (an NFS home, a volume mounted into containers on
different hosts, an ``ATEN_CPU_CAPABILITY`` restricted process) could hand AVX-512 code to a CPU without it. Unless
the user set ``TORCHINDUCTOR_CACHE_DIR``, the cache lives in a subdirectory of inductor's default named after the ISA,
a hash of the CPU's flags and the code generator patches in force (torch_patches.py). Set once per process, before
the first pass is compiled. History: docs/decisions/lowp-passes.md.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

from peer.lowp.torch_patches import codegen_tag

_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
_OWN_NAME = re.compile(r"[A-Za-z0-9_]+-[0-9a-f]{12}")  # per_cpu_cache_dir's subdirectory names


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The first CPU's feature flags line (what ``-march=native`` code depends on), '' where not readable."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


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
