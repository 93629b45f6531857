"""Push-sum mass over a fleet's checkpoints: the invariant of docs/design.md#exactly-once-mass-transfer, evaluated
from files.

Exactly-once mass transfer means that, with lr = 0, the fleet's total

    sum_p x_p  +  in-flight mass not yet applied        and        sum_p w_p  +  in-flight weight not yet applied

never changes: every message's mass is subtracted by its sender once and added by its receiver once (or taken
back by the sender after a handshake, never both). The sum runs over EVERY peer that ever held mass:

- a peer that left for good (clean stop) keeps what it held in its final checkpoint - include that checkpoint;
  what it still had in flight stays in flight there, and whether its receiver applied it is in the receiver's
  ledger, kept among its departed senders once the receiver forgets the peer;
- a peer restarted from a checkpoint that is older than its state at the crash breaks the invariant by design
  (the edges in doubt are reset; mass moved after the checkpoint is lost or counted twice);
- a joiner that pulls a neighbour's model adds that model with w = 1 (by design); one that restores a checkpoint
  adds what the checkpoint holds.

Nothing here reads a record's fields: each peer's engine is rebuilt from its checkpoint by the engine's own code
(:func:`peer.runtime.state.engine_of`), the messages its receiver's ledger shows applied are settled as an Ack would
settle them, and the rest is what :meth:`GossipEngine.in_flight` sums - the same code the daemon runs.

Imports torch: load it only where checkpoints are read (``peer.fleet`` stays torch-free at import otherwise).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from peer.gossip.engine import GossipEngine
from peer.gossip.ledger import HelloReply
from peer.runtime.state import engine_of


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
    (its ledger's last applied seq from that sender, kept for forgotten senders too, is below seq) or the receiver
    is not among the checkpoints.
    """
    states = list(checkpoints.values()) if isinstance(checkpoints, Mapping) else list(checkpoints)
    engines = {s["peer_id"]: engine_of(s) for s in states}
    for engine in engines.values():
        settle_applied(engine, engines)
    x = torch.zeros_like(states[0]["engine"]["x"], dtype=torch.float64)
    flight_x = torch.zeros_like(x)
    w = flight_w = 0.0
    unsettled = []
    for peer_id, engine in engines.items():
        own_x, own_w = engine.holdings()  # held mass (received, not yet applied by clipping) included
        x += own_x
        w += own_w
        mass, weight = engine.in_flight()
        flight_x += mass.double()
        flight_w += weight
        unsettled += [(peer_id, receiver, seq) for receiver, edge in engine.out_edges.items()
                      for seq in sorted(edge.in_flight)]
    return FleetTotals(x=x + flight_x, w=w + flight_w, in_flight_x=flight_x, in_flight_w=flight_w,
                       unsettled=unsettled)


def settle_applied(sender: GossipEngine, engines: Mapping[str, GossipEngine]) -> None:
    """Settle, as an Ack would, every in-flight message of ``sender`` that its receiver's engine has applied."""
    for receiver in list(sender.out_edges):
        other = engines.get(receiver)
        if other is not None:
            sender.on_ack(receiver, other.last_applied_from(sender.peer_id))


def settled_mass(checkpoints: Sequence[dict[str, Any]]) -> dict[str, tuple[torch.Tensor, float]]:
    """Each peer's push-sum numerator x (float64) and weight w once every in-flight message between these checkpoints is
    settled as the next reconnect handshake settles it: delivered where the receiver's checkpoint applied it, its
    mass taken back by the sender (newest first) where not, and what the robust rule's clipping held back added in
    (the peer applies it within its radius in its next rounds). What the peers hold after a fleet stopped with
    messages on the wire: the models ((x + held) / (w + held weight)) a consensus check compares."""
    engines = {s["peer_id"]: engine_of(s) for s in checkpoints}
    for engine in engines.values():
        for receiver in list(engine.out_edges):
            other = engines.get(receiver)
            if other is None:
                continue
            hello = engine.hello_for(receiver)
            last = other.last_applied_from(engine.peer_id)
            engine.on_hello_reply(receiver, hello, HelloReply(last_applied=last, fence=max(last, hello.next_seq - 1),
                                                              reset=False))
    return {peer_id: e.holdings() for peer_id, e in engines.items()}
