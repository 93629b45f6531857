"""A daemon's rounds paced to the neighbours it sends to (peer/daemon/pace.py): the policy on its own, and two real
daemons where one runs its rounds many times slower than the other."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import pytest

from peer.daemon.pace import NeighbourPace, PacedTransport
from tests.daemon_helpers import kill_all, static_fleet


def test_lagging_names_the_receivers_at_or_over_the_bound() -> None:
    pace = NeighbourPace(max_unacked=3, wait_s=1.0)
    assert pace.lagging({"a": 3, "b": 2, "c": 7}, ["a", "b", "c", "d"]) == ["a", "c"]
    assert pace.lagging({"a": 3}, ["b"]) == []  # only the receivers asked about
    assert NeighbourPace(max_unacked=0, wait_s=1.0).lagging({"a": 32}, ["a"]) == []  # 0: no bound


def test_a_wait_ends_at_the_ack_that_brings_the_receiver_back_under_the_bound() -> None:
    counts = {"a": 5}

    async def scenario() -> tuple[float, list[str], int]:
        pace = NeighbourPace(max_unacked=4, wait_s=30.0)

        async def receiver_catches_up() -> None:
            for left in (4, 3):  # the first ack leaves it at the bound: still waited for
                await asyncio.sleep(0.05)
                counts["a"] = left
                pace.acked("a")

        task = asyncio.create_task(receiver_catches_up())
        report = await pace.wait(lambda: dict(counts), ["a"])
        await task
        return report.waited_s, report.given_up, counts["a"]

    waited_s, given_up, left = asyncio.run(scenario())
    assert given_up == [] and left == 3  # it returned once the count fell under 4, not at the 30 s cap
    assert 0 < waited_s < 30.0


def test_a_receiver_that_never_acknowledges_costs_one_wait_until_it_does() -> None:
    counts = {"dead": 9, "live": 0}

    async def scenario() -> None:
        pace = NeighbourPace(max_unacked=4, wait_s=0.05)
        first = await pace.wait(lambda: dict(counts), ["dead", "live"])
        assert first.given_up == ["dead"] and first.waited_s >= 0.05
        assert pace.exempt == {"dead"}
        again = await pace.wait(lambda: dict(counts), ["dead", "live"])
        assert again.given_up == [] and again.waited_s == 0.0  # exempt: not waited for again
        counts["dead"] = 1  # it acknowledged: no longer exempt
        assert pace.lagging(dict(counts), ["dead"]) == [] and pace.exempt == set()
        counts["dead"] = 6  # and lagging once more: waited for once more
        third = await pace.wait(lambda: dict(counts), ["dead"])
        assert third.given_up == ["dead"]
        pace.acked("dead")  # an ack, even one that leaves it over the bound (a slow link): waited for again
        assert pace.exempt == set()
        fourth = await pace.wait(lambda: dict(counts), ["dead"])
        assert fourth.given_up == ["dead"] and fourth.waited_s >= 0.05
        assert pace.waited_s_total >= 0.15

    asyncio.run(scenario())


def test_the_daemon_is_told_while_a_wait_lasts_and_only_then() -> None:
    calls: list[bool] = []

    async def scenario() -> None:
        pace = NeighbourPace(max_unacked=2, wait_s=0.05)
        await pace.wait(lambda: {"a": 1}, ["a"], calls.append)  # not lagging: no wait, no call
        assert calls == []
        await pace.wait(lambda: {"a": 2}, ["a"], calls.append)
        assert calls == [True, False]  # acks go at once while it waits (gate.wait_between_rounds)

    asyncio.run(scenario())


class _Links:
    """A transport whose links to a, b and c are up (d's is down)."""

    def ready(self, sender: str, receivers: list[str]) -> set[str]:
        return {r for r in receivers if r != "d"}


def test_the_rounds_send_no_more_than_the_bound_to_a_neighbour() -> None:
    counts = {"a": 3, "b": 4, "c": 9, "d": 0}
    paced = PacedTransport(_Links(), counts.__getitem__, max_unacked=4)  # type: ignore[arg-type]
    assert paced.ready("me", ["a", "b", "c", "d"]) == {"a"}  # b and c carry 4 or more; d's link is down
    counts["b"] = 3
    assert paced.ready("me", ["a", "b"]) == {"a", "b"}
    unbounded = PacedTransport(_Links(), counts.__getitem__, max_unacked=0)  # type: ignore[arg-type]
    assert unbounded.ready("me", ["a", "c", "d"]) == {"a", "c"}


@pytest.mark.parametrize("bad", [{"max_unacked": -1, "wait_s": 1.0}, {"max_unacked": 4, "wait_s": -0.5}])
def test_a_negative_bound_or_wait_is_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="max_unacked|wait_s"):
        NeighbourPace(**bad)  # type: ignore[arg-type]


