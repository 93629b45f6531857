"""The round every driver runs, and the Transport it runs over (docs/design.md#one-round-of-one-peer).

    begin (z <- x / w, QGM) -> H local steps -> the recovery policy's verdict (recovery.py), carried out here:
    diverged? roll back + halve the lr (the step's fault) or gamma (gossip's), send nothing
    -> out-neighbours from the live set, less suspects excluded on quarantine notices (topology schedule)
    -> the transport says which links are up -> plan / encode / commit (peer.send) -> transport.submit

The simulator and the daemon call :func:`run_round` with different transports - the in-memory one
(peer/sim/transport.py) and the gRPC edge table (peer/net/transport.py) - and schedule it differently: the simulator
runs every peer's round and then delivers (synchronous rounds), the daemon runs its own rounds back to back while
messages arrive (asynchronous). Both transports settle every message through the same ledger code.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from peer.gossip.engine import OutMessage
from peer.gossip.notices import NOTICED, notice_targets
from peer.gossip.sinks import ROUTED
from peer.gossip.topology import Topology
from peer.runtime.peer import Peer
from peer.runtime.recovery import (
    GiveUp,
    Healthy,
    PeerDiverged,
    RecoveryEvent,
    RollBack,
    Snapshot,
)

log = logging.getLogger(__name__)

__all__ = ["PeerDiverged", "RoundResult", "SettleReport", "Transport", "run_round", "schedule_ids",
           "excluded_this_round", "send_notice_if_due", "skipped_this_round"]


@dataclass
class SettleReport:
    """What settling a transport's in-flight messages decided (message counts)."""

    delivered: int = 0
    retracted: int = 0
    pending: dict[str, int] = field(default_factory=dict)  # receiver -> messages still unsettled (unreachable)

    def add(self, other: "SettleReport") -> None:
        self.delivered += other.delivered
        self.retracted += other.retracted
        for receiver, count in other.pending.items():
            self.pending[receiver] = self.pending.get(receiver, 0) + count

    def describe(self) -> str:
        pending = sum(self.pending.values())
        text = f"{self.delivered} delivered, {self.retracted} retracted"
        return text + (f", {pending} kept in flight for the next handshake (unreachable: "
                       f"{', '.join(sorted(self.pending))})" if pending else "")


class Transport(Protocol):
    """How a peer's messages travel. Implementations count bytes by one rule (peer/net/accounting.py)."""

    def ready(self, sender: str, receivers: Sequence[str]) -> set[str]:
        """The receivers whose link can carry a message from ``sender`` now (thread-safe)."""
        ...

    def submit(self, messages: Sequence[OutMessage]) -> None:
        """Hand over committed messages; delivery and settlement are asynchronous (thread-safe)."""
        ...

    def notify(self, sender: str, receivers: Collection[str], quarantined: Sequence[str]) -> None:
        """Send each receiver a QuarantineNotice naming ``quarantined`` (best effort, no reply: notices are resent
        every few rounds; thread-safe)."""
        ...

    def probe(self, sender: str, receivers: Collection[str], sketch: bytes, round_index: int) -> None:
        """Send each receiver a ConsensusProbe carrying ``sketch``, ``sender``'s model sketch in its phase round
        ``round_index`` (best effort, no reply: a phase that hears nothing sends again; thread-safe)."""
        ...

    async def settle(self, timeout_s: float) -> SettleReport:
        """Settle every in-flight message (ack, or handshake: delivered or retracted) within ``timeout_s``."""
        ...


@dataclass
class RoundResult:
    """One round of one peer: mean training loss, messages handed to the transport, and the recovery when the
    model diverged (non-finite, or the loss exploded): then nothing was sent - a peer never gossips a diverged
    model - and the peer was rolled back with gamma halved (peer/runtime/recovery.py)."""

    loss: float
    sent: list[OutMessage]
    recovery: RecoveryEvent | None = None

    @property
    def diverged(self) -> bool:
        return self.recovery is not None


