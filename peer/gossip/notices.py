"""Quarantine notices (docs/design.md#quarantine-notices): a peer that never hears from a neighbour cannot judge it,
so it learns from the peers that do. Pure: rounds and the schedule come from the caller, no clock, no sockets.

Why: on a directed or rotating graph some peers send to a neighbour that never sends to them (on the rotating
exponential graph of 8 peers, peer i sends to i+1, i+2 and i+4; only the i+4 edge runs both ways). When the peers
that hear from an insider quarantine it, those one-way senders cannot see anything wrong and keep giving it their
share every few rounds: mass that never comes back to an honest peer. Measured in the simulator (dense SGP, skew
0.8, one insider, 2 epochs): the honest peers ended 9.2 points under the fleet without the insider's device for
every gross attack; with every honest peer leaving the insider out once any one quarantined it, at that floor.

The rule, both ends:

- A peer that quarantines neighbours tells, every ``notice_every`` rounds, each peer its schedule (over the live set
  it sees, the quarantined included) has sending to one of them: a QuarantineNotice naming every peer it
  quarantines now. Each notice replaces the notifier's earlier one; one that names nobody withdraws them.
- A receiver leaves a suspect out of its schedule (it keeps the share, as for a link that is down: mass stays exact)
  while every peer the schedule has the suspect send to (a peer can only report what it receives) named it within
  the last ``notice_ttl`` of the receiver's rounds, at least ``notice_quorum`` of them - but for those it
  quarantined or leaves out itself, which neither count nor are waited for - and only if the suspect never sends to
  the receiver (that receiver judges it by its own rule, and a notice cannot overrule what it sees). One honest
  receiver of the suspect that sees nothing wrong is a veto. Both ends compute the schedule over the live set with
  the quarantined in it (a receiver that quarantined another peer would otherwise shift an index-based graph).
  Nothing else changes: a suspect is not quarantined by notices, its messages (it sends none to this peer) would be
  judged as any other's, and it is back in the schedule as soon as one of the notices it needs is no longer fresh or
  no longer names it (an operator released it at a notifier: the withdrawal goes out at once; a notifier left the
  fleet or went silent: its notice expires ``notice_ttl`` of the receiver's rounds after it arrived).

Limits. The ttl counts the receiver's rounds and notices go every ``notice_every`` of the notifier's: a receiver
running rounds 4 times faster than its notifiers lets a suspect back in between two notices (the defaults leave that
margin; daemons of one fleet run rounds at about one pace). A notifier that ended its final consensus phase sends no
more notices. On a directed ring a suspect sends to one peer only, never a quorum: notices never act there. Notices
are not checkpointed: a restarted peer hears them again within ``notice_every`` of its notifiers' rounds.

What an insider can do with notices: name an honest peer to the peers sending to it (peer/sim/attacks.py's
``slander``). With a quorum of two alone, two insiders with honest messages that both heard from one honest peer cut
it off from its one-way senders: on the rotating exponential graph of 8 at skew 0.8 (dense SGP, 3 seeds, 2 epochs)
the honest peers ended at 59.5% averaged against the clean fleet's 74.3% - mass stays exact, but the cut-off peer
hears only from the insiders and its data stops reaching the others. Every receiver of the suspect must agree now:
insiders can cut off only a peer that sends to insiders alone (tests/test_gossip_notices.py), whose mass already
reaches nobody honest.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field

#: Event kinds the book reports (the driver logs each once).
NOTICED = "left_out_on_notice"
NOTICE_ENDED = "notice_ended"


@dataclass(frozen=True)
class NoticeEvent:
    """A suspect left out of this peer's schedule on notice, or taken back in, for the log.

    Attributes:
        suspect: its peer id.
        kind: :data:`NOTICED` or :data:`NOTICE_ENDED`.
        round: this peer's round when it happened.
        notifiers: for :data:`NOTICED`, the peers whose notices counted.
    """

    suspect: str
    kind: str
    round: int
    notifiers: tuple[str, ...] = ()


@dataclass
class NoticeBook:
    """The notices one peer received, and the suspects it leaves out on them.

    Attributes:
        max_notifiers: most notifiers kept (the engine's ``max_peers``): a flood of ids allocates no more.
        received: per notifier, (this peer's round it arrived, the peers it named).
        left_out: suspects left out of the schedule now, and since which round.
        events: suspects left out or taken back since the driver last logged them.
    """

    max_notifiers: int = 256
    received: dict[str, tuple[int, frozenset[str]]] = field(default_factory=dict)
    left_out: dict[str, int] = field(default_factory=dict)
    events: list[NoticeEvent] = field(default_factory=list)
    #: What this peer's last notice named, and in which round it went (-1: none yet).
    last_named: frozenset[str] = frozenset()
    last_sent_round: int = -1

    def due(self, quarantined: Collection[str], round_index: int, every: int) -> bool:
        """Whether this peer sends a notice in ``round_index``: what it quarantines changed since its last one
        (a new quarantine, or a release: the withdrawal goes out too), or ``every`` rounds passed while it
        quarantines anyone."""
        named = frozenset(quarantined)
        return named != self.last_named or (bool(named) and round_index - self.last_sent_round >= every)

    def sent(self, quarantined: Collection[str], round_index: int) -> None:
        """This peer's notice naming ``quarantined`` went out in ``round_index``."""
        self.last_named, self.last_sent_round = frozenset(quarantined), round_index

    def note(self, notifier: str, quarantined: Iterable[str], round_index: int) -> None:
        """``notifier``'s notice arrived in ``round_index``, naming ``quarantined`` (replaces its earlier one). A new
        notifier beyond ``max_notifiers`` takes the place of the one heard from longest ago."""
        named = frozenset(p for p in quarantined if p != notifier)
        if named and notifier not in self.received and len(self.received) >= self.max_notifiers:
            del self.received[min(self.received, key=lambda n: self.received[n][0])]
        if named:
            self.received[notifier] = (round_index, named)
        else:
            self.received.pop(notifier, None)

    def forget(self, peer_id: str) -> None:
        """A peer left the fleet: its notices no longer count."""
        self.received.pop(peer_id, None)

    def named(self, round_index: int, ttl: int) -> dict[str, set[str]]:
        """Per suspect, the notifiers that named it within the last ``ttl`` rounds before ``round_index``."""
        out: dict[str, set[str]] = {}
        for notifier, (at, suspects) in self.received.items():
            if round_index - at <= ttl:
                for suspect in suspects:
                    out.setdefault(suspect, set()).add(notifier)
        return out

    def leave_out(self, me: str, round_index: int, quorum: int, ttl: int, view: Collection[str],
                  sends_to: Callable[[str], Collection[str]], excused: Collection[str] = ()) -> set[str]:
        """The suspects of the live set ``view`` this peer leaves out of its schedule in ``round_index``: that never
        send to ``me``, and that every peer ``sends_to(suspect)`` has them send to (over one period) named in a
        fresh notice - at least ``quorum`` of them - but for the peers this one quarantined (``excused``) or leaves
        out itself (a suspect does not vouch against another, nor for one). Records the changes as
        :attr:`events`."""
        now: dict[str, tuple[str, ...]] = {}
        doubted = set(self.left_out) | set(excused)
        for suspect, notifiers in self.named(round_index, ttl).items():
            notifiers -= doubted
            if suspect == me or suspect not in view or len(notifiers) < quorum:
                continue
            targets = set(sends_to(suspect))
            if me in targets:
                continue  # it sends to this peer: judged here by the receive rule, not by hearsay
            counted = tuple(sorted(n for n in notifiers if n in targets))
            if len(counted) >= quorum and not targets - doubted - set(counted):
                now[suspect] = counted
        for suspect, counted in now.items():
            if suspect not in self.left_out:
                self.left_out[suspect] = round_index
                self.events.append(NoticeEvent(suspect, NOTICED, round_index, counted))
        for suspect in [s for s in self.left_out if s not in now]:
            del self.left_out[suspect]
            self.events.append(NoticeEvent(suspect, NOTICE_ENDED, round_index))
        return set(now)

    def snapshot(self, round_index: int, ttl: int) -> dict[str, dict[str, object]]:
        """Per suspect named by a fresh notice: who named it, and since when this peer leaves it out (None: it does
        not - under the quorum, or the suspect sends to this peer)."""
        return {suspect: {"named_by": sorted(notifiers), "left_out_since": self.left_out.get(suspect)}
                for suspect, notifiers in sorted(self.named(round_index, ttl).items())}


def notice_targets(quarantined: Collection[str], view: Collection[str], me: str,
                   sends_to: Callable[[str], Collection[str]]) -> set[str]:
    """Whom a peer that quarantines ``quarantined`` notifies: every peer of ``view`` (the live set it sees, the
    quarantined included) that ``sends_to`` (its schedule over one period) has sending to one of them - except
    itself and the quarantined."""
    suspects = set(quarantined) & set(view)
    if not suspects:
        return set()
    return {p for p in view if p != me and p not in suspects and suspects & set(sends_to(p))}
