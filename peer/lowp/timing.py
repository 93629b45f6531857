"""Side-by-side timing of contenders on one machine: what the kernel probe (probe.py, plan.py) and the fused passes'
compiled-vs-eager choice (passes.py) decide by."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import torch

DEFAULT_REPS = 5  # timed runs per contender after one warm-up; the fastest counts (robust to load on shared cores)


def fastest_times(thunks: Mapping[str, Callable[[], object]], device: torch.device,
                  reps: int = DEFAULT_REPS, one_thread: bool = True) -> dict[str, float]:
    """Fastest wall time (ms) of each thunk, run interleaved after a warm-up run, on ONE thread by default.

    One thread: per-core kernel speed is what is compared; multi-thread barriers on cores shared with other work
    made ratios swing by tens of x. Interleaving exposes all contenders to the same background load. With
    ``one_thread=False`` the thread count is left as it is (what is timed then runs as in production, and the
    process-wide setting is not touched from a thread other than the one that made it).
    """
    best = {name: float("inf") for name in thunks}
    threads = torch.get_num_threads()
    if one_thread:
        torch.set_num_threads(1)
    try:
        for rep in range(reps + 1):
            for name, fn in thunks.items():
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                start = time.perf_counter()
                fn()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if rep:
                    best[name] = min(best[name], (time.perf_counter() - start) * 1e3)
    finally:
        if one_thread:
            torch.set_num_threads(threads)
    return best
