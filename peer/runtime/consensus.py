"""A peer's rounds across its phases: training rounds, consensus rounds, and nothing once converged
(docs/method.md#the-consensus-phase).

    training  -> (epochs done, or a periodic phase due) begin a phase: wide mixing, distances counted afresh
    consensus -> judge the neighbours' distances: within tolerance long enough, the round budget spent, or no
                 live neighbour left?
                 no: one round of gossip without local steps (past the phase graph's horizon, every other one
                     a probe: the model's sketch instead of an update)   yes: end the phase
    end       -> converged: a farewell probe to the peers the phase graph sends to;
                 periodic: back to training at the training mixing;  final: converged (serves, sends nothing)

The simulator and the daemon call :func:`run_peer_round` alike; the decisions are the pure ones of
:mod:`peer.gossip.consensus`, the carrying out (mixing, sending, counting bytes) is here.

A phase round has no local steps to pace it, so it is paced by the neighbours instead: one message in flight per
edge (a receiver acknowledges at its own round boundary), a round only happens when an out-neighbour can take a
message, and after the first only once a neighbour was heard from since the last judgement (or after
``MAX_WAITS`` declined tries with none of its messages unacknowledged: two peers waiting on each other) - otherwise
the peer waits (nothing judged, nothing counted). Under a shared 10 Mbit/s link a dense message takes about a
second to arrive; counting the tries while one was still on its way, a peer sent rounds whose news was in transit
(Choco's phase 14 rounds and 15.9 MB over the link against 9 and 9.4 MB, one run each, skew 0.9). Unpaced, a
daemon sent its 40 dense rounds in 3 s, before its neighbours had answered one, gave away nearly all of its
push-sum weight (w 0.003) and ended at its budget 0.014-0.043 from its neighbours (README fleet, skew 0.9); paced by
acks alone, a peer whose neighbours had ended their phases (they send nothing more and acknowledge at once) sent them
dense rounds until they left (docs/decisions/consensus-phase.md).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Collection, Sequence

from peer.gossip.consensus import ConsensusPhase, PhaseEnd, PhaseName
from peer.runtime.peer import Peer
from peer.runtime.round import (
    PeerDiverged,
    RoundResult,
    Transport,
    excluded_this_round,
    run_round,
    schedule_ids,
    send_notice_if_due,
    skipped_this_round,
)

log = logging.getLogger(__name__)


def due_phase(peer: Peer, total_epochs: float) -> bool | None:
    """Whether ``peer`` should begin a consensus phase now: True for the final one (training is done), False for
    a periodic one, None for none."""
    settings = peer.consensus_settings
    if settings is None or peer.phase is not PhaseName.TRAINING:
        return None
    if peer.epoch >= total_epochs:
        return True
    periodic = sum(1 for phase in peer.consensus_done if not phase.final)
    return False if settings.periodic_due(peer.epoch, total_epochs, periodic) else None


def begin_phase(peer: Peer, final: bool) -> ConsensusPhase:
    """Start a consensus phase: the phase's mixing from the next round, distances judged on fresh messages only."""
    settings = peer.consensus_settings
    assert settings is not None
    phase = ConsensusPhase(settings, final=final, training_bytes=peer.training_bytes)
    peer.training_bytes = 0
    with peer.lock:
        peer.engine.distances.restart(dense_only=settings.mixing.compression == 0.0)
        peer.engine.window = 1
        peer.engine.guard.consensus_phase = True
    peer.set_mixing(settings.mixing)
    peer.consensus = phase
    peer.phase = PhaseName.CONSENSUS
    codec = peer.engine.algorithm.codec
    log.info("peer %s: %s consensus phase begins at epoch %.2f (compression %g, %d-bit%s, step floor %g, gamma %g, "
             "tolerance %g, at most %d rounds)", peer.peer_id, "final" if final else "periodic", peer.epoch,
             codec.compression, codec.bits, " deflated" if codec.deflate else "", codec.step_floor,
             settings.mixing.gamma, settings.tolerance, settings.max_rounds)
    return phase


def end_phase(peer: Peer) -> None:
    """End the running phase: training mixing again; converged after the final phase, training after a periodic
    one."""
    phase = peer.consensus
    assert phase is not None and phase.ended is not None
    peer.set_mixing(peer.training_mixing())
    with peer.lock:
        peer.engine.window = peer.training_window
        peer.engine.guard.consensus_phase = False
    peer.consensus_done.append(phase)
    peer.consensus = None
    peer.phase = PhaseName.CONVERGED if phase.final else PhaseName.TRAINING
    log.info("peer %s: consensus phase ended (%s) after %d rounds (%d of them probes), %d bytes sent; worst "
             "neighbour distance %s", peer.peer_id, phase.ended.value, phase.rounds, phase.probes, phase.payload_bytes,
             "unknown" if phase.worst is None else f"{phase.worst:.4g}")


