"""When the int8 passes are compiled at all: an operator's switch and the memory this process may use.

Why: torch.compile's stack (dynamo, inductor, sympy, the generated kernels) stays resident, +180-240 MiB per process
measured on a solo mnist-cnn daemon (bench/RESULTS-fleet.md) - a tenth of a 2 GB board - for rounds about 2x shorter.
"""

from __future__ import annotations

import os

#: 1: skip torch.compile; 0: compile even on a small machine (README "Precision on this machine").
ENV_EAGER = "LPDL_LOWP_EAGER"
#: Below this much memory (MiB) the passes run eagerly unless LPDL_LOWP_EAGER=0.
COMPILE_MIN_MEMORY_MIB = 4096
#: Where compiled pass graphs come from (aot_graphs.py): unset or 0, inductor just in time in the process; AOT_INLINE,
#: the host's ahead-of-time store, a missing graph compiled by the process that needs it; AOT_BACKGROUND, the store,
#: a missing graph run eagerly while a background process compiles it (the daemon's default: peer/cli/start.py).
ENV_AOT = "LPDL_LOWP_AOT"
AOT_INLINE = "1"
AOT_BACKGROUND = "background"


def physical_memory_mib(meminfo: str = "/proc/meminfo", cgroup: str = "/proc/self/cgroup",
                        cgroup_root: str = "/sys/fs/cgroup") -> float:
    """Memory this process may use (MiB): MemTotal, or its cgroup's limit where lower (a systemd unit's MemoryMax=,
    a container's limit): memory.max under cgroup v2, memory.limit_in_bytes under v1's memory controller (Jetson's
    L4T and older distributions mount v1; its "no limit" is a number far above any MemTotal). 0 where unknown (not
    Linux)."""
    total = 0.0
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    total = int(line.split()[1]) / 1024
                    break
    except OSError:
        return total
    for limit_path in _cgroup_limit_files(cgroup, cgroup_root):
        try:
            with open(limit_path) as f:
                limit = f.read().strip()
        except OSError:
            continue
        if limit.isdigit():
            total = min(total, int(limit) / 2**20) if total else int(limit) / 2**20
    return total


def _cgroup_limit_files(cgroup: str, cgroup_root: str) -> list[str]:
    """The files that may hold this process's cgroup memory limit: v2's ``0::PATH`` line, v1's memory controller
    line, and the mounts' roots (a v1 container without its own cgroup namespace - Docker's default there - sees
    its cgroup mounted at the root while /proc/self/cgroup names the host's path). A limit set only on a parent
    cgroup (a slice) is not read."""
    files = [os.path.join(cgroup_root, "memory.max"), os.path.join(cgroup_root, "memory", "memory.limit_in_bytes")]
    try:
        with open(cgroup) as f:
            lines = [line.strip().split(":", 2) for line in f]
    except OSError:
        return files
    for fields in lines:
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        if controllers == "":
            files.append(os.path.join(cgroup_root, path.lstrip("/"), "memory.max"))
        elif "memory" in controllers.split(","):
            files.append(os.path.join(cgroup_root, "memory", path.lstrip("/"), "memory.limit_in_bytes"))
    return files


def operator_eager_reason() -> str | None:
    """Why the operator's switch makes this process run the passes eagerly (LPDL_LOWP_EAGER=1), or None."""
    forced = os.environ.get(ENV_EAGER, "")
    return f"{ENV_EAGER} set" if forced not in ("", "0") else None


def small_memory_reason() -> str | None:
    """Why this process may not compile for its memory (below COMPILE_MIN_MEMORY_MIB, unless LPDL_LOWP_EAGER=0), or
    None. A process that only loads stored graphs (background mode) runs them anyway: no compiler in the process."""
    if os.environ.get(ENV_EAGER, "") == "0":
        return None
    memory = physical_memory_mib()
    if 0 < memory < COMPILE_MIN_MEMORY_MIB:
        return (f"{memory:.0f} MiB of memory: the compiler's ~200 MiB per process is not spent below "
                f"{COMPILE_MIN_MEMORY_MIB} MiB ({ENV_EAGER}=0 compiles anyway)")
    return None
