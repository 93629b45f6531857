"""Ending the daemon's process once its own shutdown is complete, without the C library's exit handlers.

Why: a process that imported torch from the CUDA wheel (what ``pip install torch`` gives on x86_64 and what Jetson
images ship) runs the static destructors of the CUDA libraries on exit even when it never used a GPU, and
libcublasLt's page in ~110 MiB of the library: measured on this project's CPU machines (torch 2.14.1+cu130, AMD
EPYC), a bare ``python -c "import torch"`` peaks at 631 MiB while exiting against 521 MiB alive, and a solo daemon
at 804 MiB against 693 MiB (VmHWM polled every 30 ms; ``perf record -e page-faults`` puts the faults in
libcublasLt's exit handlers). On a 2 GB board, or under a systemd ``MemoryMax=``, that peak is what gets the
daemon killed - after its checkpoint, but still reported as a failure.

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