def run_consensus_round(peer: Peer, transport: Transport, live: Collection[str],
                        round_index: int) -> RoundResult | None:
    """Judge the running phase, then one round of gossip without local steps; None when the phase ended instead,
    or when no out-neighbour can take a message yet or no neighbour was heard from since the last round (the peer
    waits: see the module docstring).

    Raises:
        PeerDiverged: the model is not finite (at a stable gamma this is a bug, never a recoverable divergence).
    """
    phase = peer.consensus
    assert phase is not None
    if not live:
        phase.left_alone()
        end_phase(peer)
        return None
    # as in a training round (peer/runtime/round.py): a suspect excluded on notices is out of the schedule, a
    # quarantined neighbour's and a routed-around sink's edges are skipped - a dense phase round would hand any of
    # them a full share of this peer's mass
    peer.mark_round(round_index)
    quarantined = peer.quarantined()
    topology = phase.settings.topology
    send_notice_if_due(peer, transport, live, round_index)
    ids = schedule_ids(peer, live, topology, quarantined, excluded_this_round(peer, live, topology, round_index))
    # the graph rotates with the phase's own rounds, not the peer's round index: daemons end training rounds
    # apart, and on the rotating exponential graph two peers of opposite parity would take different hops
    # instead of averaging 2^k peers in k rounds
    out = topology.out_neighbours(ids, peer.peer_id, phase.rounds)
    # a neighbour skipped on purpose is not waited for: with one out-neighbour a round (the exponential graph) the
    # daemon would otherwise retry this round for good - its round index, and so every notice's age, frozen
    skipped = skipped_this_round(peer, round_index) | quarantined
    sendable = [r for r in out if r not in skipped]
    ready = transport.ready(peer.peer_id, sendable) if sendable else set()
    with peer.lock:
        if sendable and not any(r in ready and peer.engine.has_room(r) for r in sendable):
            return None
        distances = peer.engine.distances.fresh_distances()
        heard = peer.engine.distances.heard()
        # a message of this peer's still unacknowledged by a live neighbour: the news it would bring is not due yet
        busy = any(edge.in_flight for r, edge in peer.engine.out_edges.items() if r in live)
    if phase.waits_for_news(heard, busy):
        return None
    # calm neighbours end the phase only once every peer could have been heard from (the graph's horizon)
    horizon = topology.horizon(len(ids), phase.settings.max_rounds + 1)
    if phase.rounds == 0 and horizon > phase.settings.max_rounds:
        log.warning("peer %s: the phase graph needs more rounds than the phase's budget (gossip.consensus_rounds "
                    "%d) to reach every one of %d peers: the phase will end at its budget, not converged",
                    peer.peer_id, phase.settings.max_rounds, len(ids))
    if phase.judge(distances, heard, horizon) is not None:
        if phase.ended is PhaseEnd.CONVERGED and (phase.settings.probe or phase.probes):
            send_farewell_probe(peer, phase, transport, ids, skipped, horizon)
        end_phase(peer)
        return None
    peer.sync_model()
    if not peer.is_finite():
        raise PeerDiverged(f"peer {peer.peer_id}: the model is not finite in consensus round {phase.rounds}")
    if phase.probe_due(horizon):
        receivers = [r for r in sendable if r in ready]
        sketch = peer.probe_sketch()
        transport.probe(peer.peer_id, receivers, sketch, phase.rounds)
        phase.count_round(len(sketch) * len(receivers), probe=True)
        return RoundResult(math.nan, [])
    messages = peer.send(out, ready, round_index) if out else []
    peer.sent_to({m.receiver for m in messages}, round_index)
    transport.submit(messages)
    phase.count_round(sum(len(m.payload) for m in messages))
    return RoundResult(math.nan, messages)


def send_farewell_probe(peer: Peer, phase: ConsensusPhase, transport: Transport, ids: Sequence[str],
                        skipped: Collection[str], horizon: int) -> None:
    """A peer that ends its phase converged sends its model's sketch once more to every peer its phase graph sends
    to (in any round of one cycle; none it skips on purpose): it sends them nothing after this, and a neighbour
    still judging it would otherwise wait on it until it leaves. A probe ends the phase of the peer that judges it,
    not of the peer that sent it - in the README fleet (skew 0.9) without this, one daemon of four ended its phase
    alone in each of three runs, 0.022-0.036 from its neighbours; with it, none in three."""
    topology = phase.settings.topology
    cycle = range(max(1, min(horizon, len(ids))))
    receivers = set().union(*(topology.out_neighbours(ids, peer.peer_id, r) for r in cycle)) - set(skipped)
    if receivers:
        sketch = peer.probe_sketch()
        transport.probe(peer.peer_id, receivers, sketch, phase.rounds)
        phase.payload_bytes += len(sketch) * len(receivers)


def run_peer_round(peer: Peer, transport: Transport, live: Collection[str], round_index: int, local_steps: int,
                   total_epochs: float) -> RoundResult | None:
    """The round ``peer`` is due: a training round, a consensus round (a phase begins when due), or None when the
    peer has nothing to send (converged after its final phase, a phase ended this round and the next round
    resumes training, or the phase waits for an out-neighbour to take a message).

    Args:
        total_epochs: the epochs training runs (the final phase begins there).
    """
    if peer.phase is PhaseName.CONVERGED:
        return None
    if peer.consensus is None:
        final = due_phase(peer, total_epochs)
        if final is None:
            return run_round(peer, transport, live, round_index, local_steps)
        begin_phase(peer, final)
    return run_consensus_round(peer, transport, live, round_index)