def run_round(peer: Peer, transport: Transport, live: Collection[str], round_index: int,
              local_steps: int) -> RoundResult:
    """One local round of ``peer`` among the ``live`` peers (ids other than its own).

    Raises:
        PeerDiverged: the model diverged once more after the most gamma halvings allowed.
    """
    recovery = peer.recovery
    peer.begin_round(round_index)
    if not recovery.has_snapshot:  # the model the peer starts from (initial, restored or joined) is healthy
        recovery.keep(_snapshot(peer, round_index))
    error = None
    try:
        loss = peer.train_steps(local_steps)
    except Exception as exc:  # noqa: BLE001 - whatever a poisoned model makes a step raise is a divergence, not an exit
        loss, error = math.nan, f"{type(exc).__name__}: {exc}"
    verdict = recovery.judge(round_index, loss, error is None and peer.is_finite(), peer.num_classes, error,
                             suspect=peer.divergence_suspect(), moved=peer.last_move if error is None else 0.0,
                             own_step=peer.own_step_diverged())
    _report_quarantines(peer)
    if not isinstance(verdict, Healthy):
        return RoundResult(loss, [], recovery=_recover(peer, verdict))
    peer.healthy_round()
    if verdict.snapshot:
        recovery.keep(_snapshot(peer, round_index))
    quarantined = peer.quarantined()  # a quarantined neighbour gets nothing
    send_notice_if_due(peer, transport, live, round_index)
    ids = schedule_ids(peer, live, peer.topology, quarantined, excluded_this_round(peer, live, peer.topology,
                                                                                     round_index))
    # mass-sink detection: who the schedule has sending to this peer (a silent one becomes a sink). Judged on the
    # schedule without routing around sinks - what the neighbours themselves run - or routing around a silent
    # predecessor of a directed ring would make this peer expect the one before it, and so on round the ring.
    # Who the schedule has send here within a period: the only neighbours the outlier rules compare one with
    period_senders = peer.topology.senders_within_period(ids, peer.peer_id, round_index)
    peer.expect_from({p for p in ids if p != peer.peer_id and p not in quarantined
                      and peer.peer_id in peer.topology.out_neighbours(ids, p, round_index)}, tuple(ids),
                     period_senders)
    # a sink gets nothing but a probe now and then (peer/gossip/sinks.py): not quarantined, just not sent to - its
    # edge is skipped as a link that is down is (this peer keeps the share). The schedule itself stays the one the
    # neighbours compute: rebuilt without the sink, an index-based graph (exponential, rotating) moved this peer's
    # targets, so a neighbour that expected it heard nothing, routed around it in turn, and could end up feeding
    # the sink itself
    skipped = skipped_this_round(peer, round_index) | quarantined
    out = peer.topology.out_neighbours(ids, peer.peer_id, round_index)
    sendable = [r for r in out if r not in skipped]
    messages = peer.send(out, transport.ready(peer.peer_id, sendable), round_index) if sendable else []
    peer.sent_to({m.receiver for m in messages}, round_index)
    transport.submit(messages)
    return RoundResult(loss, messages)


def _report_quarantines(peer: Peer) -> None:
    """Log each neighbour quarantined since the last report, once."""
    for neighbour, reason in peer.take_new_quarantines():
        serial = peer.certificate_serial(neighbour)
        certificate = f"certificate serial {serial}" if serial is not None else "certificate serial not known"
        log.warning("peer %s quarantined neighbour %s (%s; %s): none of its messages are applied and none are sent "
                    "to it until an operator releases it (lpdl-peer release)", peer.peer_id, neighbour, certificate,
                    reason)


def schedule_ids(peer: Peer, live: Collection[str], topology: Topology, quarantined: Collection[str],
                 excluded: Collection[str]) -> list[str]:
    """The ids this peer computes its round's schedule over (whom it sends to, whom it expects): the live set and
    itself, less the suspects every peer excludes on quarantine notices (``excluded``: the same set at every peer
    that has the same notices, peer/gossip/notices.py), and less the neighbours it quarantined itself only where
    ``topology`` rewires locally (a static ring: the peers that quarantine a neighbour are its ring neighbours, the
    ones that hear from it, and they close the ring around it). On any other graph leaving a peer out on one's own
    re-indexes the rest, so a quarantiner's schedule would no longer be the one its neighbours compute for it: on
    the rotating exponential graph of 8 with two insiders, an honest peer expected two honest neighbours that now
    never sent to it, and routed around them as sinks (2026-11-28, dense SGP, skew 0.8). There a quarantined
    neighbour stays in the ids, its edges skipped and its shares kept, until the notices exclude it everywhere."""
    kept = set(live) - set(excluded)
    if topology.rewires_locally:
        kept -= set(quarantined)
    return sorted({*kept, peer.peer_id})


