"""The three gossip algorithms of the paper, written as mass transfers (docs/method.md#gossip-algorithms), each owning
its own state.

Each algorithm turns the sender's state into one payload per out-edge and tells both ends how much mass a payload
moves. The rule that keeps all of them exact: the receiver adds the mass it decodes from the wire and the sender
subtracts exactly that decoded amount, never the pre-compression value, so whatever the codec loses stays with the
sender (as error feedback or as Choco's replica gap) instead of vanishing from the network.

- ``sgp``: SGP / D-PSGD. Payload = x; mass = scale * decoded payload. No state.
- ``deepsqueeze``: Deep-Squeeze with push-sum (Sparse-Push). s = x + e, q = C[s], e = s - q, once per round for all
  edges; mass = scale * decoded q. State: the error buffer e.
- ``choco``: Choco-SGD with push-sum (Quant-SGP). One public replica per directed edge, of the sender's DE-BIASED model:
  q = C[z - zhat_ij], zhat_ij += q at both ends; the message moves push-sum weight ``weight = gamma * share * w`` and
  numerator ``weight * zhat_ij`` (both ends compute the same product, so mass is exact). The paper keeps the replica of
  the numerator x; we track z instead because x jumps by a whole share (25-50%) every time the peer sends or receives,
  and in an asynchronous fleet, where peers send at different rates, a 1%-top-k replica of x never caught up: the moved
  numerator and the moved weight disagreed and the daemons diverged (docs/method.md#departures-from-the-paper).
  z moves only by training and mixing, so its replica tracks it. Replicas start from the fleet's common
  initial model (all peers build it from the same seed), so early messages carry only the training progress. A replica
  that is all zeros (no common start given)
  is first refreshed by one dense message (no top-k, same bit width). State: the replicas of every edge.

Sending runs in three steps so that the slow one holds no lock (the daemon applies received messages meanwhile):
``prepare`` copies what the encoding needs (under the engine's lock), ``encode`` compresses (no lock, touches no
shared state), ``commit`` makes the algorithm's own state changes (under the lock) and may drop an edge whose state
changed in between (a Choco edge reset by a handshake).
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from peer.compress.codec import CodecConfig, Decoded, encode
from peer.compress.layout import Layout
from peer.gossip import kinds

Undo = tuple[torch.Tensor | None, torch.Tensor]


@dataclass
class Sent:
    """One message as its sender remembers it until it is settled.

    Attributes:
        payload: the codec bytes (what travels).
        decoded: what the receiver decodes from ``payload`` (bit-identical).
        weight: push-sum weight moved (dimensionless).
        scale: factor applied to the decoded mass (gamma * share; SGP and Deep-Squeeze).
        undo: Choco only: the replica entries this message overwrote, (indices or None for all, old values), so a
            retraction restores the replica bit for bit, equal to the receiver's.
        payload_bytes: length of the payload once it was handed to the transport (the window's byte budget counts
            it; 0 for records restored from a checkpoint, which does not keep it).
    """

    payload: bytes
    decoded: Decoded
    weight: float = 0.0
    scale: float = 0.0
    undo: Undo | None = None
    payload_bytes: int = 0

    def checkpoint_record(self) -> dict[str, Any]:
        """The record a checkpoint keeps of this in-flight message: a dict of named fields (plain tensors and
        numbers, so torch's weights-only loader reads it). The payload is not kept: the mass is in ``decoded``."""
        undo_indices, undo_values = self.undo if self.undo is not None else (None, None)
        return {"indices": self.decoded.indices, "values": self.decoded.values, "weight": self.weight,
                "scale": self.scale, "undo_indices": undo_indices, "undo_values": undo_values}

    @classmethod
    def from_checkpoint_record(cls, record: dict[str, Any], device: torch.device) -> Sent:
        """The message :meth:`checkpoint_record` described, its tensors on ``device``."""
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        old = record["undo_values"]
        undo = None if old is None else (move(record["undo_indices"]), old.to(device))
        return cls(b"", Decoded(move(record["indices"]), record["values"].to(device)), float(record["weight"]),
                   float(record["scale"]), undo)


@dataclass
class Plan:
    """What one round's encoding needs, copied under the lock (``inputs``: receiver -> vector to compress)."""

    inputs: dict[str, torch.Tensor]
    codecs: dict[str, CodecConfig]
    tokens: dict[str, int]
    shared: torch.Tensor | None = None
    reference: torch.Tensor | None = None  # the model a codec's step_floor is relative to (Choco: z)


def digest(vector: torch.Tensor) -> bytes:
    """16-byte digest of a vector's exact bits (equal at both ends of a healthy Choco edge)."""
    return hashlib.blake2b(vector.detach().cpu().contiguous().numpy().tobytes(), digest_size=16).digest()


class Algorithm(ABC):
    """A gossip algorithm and its own per-peer state.

    Args:
        layout: the parameter layout payloads are coded against.
        codec: compression of payloads.
        device: where the algorithm's own state lives (the device of the peer's x).
    """

    name: ClassVar[kinds.Algorithm]

    def __init__(self, layout: Layout, codec: CodecConfig, device: torch.device | None = None) -> None:
        self.layout = layout
        self.codec = codec
        self.device = device or torch.device("cpu")

    # --- sending ---------------------------------------------------------------------------------------------
    @abstractmethod
    def prepare(self, x: torch.Tensor, w: float, receivers: list[str]) -> Plan:
        """Copy what encoding this round's payloads needs (caller holds the engine lock)."""

    def encode(self, plan: Plan, generator: torch.Generator) -> dict[str, Sent]:
        """Compress every receiver's input (no lock; touches no shared state). Receivers sharing one input
        (SGP, Deep-Squeeze) share one payload."""
        if plan.shared is not None:
            payload, decoded = encode(plan.shared, self.layout, self.codec, generator)
            return {r: Sent(payload, decoded) for r in plan.inputs}
        out = {}
        for receiver, vector in plan.inputs.items():
            payload, decoded = encode(vector, self.layout, plan.codecs[receiver], generator, plan.reference)
            out[receiver] = Sent(payload, decoded)
        return out

    def commit(self, plan: Plan, sent: dict[str, Sent]) -> dict[str, Sent]:
        """Make this round's own state changes (caller holds the lock); returns the messages still valid."""
        return sent

    def mass_into(self, receiver: str, sent: Sent, target: torch.Tensor, sign: float) -> None:
        """``target += sign * (numerator mass the message moves)``. For Choco this reads the current replica,
        so call it right after commit, or while retracting newest first."""
        sent.decoded.add_into(target, sign * sent.scale)

    def retract(self, receiver: str, sent: Sent) -> None:
        """Undo the message's effect on this algorithm's own state (after its mass was taken back)."""

    def flight_mass_into(self, receiver: str, in_flight: list[Sent], target: torch.Tensor) -> None:
        """``target += `` the mass of an edge's in-flight messages (oldest first), without changing state."""
        for sent in in_flight:
            self.mass_into(receiver, sent, target, 1.0)

    # --- receiving -------------------------------------------------------------------------------------------
    def noise_floor(self) -> float:
        """How far an honest message may move a peer's model relative to its norm by the codec alone (the robust
        rule's smallest radius, peer/gossip/robust.py): a dense payload quantised to b bits carries rounding of
        (max / rms) / (2**(b-1) * sqrt 12) of its norm - 0.7-1.4% at 8 bits for layer weights (max / rms 3-6) - and a
        message moves the receiver by its weight share of that, a third to a half: 2**(1-b) (0.8% at 8 bits) covers
        it. The floor is also what a plausible insider may move the peer by per message, so it is kept that tight."""
        return 2.0 ** (1 - self.codec.bits) if self.codec.bits < 32 else 0.0

    def radius_scale(self) -> float:
        """Factor on the robust rule's radius for this algorithm (peer/gossip/robust.py)."""
        return 1.0

    def mass_carries_model(self) -> bool:
        """Whether a message's numerator mass over its weight is the sender's model (dense push-sum: its shares;
        Choco: its replica), so the robust rule can judge how plausible that model is; Deep-Squeeze's sparse
        numerator with full weight is not one."""
        return True

    def models_comparable(self) -> bool:
        """Whether the models its messages imply are comparable across neighbours (the robust rule's outliers,
        peer/gossip/robust.py): a dense message carries its sender's model as it is, while a Choco replica lags
        its sender's model by what compression has not carried yet - by how much depends on each edge's traffic,
        so in a real asynchronous fleet one honest neighbour's replica sat 8 times farther than another's for 10
        rounds early in training (a netns test at 99% top-k)."""
        return self.mass_carries_model()

    def common_start(self) -> torch.Tensor | None:
        """The model every peer started from, where a message's implied model is its sender's trajectory from it
        (the robust rule compares how far a neighbour's went with how far this peer's did, peer/gossip/robust.py);
        None: it is not (a dense message carries the model itself, judged by its distance alone)."""
        return None

    def incoming_mass(self, sender: str, decoded: Decoded, weight: float, scale: float) -> torch.Tensor:
        """The numerator mass :meth:`apply` would add, as a new dense vector; changes no state (the robust receive
        rule judges it before anything is applied, peer/gossip/robust.py)."""
        mass = torch.zeros(self.layout.numel, dtype=torch.float32, device=self.device)
        decoded.add_into(mass, scale)
        return mass

    def apply(self, sender: str, decoded: Decoded, weight: float, scale: float, x: torch.Tensor) -> None:
        """Add a received message's mass into the numerator ``x`` (caller holds the lock)."""
        decoded.add_into(x, scale)

    def take(self, sender: str, decoded: Decoded) -> None:
        """Update this algorithm's receive-side state for an admitted message whose mass (:meth:`incoming_mass`)
        the engine applies itself (the robust rule may hold part of it back); nothing for stateless receivers."""

    def sender_view(self, sender: str, decoded: Decoded, weight: float, scale: float) -> torch.Tensor | None:
        """The sender's de-biased model as this receiver knows it after applying a message, or None where the
        messages do not tell it (Deep-Squeeze sends a compressed numerator with error feedback): what the
        consensus phase judges distances by (docs/method.md#the-consensus-phase)."""
        return None

    # --- handshake and membership ----------------------------------------------------------------------------
    def out_digests(self, receiver: str, in_flight: list[Sent]) -> tuple[bytes, ...]:
        """Replica digests after 0..n of the edge's in-flight messages (oldest first); empty without replicas."""
        return ()

    def in_digest(self, sender: str) -> bytes:
        """This end's replica digest of the edge from ``sender`` (b"" without replicas)."""
        return b""

    def reset_out(self, receiver: str) -> None:
        """Return the edge's sender-side state to the common start (edge reset)."""

    def reset_in(self, sender: str) -> None:
        """Return the edge's receiver-side state to the common start (edge reset)."""

    def forget(self, peer_id: str) -> None:
        """Drop every per-peer state of a peer that left (nothing may be in flight to it)."""

    def peers(self) -> set[str]:
        """Peers this algorithm keeps state for (bounded-memory checks)."""
        return set()

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (state of another algorithm is refused by the engine)."""

    def state_nbytes(self) -> int:
        """Bytes of tensor state the algorithm holds (Choco: two replicas per neighbour; memory breakdowns)."""
        return _tensor_nbytes(self.state_dict())


class Sgp(Algorithm):
    """Uncompressed (or dense-quantized) push-sum: the payload is the numerator itself."""

    name = kinds.Algorithm.SGP

    def prepare(self, x: torch.Tensor, w: float, receivers: list[str]) -> Plan:
        shared = x.clone()
        return Plan(inputs=dict.fromkeys(receivers, shared), codecs={}, tokens={}, shared=shared)


    def sender_view(self, sender: str, decoded: Decoded, weight: float, scale: float) -> torch.Tensor | None:
        """A dense message is the sender's numerator times ``scale``, with weight ``scale * w``: z = values / w."""
        if decoded.indices is not None:
            return None
        return decoded.values * (scale / weight)


class DeepSqueeze(Algorithm):
    """Compressed push-sum with error feedback on the sender's model (one compression per round)."""

    name = kinds.Algorithm.DEEPSQUEEZE

    def __init__(self, layout: Layout, codec: CodecConfig, device: torch.device | None = None) -> None:
        super().__init__(layout, codec, device)
        self.error = torch.zeros(layout.numel, dtype=torch.float32, device=self.device)

    def prepare(self, x: torch.Tensor, w: float, receivers: list[str]) -> Plan:
        s = x + self.error
        return Plan(inputs=dict.fromkeys(receivers, s), codecs={}, tokens={}, shared=s)

    def noise_floor(self) -> float:
        # a message moves the weight of every coordinate but the numerator of the kept ones only (error feedback
        # sends the rest later): an honest contribution is about gamma * share of the model's norm, a third at
        # gamma 1, so the radius bounds gross attacks only
        return 0.5

    def mass_carries_model(self) -> bool:
        return False

    def commit(self, plan: Plan, sent: dict[str, Sent]) -> dict[str, Sent]:
        if sent and plan.shared is not None:
            decoded = next(iter(sent.values())).decoded
            self.error.copy_(plan.shared)
            decoded.add_into(self.error, -1.0)
        return sent

    def state_dict(self) -> dict[str, Any]:
        return {"error": self.error}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.error = state["error"].to(self.device, copy=True)


class Choco(Algorithm):
    """Compressed push-sum on the difference to a per-edge public replica.

    Args:
        replica_init: the model every peer of the fleet starts from; new and reset replicas start from it (None =
            zeros, then an edge's first message is dense). The handshake compares replica digests, so a peer built
            differently is detected and the edge reset, never silently inconsistent.
    """

    name = kinds.Algorithm.CHOCO

    def __init__(self, layout: Layout, codec: CodecConfig, device: torch.device | None = None,
                 replica_init: torch.Tensor | None = None) -> None:
        super().__init__(layout, codec, device)
        self.first_codec = CodecConfig(compression=0.0, bits=codec.bits, rounding=codec.rounding)
        self.replica_init = (None if replica_init is None
                             else replica_init.detach().to(self.device, torch.float32, copy=True))
        self.replicas_out: dict[str, torch.Tensor] = {}
        self.replicas_in: dict[str, torch.Tensor] = {}
        self.generation: dict[str, int] = {}  # per out-edge: bumped whenever the replica changes outside a send

    def _new_replica(self) -> torch.Tensor:
        if self.replica_init is not None:
            return self.replica_init.clone()
        return torch.zeros(self.layout.numel, dtype=torch.float32, device=self.device)

    def replica_out(self, receiver: str) -> torch.Tensor:
        """Sender's public replica of edge (self -> receiver), created from ``replica_init`` on first use."""
        if receiver not in self.replicas_out:
            self.replicas_out[receiver] = self._new_replica()
        return self.replicas_out[receiver]

    def replica_in(self, sender: str) -> torch.Tensor:
        """Receiver's replica of edge (sender -> self)."""
        if sender not in self.replicas_in:
            self.replicas_in[sender] = self._new_replica()
        return self.replicas_in[sender]

    def prepare(self, x: torch.Tensor, w: float, receivers: list[str]) -> Plan:
        z = x / w
        plan = Plan(inputs={}, codecs={}, tokens={}, reference=z if self.codec.step_floor > 0 else None)
        for receiver in receivers:
            replica = self.replica_out(receiver)
            plan.inputs[receiver] = z - replica
            plan.codecs[receiver] = self.codec if bool(replica.any()) else self.first_codec
            plan.tokens[receiver] = self.generation.get(receiver, 0)
        return plan

    def commit(self, plan: Plan, sent: dict[str, Sent]) -> dict[str, Sent]:
        kept = {}
        for receiver, message in sent.items():
            if self.generation.get(receiver, 0) != plan.tokens[receiver]:
                continue  # the edge was reset or retracted while encoding: the payload no longer fits its replica
            replica = self.replica_out(receiver)
            indices = message.decoded.indices
            message.undo = (indices, replica.clone() if indices is None else replica[indices].clone())
            message.decoded.add_into(replica, 1.0)
            kept[receiver] = message
        return kept

    def mass_into(self, receiver: str, sent: Sent, target: torch.Tensor, sign: float) -> None:
        target.add_(self.replica_out(receiver), alpha=sign * sent.weight)

    def retract(self, receiver: str, sent: Sent) -> None:
        assert sent.undo is not None
        _restore(self.replica_out(receiver), sent.undo)
        self.generation[receiver] = self.generation.get(receiver, 0) + 1

    def flight_mass_into(self, receiver: str, in_flight: list[Sent], target: torch.Tensor) -> None:
        replica = self.replica_out(receiver).clone()
        for sent in reversed(in_flight):
            target.add_(replica, alpha=sent.weight)
            assert sent.undo is not None
            _restore(replica, sent.undo)

    def noise_floor(self) -> float:
        return 0.0  # the codec rounds the difference to the replica, not the model

    def models_comparable(self) -> bool:
        return False  # a replica lags its sender's model by each edge's own backlog

    def radius_scale(self) -> float:
        # a Choco message moves the model by a small gamma share at a time, so an honest one stays well inside the
        # peer's own training movement, while an insider allowed 4x it through its replica outpaces training
        # (docs/decisions/robust-radius.md)
        return 0.25

    def common_start(self) -> torch.Tensor | None:
        # replicas start from the fleet's initial model and move by what their sender sent: a trajectory from it
        return self.replica_init

    def incoming_mass(self, sender: str, decoded: Decoded, weight: float, scale: float) -> torch.Tensor:
        # the replica as it would be after the update, times the weight: the contribution "after replica update"
        mass = self.replicas_in[sender].clone() if sender in self.replicas_in else self._new_replica()
        decoded.add_into(mass, 1.0)
        return mass.mul_(weight)

    def apply(self, sender: str, decoded: Decoded, weight: float, scale: float, x: torch.Tensor) -> None:
        replica = self.replica_in(sender)
        decoded.add_into(replica, 1.0)
        x.add_(replica, alpha=weight)

    def take(self, sender: str, decoded: Decoded) -> None:
        decoded.add_into(self.replica_in(sender), 1.0)  # the edge's two replicas move together, clipped or not

    def sender_view(self, sender: str, decoded: Decoded, weight: float, scale: float) -> torch.Tensor | None:
        """The replica of the edge: the sender's de-biased model up to what compression has not carried yet."""
        return self.replica_in(sender)

    def out_digests(self, receiver: str, in_flight: list[Sent]) -> tuple[bytes, ...]:
        replica = self.replica_out(receiver)
        digests = [digest(replica)]
        if in_flight:
            replica = replica.clone()
            for sent in reversed(in_flight):
                assert sent.undo is not None
                _restore(replica, sent.undo)
                digests.append(digest(replica))
        return tuple(reversed(digests))

    def in_digest(self, sender: str) -> bytes:
        return digest(self.replica_in(sender))

    def reset_out(self, receiver: str) -> None:
        self.replicas_out[receiver] = self._new_replica()
        self.generation[receiver] = self.generation.get(receiver, 0) + 1

    def reset_in(self, sender: str) -> None:
        self.replicas_in[sender] = self._new_replica()

    def forget(self, peer_id: str) -> None:
        self.replicas_out.pop(peer_id, None)
        self.replicas_in.pop(peer_id, None)
        self.generation.pop(peer_id, None)

    def peers(self) -> set[str]:
        return set(self.replicas_out) | set(self.replicas_in)

    def state_dict(self) -> dict[str, Any]:
        return {"replicas_out": self.replicas_out, "replicas_in": self.replicas_in}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.replicas_out = {k: v.to(self.device, copy=True) for k, v in state["replicas_out"].items()}
        self.replicas_in = {k: v.to(self.device, copy=True) for k, v in state["replicas_in"].items()}
        self.generation = {}


def _tensor_nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):  # list() copies atomically: status reads this while the round thread inserts
        return sum(_tensor_nbytes(v) for v in list(value.values()))
    if isinstance(value, (list, tuple)):
        return sum(_tensor_nbytes(v) for v in value)
    return 0


def _restore(replica: torch.Tensor, undo: Undo) -> None:
    """Write back the replica entries a retracted message overwrote (bit-exact undo)."""
    indices, old = undo
    if indices is None:
        replica.copy_(old)
    else:
        replica[indices] = old


def make_algorithm(name: str, layout: Layout, codec: CodecConfig, device: torch.device | None = None,
                   replica_init: torch.Tensor | None = None) -> Algorithm:
    """Build an algorithm by name (a :class:`peer.gossip.kinds.Algorithm` or its string); SGP takes a dense codec
    (compression refused, bits honoured)."""
    kind = kinds.Algorithm.parse(name)
    if kind is kinds.Algorithm.SGP and codec.compression != 0.0:
        raise ValueError("compression: sgp sends the dense model; use deepsqueeze or choco for top-k compression")
    if kind is kinds.Algorithm.CHOCO:
        return Choco(layout, codec, device, replica_init)
    return {kinds.Algorithm.SGP: Sgp, kinds.Algorithm.DEEPSQUEEZE: DeepSqueeze}[kind](layout, codec, device)
