"""cancel_and_wait stops a task that loses or swallows its first cancellation (an edge's close once hung on one)."""

from __future__ import annotations

import asyncio

from peer.aio import cancel_and_wait


async def _swallows_first_cancel(stopped: list[str]) -> None:
    """Like a call that catches the CancelledError it raised itself: the first request is lost."""
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        stopped.append("swallowed")
    await asyncio.sleep(3600)


def test_a_task_that_swallows_its_first_cancellation_is_stopped() -> None:
    async def main() -> tuple[list[str], bool]:
        stopped: list[str] = []
        task = asyncio.ensure_future(_swallows_first_cancel(stopped))
        await asyncio.sleep(0)
        await asyncio.wait_for(cancel_and_wait([task], recancel_after_s=0.05), 5)
        return stopped, task.cancelled()

    stopped, cancelled = asyncio.run(main())
    assert stopped == ["swallowed"] and cancelled


def test_a_cancellation_that_wait_for_drops_is_repeated() -> None:
    """The race behind the hang: the cancel arrives in the loop turn the awaited future completes. Python 3.11's
    wait_for then returns the result and the task runs on; cancel_and_wait still stops it."""
    async def main() -> tuple[bool, bool]:
        inner: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        went_on = asyncio.Event()

        async def handshake_then_serve() -> None:
            await asyncio.wait_for(inner, 10)
            went_on.set()  # reached only if the cancellation was lost
            await asyncio.sleep(3600)

        task = asyncio.ensure_future(handshake_then_serve())
        await asyncio.sleep(0.01)
        inner.set_result(1)
        await asyncio.wait_for(cancel_and_wait([task], recancel_after_s=0.05), 5)
        return went_on.is_set(), task.cancelled()

    _, cancelled = asyncio.run(main())
    assert cancelled


def test_results_and_errors_of_finished_tasks_are_kept() -> None:
    async def main() -> tuple[int, str]:
        async def fails() -> None:
            raise ValueError("boom")

        done = asyncio.ensure_future(asyncio.sleep(0, result=7))
        failed = asyncio.ensure_future(fails())
        await asyncio.sleep(0.01)
        await cancel_and_wait([done, failed])
        return done.result(), str(failed.exception())

    assert asyncio.run(main()) == (7, "boom")
