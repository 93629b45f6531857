"""Quarantine notices (docs/design.md#quarantine-notices): a peer that never hears from a neighbour cannot judge it,
so it learns from the peers that do - and every honest peer drops the insider from the schedule at one round, so
the graph they compute stays one graph. Pure: rounds and the schedule come from the caller, no clock, no sockets.

Why: on a directed or rotating graph some peers send to a neighbour that never sends to them (on the rotating
exponential graph of 8 peers, peer i sends to i+1, i+2 and i+4; only the i+4 edge runs both ways). When the peers
that hear from an insider quarantine it, those one-way senders cannot see anything wrong and keep giving it their
share every few rounds: mass that never comes back to an honest peer. Skipping the insider's edges (the share
kept) stops that, but the schedule still has it: on the exponential graph of 8, dense SGP sends half a peer's mass
to one neighbour a round, so every round one or two honest peers mixed nothing. Measured in the simulator (dense
SGP, skew 0.8, one insider, 2 epochs, 3 seeds): skipped edges 61.9% for every gross attack, 4.4 points under the
fleet whose insider left at round 4 (66.3%); the same offline insider kept in every schedule gave 62.1%. A peer
dropping it from its own schedule alone re-indexes an index-based graph under its neighbours' feet (an honest peer
expected neighbours that never sent, and routed around them as sinks). Hence an agreed exclusion.

The rule, both ends:

- A peer that quarantines neighbours tells, every ``notice_every`` rounds, every peer of the live set it sees
  except the quarantined: a QuarantineNotice naming every peer it quarantines now. Each notice replaces the
  notifier's earlier one; one that names nobody withdraws them. Its own notice counts in its own book as anyone's.
- Every peer computes the same set from the same notices: a suspect is excluded from the schedule (left out of the
  ids the graph is computed over; no share is sent to it, none expected from it) while every peer the schedule over
  the live set *with the suspect in it* has it send to (a peer can only report what it receives) named it in a
  notice of the last ``notice_ttl`` rounds before this one - at least ``notice_quorum`` of them, those excluded in
  the previous round neither counted nor waited for. One honest receiver of the suspect that sees nothing wrong is
  a veto, for every peer at once. A notice counts from the round after the one it arrived in (the notifier's own
  from the round after it went out): in synchronous rounds every peer then switches at the same round, and a
  daemon within a round or so of its neighbours (mass stays exact meanwhile: a message to a peer that dropped the
  sender from its schedule is still applied).
- Nothing else changes: a suspect is not quarantined by notices, its messages (it sends none to a peer that does
  not quarantine it, or that peer's own notice is missing and vetoes) are judged as any other's, and it is back in
  the schedule as soon as one of the notices it needs is no longer fresh or no longer names it (an operator
  released it at a notifier: the withdrawal goes out at once; a notifier left the fleet or went silent: its notice
  expires ``notice_ttl`` of the receiver's rounds after it arrived). A suspect never excludes itself.

Limits. The ttl counts the receiver's rounds and notices go every ``notice_every`` of the notifier's: a receiver
running rounds 4 times faster than its notifiers lets a suspect back in between two notices (the defaults leave that
margin; daemons of one fleet run rounds at about one pace). A notifier that ended its final consensus phase sends no
more notices. On a directed ring a suspect sends to one peer only: that one's notice excludes it at the default
quorum of 1 (with a quorum of 2 notices never acted there, and the suspect's sender fed it for good). Notices
are not checkpointed: a restarted peer hears them again within ``notice_every`` of its notifiers' rounds. A peer
that misses a notice computes another graph until the next one (every ``notice_every`` rounds); its neighbours see
a few silent rounds, not enough to route around them as sinks.

What an insider can do with notices: name an honest peer to every peer (peer/sim/attacks.py's ``slander``). With a
quorum of two alone, two insiders with honest messages that both heard from one honest peer cut it off: on the
rotating exponential graph of 8 at skew 0.8 (dense SGP, 3 seeds, 2 epochs) the honest peers ended at 59.5%
averaged against the clean fleet's 74.3% - mass stays exact, but the cut-off peer hears only from the insiders and
its data stops reaching the others. Every receiver of the suspect must agree: insiders can exclude only a peer that
sends to insiders alone (tests/test_gossip_notices.py), whose mass already reaches nobody honest.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field

#: Event kinds the book reports (the driver logs each once).
NOTICED = "left_out_on_notice"
NOTICE_ENDED = "notice_ended"


@dataclass(frozen=True)
class NoticeEvent:
    """A suspect excluded from the schedule on notices, or taken back in, for the log.

    Attributes:
        suspect: its peer id.
        kind: :data:`NOTICED` or :data:`NOTICE_ENDED`.
        round: this peer's round when it happened.
        notifiers: for :data:`NOTICED`, the peers whose notices counted (every receiver of the suspect).
    """

    suspect: str
    kind: str
    round: int
    notifiers: tuple[str, ...] = ()


@dataclass
class NoticeBook:
    """The notices one peer received and sent, and the suspects excluded from the schedule on them.

    Attributes:
        max_notifiers: most notifiers kept (the engine's ``max_peers``): a flood of ids allocates no more.
        received: per notifier, its newest notice: (this peer's round it arrived, the peers it named; none: a
            withdrawal).
        earlier: per notifier, the notice its newest one replaced (it counts in the round the newest arrived).
        left_out: suspects excluded from the schedule now, and since which round.
        events: suspects left out or taken back since the driver last logged them.
    """

    max_notifiers: int = 256
    received: dict[str, tuple[int, frozenset[str]]] = field(default_factory=dict)
    earlier: dict[str, tuple[int, frozenset[str]]] = field(default_factory=dict)
    left_out: dict[str, int] = field(default_factory=dict)
    events: list[NoticeEvent] = field(default_factory=list)
    #: What this peer's last notice named, and in which round it went (-1: none yet).
    last_named: frozenset[str] = frozenset()
    last_sent_round: int = -1
    #: The notice before it, (round, names): in the round a notice goes out this peer still counts the one before,
    #: as the peers it tells do until it arrives.
    previous_sent: tuple[int, frozenset[str]] = (-1, frozenset())

    def due(self, quarantined: Collection[str], round_index: int, every: int) -> bool:
        """Whether this peer sends a notice in ``round_index``: what it quarantines changed since its last one
        (a new quarantine, or a release: the withdrawal goes out too), or ``every`` rounds passed while it
        quarantines anyone."""
        named = frozenset(quarantined)
        return named != self.last_named or (bool(named) and round_index - self.last_sent_round >= every)

    def sent(self, quarantined: Collection[str], round_index: int) -> None:
        """This peer's notice naming ``quarantined`` went out in ``round_index``."""
        if round_index != self.last_sent_round:
            self.previous_sent = (self.last_sent_round, self.last_named)
        self.last_named, self.last_sent_round = frozenset(quarantined), round_index

    def note(self, notifier: str, quarantined: Iterable[str], round_index: int) -> None:
        """``notifier``'s notice arrived in ``round_index``, naming ``quarantined`` (replaces its earlier one, which
        still counts in this round; one naming nobody is a withdrawal). A new notifier beyond ``max_notifiers``
        takes the place of the one heard from longest ago."""
        named = frozenset(p for p in quarantined if p != notifier)
        old = self.received.get(notifier)
        if old is None:
            if not named:
                return  # nothing to withdraw
            if len(self.received) >= self.max_notifiers:
                self.forget(min(self.received, key=lambda n: self.received[n][0]))
        elif old[0] != round_index:
            self.earlier[notifier] = old
        self.received[notifier] = (round_index, named)

    def forget(self, peer_id: str) -> None:
        """A peer left the fleet: its notices no longer count."""
        self.received.pop(peer_id, None)
        self.earlier.pop(peer_id, None)

    def named(self, me: str, round_index: int, ttl: int) -> dict[str, set[str]]:
        """Per suspect, the notifiers that named it in a notice counting in ``round_index``: the newest one that
        arrived (this peer's own: went out) before this round, if within the ``ttl`` rounds before it. A notice
        counts from the round after it arrived - in synchronous rounds every peer counts it from the same round, and
        in a daemon one that arrives mid-round does not change that round - and until the round its successor
        counts. ``me``: this peer's id, the notifier of its own notice."""
        notices = {n: latest if latest[0] < round_index else self.earlier.get(n, (-1, frozenset()))
                   for n, latest in self.received.items()}
        own = (self.last_sent_round, self.last_named) if self.last_sent_round < round_index else self.previous_sent
        notices[me] = own
        out: dict[str, set[str]] = {}
        for notifier, (at, suspects) in notices.items():
            if at >= 0 and round_index - at <= ttl:
                for suspect in suspects:
                    out.setdefault(suspect, set()).add(notifier)
        return out

    def exclude(self, me: str, round_index: int, quorum: int, ttl: int, view: Collection[str],
                sends_to: Callable[[str], Collection[str]]) -> set[str]:
        """The suspects of the live set ``view`` every peer with these notices excludes from the schedule in
        ``round_index``: those that every peer ``sends_to(suspect)`` has them send to (over one period, over
        ``view``) named in a counting notice - at least ``quorum`` of them - but for the peers excluded in the
        previous round (a suspect does not vouch against another, nor for one). ``me`` (a suspect never excludes
        itself) is one of those receivers like any other: its own notice counts, and without one it vetoes.
        Records the changes as :attr:`events`."""
        now: dict[str, tuple[str, ...]] = {}
        doubted = set(self.left_out)
        for suspect, notifiers in self.named(me, round_index, ttl).items():
            notifiers -= doubted
            if suspect == me or suspect not in view or len(notifiers) < quorum:
                continue
            targets = set(sends_to(suspect)) - doubted
            if len(targets) >= quorum and targets <= notifiers:
                now[suspect] = tuple(sorted(targets))
        for suspect, counted in now.items():
            if suspect not in self.left_out:
                self.left_out[suspect] = round_index
                self.events.append(NoticeEvent(suspect, NOTICED, round_index, counted))
        for suspect in [s for s in self.left_out if s not in now]:
            del self.left_out[suspect]
            self.events.append(NoticeEvent(suspect, NOTICE_ENDED, round_index))
        return set(now)

    def snapshot(self, me: str, round_index: int, ttl: int) -> dict[str, dict[str, object]]:
        """Per suspect named by a counting notice (this peer's own included): who named it, and since when this
        peer excludes it (None: it does not - under the quorum, or a receiver of it has not named it)."""
        return {suspect: {"named_by": sorted(notifiers), "left_out_since": self.left_out.get(suspect)}
                for suspect, notifiers in sorted(self.named(me, round_index, ttl).items())}


def notice_targets(quarantined: Collection[str], view: Collection[str], me: str) -> set[str]:
    """Whom a peer that quarantines ``quarantined`` (or withdraws them) notifies: every peer of ``view`` (the live
    set it sees) but itself and them - each computes the exclusion from the same notices - or nobody when none of
    them is live."""
    suspects = set(quarantined) & set(view)
    if not suspects:
        return set()
    return {p for p in view if p != me and p not in suspects}
