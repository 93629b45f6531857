"""``asyncio.run`` with a watchdog: when a test's event loop outlives a bound, every task's stack and every
thread's go to stderr, so that a hang seen once in a full run (and not reproduced alone) says which coroutine
waited on what. The timer lives on the loop until it closes: a hang in ``asyncio.run``'s own clean-up (cancelling
the tasks left over) is caught too."""

from __future__ import annotations

import asyncio
import faulthandler
import sys
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def dump_tasks(after_s: float) -> None:
    """Print the stack of every task of the running loop and of every thread (stderr)."""
    print(f"\n--- event loop still running after {after_s:.0f} s: its tasks ---", file=sys.stderr)
    for task in asyncio.all_tasks():
        print(repr(task), file=sys.stderr)
        task.print_stack(file=sys.stderr)
    print("--- threads ---", file=sys.stderr)
    faulthandler.dump_traceback(file=sys.stderr)
    sys.stderr.flush()


def run_watched(main: Coroutine[Any, Any, T], dump_after_s: float) -> T:
    """``asyncio.run(main)``; if the loop still runs ``dump_after_s`` seconds later, dump its tasks (once)."""
    async def watched() -> T:
        asyncio.get_running_loop().call_later(dump_after_s, dump_tasks, dump_after_s)
        return await main

    return asyncio.run(watched())
