"""Stopping asyncio tasks for sure.

``task.cancel()`` is a request, not a guarantee: on Python 3.11 ``asyncio.wait_for`` returns the inner result and
drops the cancellation when the inner future finished in the same loop turn (fixed in 3.12), and a library may
catch a ``CancelledError`` it raised itself. A task that loses its one cancellation runs on, and whoever awaits it
waits forever (an edge's close hung this way once in a full test run: the cancel landed in a handshake's
``wait_for`` as the reply arrived, and the task went on to serve a stream nobody would close). So every stop in the
daemon cancels again until the task is done."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

RECANCEL_AFTER_S = 0.5
"""Seconds to wait for a cancelled task before cancelling it again: long enough for a clean-up (a final write, a
gather of sub-tasks) to finish between requests, short enough that a lost cancellation costs a stop well under a
second."""


async def cancel_and_wait(tasks: Iterable[asyncio.Future[Any]],
                          recancel_after_s: float = RECANCEL_AFTER_S) -> None:
    """Cancel ``tasks`` and wait until every one is done, cancelling again each ``recancel_after_s`` seconds any
    that is still running. Their results and exceptions are left on the tasks (retrieved, so none is logged as
    never retrieved)."""
    tasks = list(tasks)
    pending = {task for task in tasks if not task.done()}
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=recancel_after_s)
    for task in tasks:
        if not task.cancelled():
            task.exception()
