"""Divergence recovery, part of the round every driver runs (issue 12).

A peer whose model goes non-finite, or whose training loss explodes, must not die and must not gossip the broken
model. The round (peer/runtime/round.py) asks :meth:`Recovery.check` after the local steps; on a verdict it calls
:meth:`Recovery.recover`, which

    rolls the model back to the older of the last two good snapshots (z and the model's buffers; the push-sum
    weight and every edge stay as they are, so mass moved since stays accounted for: x := z_good * w_now, as
    :func:`peer.runtime.state.roll_back` does), clears the momentum, and halves the consensus step gamma.

The halving is bounded (``max_halvings``); one divergence more rolls back once more and then raises
:class:`PeerDiverged` with a message naming the peer, the reason and what to change. The simulator and the daemon both get this from the round: neither has
its own copy. Snapshots are kept in memory (one model vector and the buffers, every ``snapshot_every`` rounds), so
the simulator needs no checkpoint files and a daemon rolls back even before its first checkpoint.

"Loss explodes" means a round's mean training loss above ``explosion_factor`` times the running mean of the
healthy rounds' losses AND above twice the loss of a uniform guess (2 ln C for C classes): a loss that high is a
model that has left the data behind, not a hard batch.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from peer.runtime.peer import Peer

log = logging.getLogger(__name__)

#: Rounds between in-memory snapshots of a healthy model (the roll-back goes 1-2 of these intervals back).
SNAPSHOT_EVERY = 10
#: A round loss this many times the running mean of healthy losses (and above 2 ln C) counts as exploded.
EXPLOSION_FACTOR = 10.0
#: Weight of a new healthy round in the running mean of the training loss.
LOSS_EMA = 0.1


class PeerDiverged(RuntimeError):
    """A peer diverged again after gamma was halved the most times allowed; the message says what to change."""


@dataclass
class Snapshot:
    """A healthy model: its round, de-biased model z and buffers (copies)."""

    round: int
    z: torch.Tensor
    buffers: dict[str, torch.Tensor]


@dataclass
class RecoveryEvent:
    """One recovery: when, why, which snapshot, and gamma after the halving."""

    peer_id: str
    round: int
    reason: str
    rolled_back_to: int
    gamma: float

    def as_dict(self) -> dict[str, object]:
        return dict(self.__dict__)


class Recovery:
    """A peer's divergence guard: snapshots, the loss baseline, and the bounded halvings of gamma.

    Args:
        max_halvings: recoveries allowed (each halves gamma); one more divergence raises :class:`PeerDiverged`.
        snapshot_every: rounds between snapshots of a healthy model.
        explosion_factor: see the module doc.
    """

    def __init__(self, max_halvings: int = 4, snapshot_every: int = SNAPSHOT_EVERY,
                 explosion_factor: float = EXPLOSION_FACTOR) -> None:
        if max_halvings < 0:
            raise ValueError(f"max_halvings: expected >= 0, got {max_halvings}")
        self.max_halvings = max_halvings
        self.snapshot_every = max(1, snapshot_every)
        self.explosion_factor = explosion_factor
        self.snapshots: deque[Snapshot] = deque(maxlen=2)
        self.loss_mean: float | None = None
        self.halvings = 0
        self.events: list[RecoveryEvent] = []
        self._restored_recoveries = 0

    @property
    def recoveries(self) -> int:
        """Roll-backs so far (those before a restart included, from the checkpoint)."""
        return self._restored_recoveries + len(self.events)

    # --- called by the round -----------------------------------------------------------------------------------
    def ensure_snapshot(self, peer: Peer, round_index: int) -> None:
        """Before the first round's training: the model the peer starts from (initial, restored or joined) is the
        first good state."""
        if not self.snapshots:
            self._snapshot(peer, round_index)

    def check(self, peer: Peer, loss: float) -> str | None:
        """Why this round's model is not healthy (None: it is)."""
        if not math.isfinite(loss):
            return f"training loss {loss}"
        if not peer.is_finite():
            return "model not finite"
        floor = 2.0 * math.log(max(2, peer.num_classes))
        if self.loss_mean is not None and loss > max(self.explosion_factor * self.loss_mean, floor):
            return f"training loss exploded: {loss:.4g} vs a running mean of {self.loss_mean:.4g}"
        return None

    def healthy(self, peer: Peer, round_index: int, loss: float) -> None:
        """A healthy round: update the loss baseline, and snapshot the model when one is due."""
        self.loss_mean = loss if self.loss_mean is None else (1 - LOSS_EMA) * self.loss_mean + LOSS_EMA * loss
        if not self.snapshots or round_index - self.snapshots[-1].round >= self.snapshot_every:
            self._snapshot(peer, round_index)

    def recover(self, peer: Peer, round_index: int, reason: str) -> RecoveryEvent:
        """Roll back to the older snapshot and halve gamma; raises :class:`PeerDiverged` when out of halvings."""
        if not self.snapshots:
            raise PeerDiverged(f"peer {peer.peer_id} diverged in round {round_index} ({reason}) with no healthy "
                               f"model to roll back to; try a lower --lr or --gamma")
        good = self.snapshots[0]
        self.snapshots.clear()
        self.snapshots.append(good)
        peer.roll_back_to(good.z, good.buffers)  # also before giving up: a daemon then checkpoints a finite model
        if self.halvings >= self.max_halvings:
            raise PeerDiverged(
                f"peer {peer.peer_id} diverged in round {round_index} ({reason}) after {self.recoveries} "
                f"roll-back(s) with gamma halved {self.halvings} time(s) to {peer.engine.gamma:.3g}; "
                f"try a lower --lr or --gamma")
        peer.halve_gamma()
        self.halvings += 1
        event = RecoveryEvent(peer.peer_id, round_index, reason, good.round, peer.engine.gamma)
        self.events.append(event)
        log.warning("peer %s diverged in round %d (%s): rolled back to round %d's model, gamma halved to %.3g "
                    "(recovery %d of at most %d)", peer.peer_id, round_index, reason, good.round,
                    peer.engine.gamma, self.halvings, self.max_halvings)
        return event

    # --- persistence (the checkpoint keeps the count, so a restarted daemon stays bounded) --------------------
    def state_dict(self) -> dict[str, int]:
        return {"halvings": self.halvings, "recoveries": self.recoveries}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.halvings = int(sd.get("halvings", 0))
        self._restored_recoveries = int(sd.get("recoveries", 0))
        self.events.clear()

    def _snapshot(self, peer: Peer, round_index: int) -> None:
        z, buffers = peer.good_state()
        self.snapshots.append(Snapshot(round_index, z, buffers))
