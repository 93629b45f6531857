"""Push-sum mass over a fleet's checkpoints: the invariant of docs/design.md#exactly-once-mass-transfer, evaluated from
files.

Exactly-once mass transfer means that, with lr = 0, the fleet's total

    sum_p x_p  +  in-flight mass not yet applied        and        sum_p w_p  +  in-flight weight not yet applied

never changes: every message's mass is subtracted by its sender once and added by its receiver once (or taken
back by the sender after a handshake, never both). The sum runs over EVERY peer that ever held mass:

- a peer that left for good (clean stop) keeps what it held in its final checkpoint - include that checkpoint;
  what it still had in flight stays in flight there, and whether its receiver applied it is in the receiver's
  ledger, which moves to ``departed_in_edges`` once the receiver forgets the peer;
- a peer restarted from a checkpoint that is older than its state at the crash breaks the invariant by design
  (docs/design.md#exactly-once-mass-transfer: the edges in doubt are reset; mass moved after the checkpoint is lost or
  counted twice);
- a joiner that pulls a neighbour's model adds that model with w = 1 (by design); one that restores a checkpoint
  adds what the checkpoint holds.

Imports torch: load it only where checkpoints are read (``peer.fleet`` stays torch-free at import otherwise).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from peer.compress.codec import Decoded


@dataclass
class FleetTotals:
    """Fleet-wide push-sum sums (float64): x and w held by peers plus mass still in flight (not yet applied).

    Attributes:
        x, w: held + in flight.
        in_flight_x, in_flight_w: the in-flight part alone.
        unsettled: (sender, receiver, seq) of every message counted as in flight.
    """

    x: torch.Tensor
    w: float
    in_flight_x: torch.Tensor
    in_flight_w: float
    unsettled: list[tuple[str, str, int]]


def fleet_totals(checkpoints: Mapping[str, dict[str, Any]] | Sequence[dict[str, Any]]) -> FleetTotals:
    """sum x and sum w over peers, INCLUDING the in-flight mass their checkpoints show was never applied.

    An in-flight message (sender -> receiver, seq) counts iff the receiver's checkpoint says it has not applied it
    (``in_edges[sender].last_applied < seq`` - or the same in ``departed_in_edges`` for a sender it forgot - or the
    receiver is not among the checkpoints). Its mass is what the sender subtracted: Choco moves ``weight * replica``
    with the edge's replica right after that message (walk the in-flight messages newest first, undoing each one's
    replica change), the others ``scale * decoded``.
    """
    states = list(checkpoints.values()) if isinstance(checkpoints, Mapping) else list(checkpoints)
    by_id = {s["peer_id"]: s for s in states}
    x = torch.zeros_like(states[0]["engine"]["x"], dtype=torch.float64)
    flight_x = torch.zeros_like(x)
    w = flight_w = 0.0
    unsettled = []
    for s in states:
        eng = s["engine"]
        x += eng["x"].double()
        w += float(eng["w"])
        for receiver, (_next_seq, flight) in eng["out_edges"].items():
            other = by_id.get(receiver)
            applied = 0
            if other is not None:  # a forgotten sender's ledger is kept among the departed ones
                ledgers = {**other["engine"].get("departed_in_edges", {}), **other["engine"]["in_edges"]}
                applied = ledgers.get(s["peer_id"], (0, 0))[0]
            replicas = eng["algorithm_state"].get("replicas_out", {})
            replica = replicas[receiver].clone() if receiver in replicas else None
            for seq in sorted(flight, reverse=True):
                idx, val, weight, scale, undo = flight[seq]
                if applied < seq:
                    unsettled.append((s["peer_id"], receiver, seq))
                    mass = torch.zeros_like(eng["x"])
                    if replica is not None:
                        mass.add_(replica, alpha=weight)
                    else:
                        Decoded(indices=idx, values=val).add_into(mass, scale)
                    flight_x += mass.double()
                    flight_w += float(weight)
                if replica is not None:
                    undo_idx, old = undo
                    if undo_idx is None:
                        replica.copy_(old)
                    else:
                        replica[undo_idx] = old
    return FleetTotals(x=x + flight_x, w=w + flight_w, in_flight_x=flight_x, in_flight_w=flight_w,
                       unsettled=unsettled)


def debiased(state: dict[str, Any]) -> torch.Tensor:
    """z = x / w of one checkpoint (float64)."""
    return state["engine"]["x"].double() / float(state["engine"]["w"])


def consensus_distance(states: Sequence[dict[str, Any]]) -> float:
    """mean_i ||z_i - z_bar|| over checkpoints (float64; the one definition of docs/method.md#measurements, as in
    peer.runtime.state.consensus_distance)."""
    zs = torch.stack([debiased(s) for s in states])
    return float((zs - zs.mean(dim=0)).norm(dim=1).mean())