def _rounds_over(fast, slow, slow_rounds: int) -> tuple[int, int]:
    """Rounds the fast and the slow daemon each ran while the slow one ran ``slow_rounds``."""
    start_fast, start_slow = fast.status()["round"], slow.status()["round"]
    slow.wait_round(start_slow + slow_rounds, timeout_s=60)
    return fast.status()["round"] - start_fast, slow.status()["round"] - start_slow


@pytest.mark.slow
@pytest.mark.parametrize("max_unacked", [1, 0])
def test_a_fast_daemon_keeps_pace_with_a_slow_neighbour_and_goes_on_when_it_stops(tmp_path: Path,
                                                                                  max_unacked: int) -> None:
    """Two daemons gossiping with each other, one at 0.4 s a round (node.round_interval_s): paced at one message
    unacknowledged, the fast one runs the slow one's rounds; unpaced (0) it runs well beyond what pacing allows
    (at 0.2 s a round, on a 2-core host loaded by the namespace tests beside it, the "fast" daemon managed only
    2.4x the slow one's rounds). SIGSTOP on the slow one: the fast one waits once, logs it, and trains on."""
    flags = ["--dataset", "mnist5k", "--precision", "fp32", "--algorithm", "sgp", "--compression", "0"]
    fast, slow = static_fleet(tmp_path, 2, flags, launch=False, eval_every=1000, checkpoint_every=1000,
                              extra=["--max-unacked", str(max_unacked), "--pace-wait", "1.0"])
    slow.argv += ["--round-interval", "0.4"]
    try:
        for d in (fast, slow):
            d.start()
        for d in (fast, slow):
            d.wait_ready()
        slow.wait_status(lambda s: s["neighbours"].get(fast.peer_id, {}).get("delivered", 0) > 0, 60,
                         "delivering to the fast daemon")
        fast.wait_status(lambda s: s["neighbours"].get(slow.peer_id, {}).get("delivered", 0) > 0, 60,
                         "delivering to the slow daemon")
        ran_fast, ran_slow = _rounds_over(fast, slow, 10)
        if max_unacked == 0:
            # unbounded: the window alone lets it run on, far past the paced bound below (ran_slow + 2)
            assert ran_fast > 2 * ran_slow + 2, (ran_fast, ran_slow)
            return
        assert ran_fast <= max_unacked * ran_slow + 2, (ran_fast, ran_slow)
        assert fast.status()["pace_wait_s"] > 0
        assert slow.proc is not None
        slow.proc.send_signal(signal.SIGSTOP)
        try:
            fast.wait_log(rf"{slow.peer_id} acknowledged nothing in 1.0 s .*not waiting for it again", 30)
            before = fast.status()["round"]
            time.sleep(1.5)
            status = fast.status()
            assert status["round"] > before + 5  # exempt: it trains on at its own pace
            assert status["not_waited_for"] == [slow.peer_id]
        finally:
            slow.proc.send_signal(signal.SIGCONT)
        # back: once its acks bring the edge under the bound it is waited for again
        fast.wait_status(lambda s: s["not_waited_for"] == [], 60, "waiting for the slow daemon again")
    finally:
        kill_all([fast, slow])
