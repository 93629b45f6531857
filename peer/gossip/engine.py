"""One peer's gossip state machine: push-sum state, algorithm, per-edge ledgers, in-flight mass.

This is the single step function the simulator and the daemon share (DESIGN.md 1): they differ only in how the
:class:`OutMessage` objects travel and when acks, hellos and replies come back. Everything here is pure tensor code
(no sockets, no threads); callers serialise access to one engine (the daemon's asyncio loop does by construction).

Message life cycle on edge ``i -> j``:
    i.send_round([j, ...])      -> OutMessage(seq, weight, scale, payload); i subtracted the decoded mass
    j.receive(i, ...)           -> applies mass once (or drops a duplicate / fenced copy), raises on bad input
    i.on_ack(j, seq)            -> i forgets the in-flight record
  or, after a broken stream:
    i.hello_for(j) -> j.answer_hello(i, hello) -> i.on_hello_reply(j, reply): delivered, or mass taken back

Invariant (tested): ``sum_i x_i + sum in-flight mass`` and ``sum_i w_i + sum in-flight weight`` change only by
gradient steps.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Collection
from dataclasses import dataclass

import torch

from peer.compress.codec import CodecConfig, Decoded, PayloadError, decode
from peer.compress.layout import Layout
from peer.gossip.algorithms import Algorithm, Encoded, make_algorithm
from peer.gossip.ledger import Hello, HelloReply, InboundEdge, OutboundEdge, Verdict, answer_hello, judge_reply
from peer.gossip.pushsum import PushSumState


class GossipInputError(ValueError):
    """A received message was refused; the engine's state is unchanged. ``reason`` is a short counter key."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass
class OutMessage:
    """One message of a directed edge, as the transport carries it.

    Attributes:
        sender, receiver: peer ids.
        seq: the edge's sequence number (1, 2, ...).
        round: the sender's local round (informational).
        weight: push-sum weight mass moved (dimensionless).
        scale: factor the receiver applies to the decoded mass (gamma * share).
        payload: codec bytes.
    """

    sender: str
    receiver: str
    seq: int
    round: int
    weight: float
    scale: float
    payload: bytes


@dataclass
class _Pending:
    """Sender-side record of an unacknowledged message: enough to take its mass back exactly."""

    seq: int
    weight: float
    scale: float
    decoded: Decoded
    replica_undo: tuple[torch.Tensor | None, torch.Tensor] | None = None


