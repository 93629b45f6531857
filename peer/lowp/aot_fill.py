"""The background process that fills a host's store of ahead-of-time pass graphs (aot_queue.py says why):
``python -m peer.lowp.aot_fill STORE``.

It holds the store's filler lock (a second one exits at once, before importing torch), lowers itself to SCHED_IDLE
(nice 19 where that is refused), waits before each graph until a core has been idle (SCHED_IDLE alone still let
the first compiles slow a 4-daemon fleet on 2 cores to 1.5x its eager wall time: the compiler's memory traffic and
the header it builds first), compiles every request, oldest first, with the store's own compile under each
graph's host-wide lock, and looks at the queue again before it exits, after giving up the lock, so that a request
written meanwhile is not stranded. A request that fails to compile is set aside with its reason (a missing C++
compiler: every one fails, once).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

from peer.lowp.aot_queue import mark_failed, pending, try_filler_lock

log = logging.getLogger("peer.lowp.aot_fill")


def lowest_priority() -> None:
    """Run only on cores nobody else wants (children - the C++ compiler - inherit it)."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        try:
            os.nice(19)
        except OSError:
            pass


#: A graph is compiled only after a sample in which this many cores' worth of CPU time was idle.
SPARE_CORES = 0.8
#: Seconds of one idle sample (/proc/stat), and between samples while the machine is busy.
SAMPLE_S = 1.0
BUSY_WAIT_S = 2.0


def idle_cores(sample_s: float = SAMPLE_S, stat: Path = Path("/proc/stat")) -> float:
    """Cores' worth of CPU time idle over ``sample_s`` seconds (idle + iowait over all, times the core count); the
    core count where /proc/stat cannot be read (not Linux)."""
    def totals() -> tuple[int, int]:
        fields = [int(v) for v in stat.read_text().splitlines()[0].split()[1:]]
        return sum(fields), fields[3] + (fields[4] if len(fields) > 4 else 0)

    cores = float(os.cpu_count() or 1)
    try:
        total0, idle0 = totals()
        time.sleep(sample_s)
        total1, idle1 = totals()
    except (OSError, ValueError, IndexError):
        return cores
    return cores * (idle1 - idle0) / max(total1 - total0, 1)


def wait_for_spare_core(spare: float = SPARE_CORES) -> None:
    """Until a sample finds ``spare`` cores idle (a fleet on every core: until it ends)."""
    while idle_cores() < spare:
        time.sleep(BUSY_WAIT_S)


def fill(directory: Path) -> int:
    """Compile every request of the store at ``directory`` (while holding its filler lock); the graphs compiled, or
    0 where another filler holds the lock."""
    done = 0
    while True:
        fd = try_filler_lock(directory)
        if fd is None:
            return done
        try:
            if pending(directory):  # torch imported only where there is work, and a core to spare
                wait_for_spare_core()
                import torch

                torch.set_num_threads(1)  # one core: the filler takes only what the daemons leave
                done += compile_pending(directory)
        finally:
            os.close(fd)
        if not pending(directory):
            return done


def compile_pending(directory: Path, wait_for_idle: bool = True) -> int:
    """Compile every request of the store at ``directory`` until none is left (the caller holds its filler lock),
    each after a spare core where ``wait_for_idle`` (the background filler; ``lpdl-peer prepare`` compiles in the
    foreground); the graphs compiled."""
    import torch

    from peer.lowp.aot_graphs import AotGraphs

    store = AotGraphs(directory)
    done = 0
    while requests := pending(directory):
        for request in requests:
            if wait_for_idle:
                wait_for_spare_core()
            try:
                wanted = torch.load(request, weights_only=False)
                store.graph(wanted["fn"], tuple(wanted["args"]))
            except FileNotFoundError:
                continue  # another filler took it (a lock that could not be made)
            except Exception as exc:
                reason = f"{type(exc).__name__}: {str(exc)[:500]}"
                log.warning("request %s not compiled: %s", request.name, reason)
                mark_failed(request, reason)
                continue
            request.unlink(missing_ok=True)
            done += 1
    return done


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m peer.lowp.aot_fill STORE_DIRECTORY", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s")
    lowest_priority()
    directory = Path(argv[0])
    done = fill(directory)
    if done:
        log.info("%d pass graphs compiled into %s", done, directory)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
