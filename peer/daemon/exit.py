"""Ending the daemon's process once its own shutdown is complete, without the C library's exit handlers.

Why: a process that imported torch from the CUDA wheel runs the CUDA libraries' static destructors on exit even
when it never used a GPU, and they page in ~110 MiB: on a 2 GB board, or under a systemd ``MemoryMax=``, that peak
gets the daemon killed after its checkpoint (docs/decisions/hard-exit.md#the-cuda-libraries-exit-peak).

By the time ``hard_exit`` runs the daemon has settled its in-flight updates, written and fsynced its checkpoint,
closed its sockets and said goodbye on mDNS: nothing is left for the interpreter's finalization to do but free
memory. Python's own ``atexit`` handlers still run (logging flushes its handlers there), and the standard streams
are flushed; only the C-level exit handlers and the interpreter's teardown are skipped.
"""

from __future__ import annotations

import atexit
import os
import sys
from typing import NoReturn


def hard_exit(code: int) -> NoReturn:
    """Run Python's atexit handlers, flush stdout/stderr, then ``os._exit(code)``."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken pipe: nothing more can be written anyway
            pass
    os._exit(code)