class GossipEngine:
    """Push-sum gossip of one peer.

    Args:
        peer_id: this peer's id.
        layout: parameter layout shared by all peers (payloads carry its digest).
        x0: initial flat model vector (becomes x with w = 1).
        algorithm: "sgp", "deepsqueeze" or "choco".
        codec: compression config for payloads.
        gamma: consensus step size (forced to 1 for sgp; about 0.01-0.5 with 99% sparsification).
        seed: seeds stochastic rounding.
        replica_init: the model every peer of the fleet starts from (same architecture, same seed), used as the
            starting value of new Choco edge replicas at both ends, so the first messages carry only the training
            progress z - z0 instead of a dense copy of the model. None = zeros (then an edge's first message is
            dense). The daemon's handshake compares replica digests, so a peer built differently is detected and
            the edge reset to zeros, never silently inconsistent.
    """

    def __init__(self, peer_id: str, layout: Layout, x0: torch.Tensor, algorithm: str, codec: CodecConfig,
                 gamma: float = 1.0, seed: int = 0, replica_init: torch.Tensor | None = None) -> None:
        if not (0.0 < gamma <= 1.0) or not math.isfinite(gamma):
            raise ValueError(f"gamma: consensus step size must be in (0, 1], got {gamma}")
        if x0.numel() != layout.numel:
            raise ValueError(f"x0 has {x0.numel()} entries but the layout has {layout.numel}")
        self.peer_id = peer_id
        self.layout = layout
        self.algorithm: Algorithm = make_algorithm(algorithm, codec)
        self.gamma = 1.0 if algorithm == "sgp" else gamma
        self.state = PushSumState.from_model_vector(x0)
        self.error: torch.Tensor | None = torch.zeros_like(self.state.x) if algorithm == "deepsqueeze" else None
        self.out_edges: dict[str, OutboundEdge] = {}
        self.in_edges: dict[str, InboundEdge] = {}
        self._pending: dict[str, _Pending] = {}
        self._replicas_out: dict[str, torch.Tensor] = {}
        self._replicas_in: dict[str, torch.Tensor] = {}
        self._generator = torch.Generator(device=x0.device).manual_seed(seed)
        self._replica_init = None if replica_init is None else replica_init.detach().clone().to(torch.float32)

    # --- state views -------------------------------------------------------------------------------------------
    @property
    def x(self) -> torch.Tensor:
        return self.state.x

    @property
    def w(self) -> float:
        return self.state.w

    def replica_out(self, receiver: str) -> torch.Tensor:
        """Sender's public replica of edge (self -> receiver), created from ``replica_init`` on first use."""
        if receiver not in self._replicas_out:
            self._replicas_out[receiver] = self._new_replica()
        return self._replicas_out[receiver]

    def _replica_in(self, sender: str) -> torch.Tensor:
        if sender not in self._replicas_in:
            self._replicas_in[sender] = self._new_replica()
        return self._replicas_in[sender]

    def _new_replica(self) -> torch.Tensor:
        return torch.zeros_like(self.state.x) if self._replica_init is None else self._replica_init.clone()

    def busy(self, receiver: str) -> bool:
        """Whether the edge to ``receiver`` has an unacknowledged message (it is skipped this round)."""
        return receiver in self._pending

    def in_flight(self) -> tuple[torch.Tensor, float]:
        """Total mass and weight this peer has subtracted but not yet seen settled (for the invariant)."""
        mass = torch.zeros_like(self.state.x)
        weight = 0.0
        for receiver, pending in self._pending.items():
            self._pending_mass_into(receiver, pending, mass, 1.0)
            weight += pending.weight
        return mass, weight

    # --- sending -----------------------------------------------------------------------------------------------
    def send_round(self, receivers: list[str], round_index: int,
                   unavailable: Collection[str] = ()) -> list[OutMessage]:
        """Build this round's messages and subtract their mass.

        The share is ``1 / (len(receivers) + 1)`` per out-neighbour (column-stochastic, decided by the schedule);
        busy edges and ``unavailable`` ones (link down) are skipped and the sender simply keeps their share.
        """
        targets = [r for r in dict.fromkeys(receivers) if r != self.peer_id]
        idle = [r for r in targets if not self.busy(r) and r not in unavailable]
        if not idle:
            return []
        share = 1.0 / (len(targets) + 1)
        scale = self.gamma * share
        shared = self.algorithm.begin_round(self, self._generator)
        messages = []
        for receiver in idle:
            encoded: Encoded = self.algorithm.encode_edge(self, receiver, shared, self._generator)
            weight = scale * self.state.w
            edge = self.out_edges.setdefault(receiver, OutboundEdge())
            pending = _Pending(seq=edge.issue(), weight=weight, scale=scale, decoded=encoded.decoded,
                               replica_undo=encoded.replica_undo)
            self._pending[receiver] = pending
            self._pending_mass_into(receiver, pending, self.state.x, -1.0)
            self.state.w -= weight
            messages.append(OutMessage(self.peer_id, receiver, pending.seq, round_index, weight, scale,
                                       encoded.payload))
        return messages

    def _pending_mass_into(self, receiver: str, pending: _Pending, target: torch.Tensor, sign: float) -> None:
        """target += sign * (the mass this pending message moves)."""
        if self.algorithm.has_replicas:
            target.add_(self.replica_out(receiver), alpha=sign * pending.weight)
        else:
            pending.decoded.add_into(target, sign * pending.scale)

    def on_ack(self, receiver: str, seq: int) -> None:
        """The receiver applied (or dropped as duplicate) message ``seq``: forget it. Stale acks are ignored."""
        pending = self._pending.get(receiver)
        if pending is not None and pending.seq == seq:
            del self._pending[receiver]
            self.out_edges[receiver].settle()

    def hello_for(self, receiver: str) -> Hello:
        """What to send when (re)opening the edge to ``receiver``."""
        edge = self.out_edges.setdefault(receiver, OutboundEdge())
        if not self.algorithm.has_replicas:
            return Hello(next_seq=edge.next_seq, retract_seq=edge.in_flight_seq)
        replica = self.replica_out(receiver)
        applied = replica_digest(replica)
        pending = self._pending.get(receiver)
        not_applied = applied
        if pending is not None and pending.replica_undo is not None:
            before = replica.clone()
            _restore(before, pending.replica_undo)
            not_applied = replica_digest(before)
        return Hello(next_seq=edge.next_seq, retract_seq=edge.in_flight_seq, replica_digest=not_applied,
                     replica_digest_applied=applied)

    def on_hello_reply(self, receiver: str, reply: HelloReply) -> Verdict:
        """Settle the in-flight message from the receiver's reply: forget it or take its mass back."""
        edge = self.out_edges.setdefault(receiver, OutboundEdge())
        verdict = judge_reply(edge, reply)
        if verdict is Verdict.RETRACTED:
            self._take_back(receiver)
        elif verdict is Verdict.DELIVERED:
            del self._pending[receiver]
        edge.settle()
        edge.resume_after(reply.fence)
        if reply.reset and self.algorithm.has_replicas:
            self.replica_out(receiver).zero_()
        return verdict

    def _take_back(self, receiver: str) -> None:
        pending = self._pending.pop(receiver)
        self._pending_mass_into(receiver, pending, self.state.x, 1.0)
        self.state.w += pending.weight
        if pending.replica_undo is not None:
            _restore(self.replica_out(receiver), pending.replica_undo)

    # --- receiving ---------------------------------------------------------------------------------------------
    def answer_hello(self, sender: str, hello: Hello) -> HelloReply:
        """Receiver side of the handshake (atomic: the caller holds the engine)."""
        edge = self.in_edges.setdefault(sender, InboundEdge())
        digest = replica_digest(self._replica_in(sender)) if self.algorithm.has_replicas else b""
        reply = answer_hello(edge, hello, digest)
        if reply.reset and self.algorithm.has_replicas:
            self._replica_in(sender).zero_()
        return reply

    def receive(self, sender: str, seq: int, weight: float, scale: float, payload: bytes) -> bool:
        """Apply one message exactly once.

        Returns:
            True if its mass was applied, False if it was a duplicate or a fenced (retracted) copy.
        Raises:
            GossipInputError: the message is malformed or hostile; nothing was changed.
        """
        if sender == self.peer_id:
            raise GossipInputError("self", "message claims to come from this peer itself")
        if not isinstance(seq, int) or seq < 1:
            raise GossipInputError("bad_seq", f"seq must be a positive integer, got {seq!r}")
        if not (math.isfinite(weight) and weight > 0.0):
            raise GossipInputError("bad_weight", f"push-sum weight must be finite and > 0, got {weight!r}")
        if not (math.isfinite(scale) and 0.0 < scale <= 1.0):
            raise GossipInputError("bad_scale", f"mass scale must be in (0, 1], got {scale!r}")
        edge = self.in_edges.get(sender, InboundEdge())
        if not edge.accepts(seq):
            return False
        try:
            decoded = decode(payload, self.layout)
        except PayloadError as exc:
            raise GossipInputError("bad_payload", f"payload refused: {exc}") from exc  # incl. NaN/Inf values
        if self.algorithm.has_replicas:
            replica = self._replica_in(sender)
            decoded.add_into(replica, 1.0)
            self.state.x.add_(replica, alpha=weight)
        else:
            decoded.add_into(self.state.x, scale)
        self.state.w += weight
        edge.record_applied(seq)
        self.in_edges[sender] = edge
        return True

    # --- membership --------------------------------------------------------------------------------------------
    def forget_peer(self, peer_id: str) -> None:
        """Drop all edge state of a peer that left for good. In-flight mass to it is taken back first."""
        if peer_id in self._pending:
            self._take_back(peer_id)
        self.out_edges.pop(peer_id, None)
        self.in_edges.pop(peer_id, None)
        self._replicas_out.pop(peer_id, None)
        self._replicas_in.pop(peer_id, None)

    # --- checkpoint --------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Everything needed to resume exactly (tensors and plain data; torch.save-able)."""
        return {
            "x": self.state.x, "w": self.state.w, "error": self.error,
            "out_edges": {k: (e.next_seq, e.in_flight_seq) for k, e in self.out_edges.items()},
            "in_edges": {k: (e.last_applied, e.fence) for k, e in self.in_edges.items()},
            "pending": {k: (p.seq, p.weight, p.scale, p.decoded.indices, p.decoded.values, p.replica_undo)
                        for k, p in self._pending.items()},
            "replicas_out": self._replicas_out, "replicas_in": self._replicas_in,
            "generator": self._generator.get_state(),
        }

    def load_state_dict(self, sd: dict) -> None:
        """Restore from :meth:`state_dict` (shapes must match the layout)."""
        if sd["x"].numel() != self.layout.numel:
            raise ValueError("checkpoint is for another model layout")
        self.state = PushSumState(x=sd["x"].clone(), w=float(sd["w"]))
        self.error = None if sd["error"] is None else sd["error"].clone()
        self.out_edges = {k: OutboundEdge(*v) for k, v in sd["out_edges"].items()}
        self.in_edges = {k: InboundEdge(*v) for k, v in sd["in_edges"].items()}
        self._pending = {k: _Pending(seq, weight, scale, Decoded(indices=idx, values=val), undo)
                         for k, (seq, weight, scale, idx, val, undo) in sd["pending"].items()}
        self._replicas_out = {k: v.clone() for k, v in sd["replicas_out"].items()}
        self._replicas_in = {k: v.clone() for k, v in sd["replicas_in"].items()}
        self._generator.set_state(sd["generator"])


def _restore(replica: torch.Tensor, undo: tuple[torch.Tensor | None, torch.Tensor]) -> None:
    """Write back the replica entries a retracted message overwrote (bit-exact undo)."""
    indices, old = undo
    if indices is None:
        replica.copy_(old)
    else:
        replica[indices] = old


def replica_digest(replica: torch.Tensor) -> bytes:
    """16-byte digest of a replica's exact bits; equal at both ends of a healthy Choco edge."""
    return hashlib.blake2b(replica.detach().cpu().contiguous().numpy().tobytes(), digest_size=16).digest()