def excluded_this_round(peer: Peer, live: Collection[str], topology: Topology, round_index: int) -> set[str]:
    """The suspects excluded from this round's schedule on quarantine notices (peer/gossip/notices.py): every peer
    ``topology`` over the live set and this peer (the suspects in it, as every peer computes it) has the suspect
    send to reported it quarantined. Logged once each way."""
    view = sorted({*live, peer.peer_id})
    excluded = peer.excluded_on_notice(round_index, view, lambda p: topology.reaches(view, p, round_index))
    _report_notices(peer)
    return excluded


def skipped_this_round(peer: Peer, round_index: int) -> set[str]:
    """The scheduled neighbours this round skips, keeping their shares (a training round and a consensus round
    alike): sinks routed around (peer/gossip/sinks.py). Logged once each way."""
    routed = peer.route_around(round_index)
    _report_routes(peer)
    return routed


def send_notice_if_due(peer: Peer, transport: Transport, live: Collection[str], round_index: int) -> None:
    """This peer's QuarantineNotice, when one is due, to every live peer but the ones it quarantines or quarantined
    when its last notice went out (a release is withdrawn from the same peers)."""
    view = sorted({*live, peer.peer_id})
    due = peer.notice_due(round_index)
    if due is None:
        return
    quarantined, previous = due
    transport.notify(peer.peer_id, notice_targets(quarantined | previous, view, peer.peer_id), sorted(quarantined))


def _report_notices(peer: Peer) -> None:
    """Log each suspect left out on quarantine notices, or taken back in, once."""
    for event in peer.take_notice_events():
        if event.kind == NOTICED:
            log.warning("peer %s leaves neighbour %s out of its schedule from round %d, as every peer told does: %s, "
                        "every peer it sends to, quarantined it (not quarantined here unless this peer is one of "
                        "them; back in once their notices stop)", peer.peer_id, event.suspect, event.round,
                        ", ".join(event.notifiers))
        else:
            log.warning("peer %s takes neighbour %s back into its schedule in round %d: not every peer it sends to "
                        "reports it quarantined now (released, expired, or it left the live set)", peer.peer_id,
                        event.suspect, event.round)


def _report_routes(peer: Peer) -> None:
    """Log each sink routed around or let back in since the last report, once."""
    for event in peer.take_route_events():
        if event.kind == ROUTED:
            log.warning("peer %s routes around neighbour %s from round %d: the schedule had it send to this peer in "
                        "%d rounds and nothing of it was applied (a mass sink, or restarting or cut off); not "
                        "quarantined, it is sent nothing until one of its messages is applied, except a probe "
                        "(first due in round %d, then at a doubling backoff)", peer.peer_id, event.neighbour,
                        event.round, event.silent_rounds, event.next_probe)
        else:
            log.warning("peer %s lets neighbour %s back into its schedule in round %d: %s (routed around since "
                        "round %d)", peer.peer_id, event.neighbour, event.round, event.why, event.since)


def _snapshot(peer: Peer, round_index: int) -> Snapshot:
    return Snapshot(round_index, *peer.good_state())


def _recover(peer: Peer, verdict: RollBack | GiveUp) -> RecoveryEvent:
    """Carry out a divergence verdict: roll back (also before giving up: a daemon then checkpoints a finite model),
    then train at the halved lr or gossip at the halved gamma, or raise :class:`PeerDiverged`."""
    if verdict.to is not None:
        peer.roll_back_to(verdict.to.z, verdict.to.buffers)
    if isinstance(verdict, GiveUp):
        raise PeerDiverged(verdict.message)
    event = verdict.event
    if verdict.charged is not None:
        quarantined = peer.charge_divergence(verdict.charged, event.reason)
        _report_quarantines(peer)
        log.warning("peer %s diverged in round %d (%s): rolled back to round %d's model, gamma kept at %.3g; %s",
                    event.peer_id, event.round, event.reason, event.rolled_back_to, event.gamma,
                    f"{verdict.charged} quarantined" if quarantined else
                    f"a strike against {verdict.charged}, not quarantined (one divergence is no proof)")
        return event
    peer.set_gamma(event.gamma)
    halved = (f"its own training step: the learning rate halved to {event.lr_factor:g} of the schedule's"
              if verdict.lr_halved else f"gamma halved to {event.gamma:.3g}")
    log.warning("peer %s diverged in round %d (%s): rolled back to round %d's model, %s (recovery %d of at most "
                "%d)", event.peer_id, event.round, event.reason, event.rolled_back_to, halved,
                peer.recovery.halvings_spent, peer.recovery.max_halvings)
    return event
