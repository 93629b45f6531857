"""The background process that fills a host's store of ahead-of-time pass graphs (aot_queue.py says why):
``python -m peer.lowp.aot_fill STORE``.

It holds the store's filler lock (a second one exits at once, before importing torch), lowers itself to SCHED_IDLE
(nice 19 where that is refused), compiles every request, oldest first, with the store's own compile under each
graph's host-wide lock, and looks at the queue again before it exits, after giving up the lock, so that a request
written meanwhile is not stranded. A request that fails to compile is set aside with its reason (a missing C++
compiler: every one fails, once).
"""

from __future__ import annotations

import logging
import os
import sys
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


def fill(directory: Path) -> int:
    """Compile every request of the store at ``directory`` (while holding its filler lock); the graphs compiled, or
    0 where another filler holds the lock."""
    done = 0
    while True:
        fd = try_filler_lock(directory)
        if fd is None:
            return done
        try:
            if pending(directory):  # torch imported only where there is work
                done += _drain(directory)
        finally:
            os.close(fd)
        if not pending(directory):
            return done


def _drain(directory: Path) -> int:
    import torch

    from peer.lowp.aot_graphs import AotGraphs

    torch.set_num_threads(1)
    store = AotGraphs(directory)
    done = 0
    while requests := pending(directory):
        for request in requests:
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
