"""How fast a daemon may run against the neighbours it sends to: at most ``node.max_unacked`` messages
unacknowledged on an edge before its next round waits (up to ``node.pace_wait_s``) for that neighbour
(docs/decisions/daemon-lifecycle.md#rounds-paced-to-the-receivers).

Why: a daemon runs its rounds back to back while messages arrive, and a receiver acknowledges at its own round
boundaries (gate.py). Bounded only by the exactly-once window (32 messages or 8 MiB per edge), a fast daemon ran
far ahead of a lagging one: on the README fleet's two cores (4 daemons, dense SGP) one pair of daemons ran 60 rounds
in the 2.7 s in which the other pair ran 5, push-sum weights swung from 3.5 to 1e-4 (a peer whose weight has gone
to nothing throws its own gradient steps away with the next message it applies), the daemons ended up to 2.3 s
apart - the last ones training alone - and the int8 fleets, whose rounds are shortest, ended 1-2 points under fp32.
As acks come at the receiver's round boundaries, at most ``max_unacked`` unacknowledged messages means at most that
many of this peer's rounds per round of each neighbour it sends to. Waiting costs a fast daemon nothing it would
have used well: on a shared host it hands the CPU to the daemons it waits for, and on separate devices its extra
rounds would only have been mixed with stale models.

A neighbour that does not acknowledge within ``pace_wait_s`` (down, cut off, restarting, or far slower) is not
waited for again until it acknowledges something: a dead link costs one wait, not one per round. Nor is it sent more
than ``max_unacked`` messages meanwhile (:class:`PacedTransport`): the rounds go on keeping its share, as for a link
that is down, instead of piling the window's 8 MiB into a slow link's queue - where, under one shared 10 Mbit/s link,
dense SGP's messages waited so long that no ack came back for the rest of the run and push-sum weights starved
(bench/RESULTS-netns.md). Pure policy on counts the caller reads from the peer's ledger; the event loop is the
caller's.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

from peer.gossip.engine import OutMessage
from peer.runtime.round import SettleReport, Transport

__all__ = ["NeighbourPace", "PaceWait", "PacedTransport"]


@dataclass
class PaceWait:
    """What one wait before a round did: seconds waited, and the neighbours given up on (now exempt)."""

    waited_s: float = 0.0
    given_up: list[str] = field(default_factory=list)


class NeighbourPace:
    """Paces this peer's rounds to the neighbours it sends to.

    Args:
        max_unacked: messages this peer may have unacknowledged on one edge before its next round waits for the
            receiver: at most this many of its rounds per round of that receiver. 0 = no bound (only the
            exactly-once window). 1 (``lpdl-peer fleet``'s) runs a fleet near lockstep, every round waiting for a
            receiver's boundary and an ack's round trip: on the README fleet's shared cores that cost no time and
            kept push-sum weights above 0.2 (at 4, rounds drifted 21 apart around the ring and weights sank to
            0.004; bench/RESULTS-fleet.md). More leaves a fast peer room for a slow neighbour's round; where
            devices differ in speed, the bound holds a fast one to that many of its rounds per round of the
            slowest peer it sends to.
        wait_s: the longest one round waits (seconds). A neighbour still lagging after it is exempt until it
            acknowledges again.
    """

    def __init__(self, max_unacked: int, wait_s: float) -> None:
        if max_unacked < 0:
            raise ValueError(f"max_unacked must be >= 0, got {max_unacked}")
        if wait_s < 0:
            raise ValueError(f"wait_s must be >= 0, got {wait_s}")
        self.max_unacked = max_unacked
        self.wait_s = wait_s
        self.exempt: set[str] = set()
        self.waited_s_total = 0.0
        self._acked = asyncio.Event()

    def acked(self, receiver: str) -> None:
        """``receiver`` acknowledged something (called on the event loop): it is waited for again if it was
        exempt, and a waiting round wakes."""
        self.exempt.discard(receiver)
        self._acked.set()

    def lagging(self, in_flight: Mapping[str, int], receivers: Collection[str]) -> list[str]:
        """The ``receivers`` this peer is too far ahead of (``in_flight``: unacknowledged messages per receiver),
        sorted; a receiver back under the bound is no longer exempt either."""
        if self.max_unacked == 0:
            return []
        behind = {r for r in receivers if in_flight.get(r, 0) >= self.max_unacked}
        self.exempt &= behind
        return sorted(behind - self.exempt)

    async def wait(self, in_flight: Callable[[], Mapping[str, int]], receivers: Collection[str],
                   waiting: Callable[[bool], None] = lambda _: None) -> PaceWait:
        """Wait until no receiver lags (each ack re-reads ``in_flight``), at most :attr:`wait_s`; the ones still
        lagging then become exempt. ``waiting(True)`` is called as a wait begins and ``waiting(False)`` as it ends:
        the daemon acknowledges at once meanwhile (gate.py), or two peers that send to each other would each hold
        back the acks the other waits for."""
        report = PaceWait()
        self._acked.clear()  # before reading the counts: an ack after the read still wakes the wait below
        lagging = self.lagging(in_flight(), receivers)
        if not lagging:
            return report
        started = time.monotonic()
        deadline = started + self.wait_s
        waiting(True)
        try:
            while lagging:
                left = deadline - time.monotonic()
                if left <= 0:
                    self.exempt.update(lagging)
                    report.given_up = lagging
                    break
                try:
                    await asyncio.wait_for(self._acked.wait(), left)
                except asyncio.TimeoutError:
                    pass
                self._acked.clear()
                lagging = self.lagging(in_flight(), receivers)
        finally:
            waiting(False)
        report.waited_s = time.monotonic() - started
        self.waited_s_total += report.waited_s
        return report


class PacedTransport:
    """The daemon's :class:`~peer.runtime.round.Transport` for its rounds: the gRPC transport, less the edges that
    already carry ``max_unacked`` unacknowledged messages (their share stays with the sender, as for a link that is
    down). ``in_flight(receiver)``: the messages sent to it and not yet settled (the peer's ledger)."""

    def __init__(self, inner: Transport, in_flight: Callable[[str], int], max_unacked: int) -> None:
        self.inner = inner
        self.in_flight = in_flight
        self.max_unacked = max_unacked

    def ready(self, sender: str, receivers: Sequence[str]) -> set[str]:
        up = self.inner.ready(sender, receivers)
        if self.max_unacked == 0:
            return up
        return {r for r in up if self.in_flight(r) < self.max_unacked}

    def submit(self, messages: Sequence[OutMessage]) -> None:
        self.inner.submit(messages)

    def notify(self, sender: str, receivers: Collection[str], quarantined: Sequence[str]) -> None:
        self.inner.notify(sender, receivers, quarantined)

    def probe(self, sender: str, receivers: Collection[str], sketch: bytes, round_index: int) -> None:
        self.inner.probe(sender, receivers, sketch, round_index)

    async def settle(self, timeout_s: float) -> SettleReport:
        return await self.inner.settle(timeout_s)
