"""Routing around a mass sink (docs/design.md#byzantine-robust-receive-rule): a neighbour that takes this peer's
push-sum mass and returns none drains the honest peers' weight (an insider that received and never sent took the
sum w of three honest daemons from 3.0 to 0.17 in 100 s). Pure: rounds come from the caller, no clock, no sockets.

A neighbour that :class:`~peer.gossip.robust.ReceiveGuard` flags a sink (the schedule had it send to this peer in
``sink_rounds`` rounds and nothing of it was applied) and that took some of this peer's mass meanwhile (an Ack or a
handshake settled a message to it as applied) is left out of this peer's schedule - not quarantined and not charged.
A silent neighbour that took nothing is down, cut off or restarting: what is sent to it waits in flight, so it
drains nothing, and routing around it would only keep it out of the schedule once it is back, while it, silent on
this side too, routes around this peer in turn (in a netns fault run the 1 Mbit/s-capped peer and a neighbour did:
the idle edge held the capped peer's stale messages in flight until after the fleet had converged, and settling them
moved the survivors 0.17% apart). It is let back in

- as soon as one of its messages is applied (:meth:`SinkRoute` is dropped by the guard),
- when this peer's view of the live set changes (what the schedule expected of it was computed over the old view;
  :meth:`peer.gossip.robust.ReceiveGuard.expect_from`), and
- for a probe after a backoff: from round ``probe_at`` on it is in the schedule again until this peer actually sent
  it a message (the probe), and the next probe comes ``backoff`` rounds after that, the backoff doubling up to
  ``backoff_cap`` while it stays silent. A neighbour whose own schedule never sends to this peer (its view of the
  live set differs; it routes around this peer in turn) hears from it then, applies the probe, lets this peer back
  in and sends to it, which lets it back in here: two peers that each went quiet for the other are never cut off
  from each other for good.

Nothing is dropped: a routed-around neighbour is just not sent to, so the mass this peer keeps stays its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: Event kinds the guard reports (the driver logs each once).
ROUTED = "routed_around"
LET_BACK = "let_back"


@dataclass
class SinkRoute:
    """How one neighbour flagged a sink is routed around.

    Attributes:
        since: the round this peer started routing around it.
        backoff: rounds between the probe that goes out next and the one after it.
        probe_at: the round from which the next probe is due (it is in the schedule from then until a message to
            it went out).
    """

    since: int
    backoff: int
    probe_at: int

    @classmethod
    def start(cls, round_index: int, backoff: int) -> SinkRoute:
        """Routed around from ``round_index``, first probed ``backoff`` rounds later."""
        return cls(since=round_index, backoff=backoff, probe_at=round_index + backoff)

    def excluded(self, round_index: int) -> bool:
        """Whether the neighbour is left out of the schedule in ``round_index`` (False: a probe is due)."""
        return round_index < self.probe_at

    def probed(self, round_index: int, cap: int) -> None:
        """A message went to it in ``round_index`` while a probe was due: the next one is ``backoff`` rounds later,
        and the backoff after that doubled (at most ``cap``)."""
        if round_index >= self.probe_at:
            self.probe_at = round_index + self.backoff
            self.backoff = min(2 * self.backoff, cap)

    def to_list(self) -> list[int]:
        """Checkpoint form (plain ints: torch's weights-only loader reads them)."""
        return [self.since, self.backoff, self.probe_at]

    @classmethod
    def from_list(cls, data: Any) -> SinkRoute:
        since, backoff, probe_at = (int(v) for v in data)
        return cls(since, backoff, probe_at)


@dataclass(frozen=True)
class RouteEvent:
    """A neighbour routed around or let back in, for the log.

    Attributes:
        neighbour: its peer id.
        kind: :data:`ROUTED` or :data:`LET_BACK`.
        round: this peer's round when it happened.
        since: the round the routing started (for :data:`LET_BACK`: how long it lasted).
        next_probe: for :data:`ROUTED`, the round the first probe is due.
        silent_rounds: for :data:`ROUTED`, the rounds the schedule had it send to this peer with nothing applied.
        why: for :data:`LET_BACK`, what let it back in.
    """

    neighbour: str
    kind: str
    round: int
    since: int
    next_probe: int = 0
    silent_rounds: int = 0
    why: str = "one of its messages was applied"
