"""The daemon's status document: one JSON-ready dict, served identically by the control socket (``lpdl-peer
status``), the Status RPC (``lpdl-peer status --peer host:port``) and, as gauges and counters, Prometheus.

    peer_id, fleet, phase, uptime_s, round, epoch, lr, loss, eval {round, epoch, test_loss, test_acc}, w,
    precision {requested, backend, reason, ...}, model {name, fingerprint},
    gossip {algorithm, compression, bits, gamma (in use: halved by each recovery), configured_gamma, topology,
    window}, last_round_s, divergences (recoveries: model rolled back, gamma halved), gamma_halvings,
    neighbours {peer_id: {address, live, state, in_flight, bytes_sent, bytes_received, rtt_s, last_seen,
                          delivered, settled, last_error}},
    refused {reason: count}, dropped {reason: count}, applied,
    memory {rss_mib, peak_mib, after {stage: MiB}, added {stage: MiB}, gossip_state_mib}

Built from plain inputs (no daemon object), so this module imports neither the node nor torch-heavy rooms.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from peer.config import RunSpec
from peer.runtime.peer import Peer


class Phase(enum.Enum):
    """Where a daemon is in its life."""

    STARTING = "starting"  # restoring, binding, discovering, joining (pulling the model)
    TRAINING = "training"  # the round loop runs
    STOPPING = "stopping"  # settling in-flight messages, final checkpoint, deregistering
    STOPPED = "stopped"


@dataclass
class Progress:
    """The round loop's own figures (written by the loop, read by status)."""

    phase: Phase = Phase.STARTING
    round: int = 0
    last_round_s: float = 0.0
    last_eval: dict[str, float] = field(default_factory=dict)
    started: float = field(default_factory=time.time)


def build_status(*, peer: Peer, spec: RunSpec, fleet: str, model: dict[str, Any], precision: dict[str, Any],
                 progress: Progress, live: Mapping[str, str], edges: Mapping[str, dict[str, Any]],
                 server: dict[str, Any], memory: Mapping[str, Any]) -> dict[str, Any]:
    """The status document (cheap: no tensor work). The engine's figures come from one locked
    :meth:`Peer.status_snapshot`.

    Args:
        model: name, fingerprint, source and source_kind, and for a converted model its layer table
            (``layers``, text) and one-line summary (``layers_summary``).
        live: live peer set, ``peer_id -> host:port``.
        edges: outbound edge snapshots by receiver (peer/net/client.py EdgeSender.snapshot).
        server: the gRPC server's snapshot (links, refused, dropped, applied).
        memory: peer/daemon/memory.py MemoryStages.snapshot().
    """
    links = server["links"]
    gossip = peer.status_snapshot()
    robust = peer.robust_snapshot()  # per neighbour: score, clipped fraction, quarantined since (gossip/robust.py)
    neighbours: dict[str, dict[str, Any]] = {}
    for peer_id in sorted(set(live) | set(edges) | (set(links) & gossip.known_peers) | set(robust)):
        link = links.get(peer_id, {})
        edge = edges.get(peer_id, {})
        neighbours[peer_id] = {
            "address": live.get(peer_id) or edge.get("address", ""),
            "live": peer_id in live,
            "state": edge.get("state", "inbound-only" if link else "known"),
            "in_flight": gossip.in_flight.get(peer_id, 0),
            "bytes_sent": link.get("bytes_sent", 0),
            "bytes_received": link.get("bytes_received", 0),
            "rtt_s": edge.get("ack_rtt_s") or edge.get("hello_rtt_s"),
            "last_seen": max(link.get("last_seen", 0.0), edge.get("last_seen", 0.0)),
            "delivered": edge.get("delivered", 0),
            "settled": edge.get("settled", {}),
            "last_error": edge.get("last_error", ""),
            "robust": robust.get(peer_id, {}),
        }
    g = spec.gossip
    return {
        "peer_id": peer.peer_id,
        "fleet": fleet,
        "phase": progress.phase.value,
        "uptime_s": time.time() - progress.started,
        "round": progress.round,
        "epoch": peer.epoch,
        "lr": peer.lr(),
        "loss": peer.last_loss,
        "eval": dict(progress.last_eval),
        "w": gossip.w,
        "precision": precision,
        "model": {"name": spec.model.name, **model},
        "gossip": {"algorithm": g.algorithm, "compression": g.compression, "bits": g.bits,
                   "gamma": gossip.gamma, "configured_gamma": g.effective_gamma,
                   "topology": g.topology + (" rotating" if g.rotating else ""), "window": g.window},
        "last_round_s": progress.last_round_s,
        "divergences": peer.recovery.recoveries,
        "quarantined": sorted(p for p, r in robust.items() if r["quarantined_since"] is not None),
        "gamma_halvings": peer.recovery.halvings,
        "neighbours": neighbours,
        "refused": server["refused"],
        "dropped": server["dropped"],
        "applied": server["applied"],
        "memory": {**memory, "gossip_state_mib": gossip.gossip_state_bytes / 2**20},
    }
