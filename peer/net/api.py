"""The interface between the daemon and the transport: who a peer is, and what the network may ask of it.

The transport never touches a gossip engine directly. It calls a :class:`GossipGate` (the daemon's implementation
is peer/daemon/gate.py over a :class:`~peer.runtime.peer.Peer`), whose methods are synchronous and cheap (no I/O;
they run on the event loop) and each atomic with respect to the trainer, which updates x under the same lock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from peer.finite import all_finite
from peer.gossip import ledger
from peer.gossip.algorithms import Sent

PROTOCOL_VERSION = 9  # 2: codec payload format v2; 3: a window of in-flight updates per edge, cumulative acks;
# 4: mutual TLS identities, REFUSAL_SUPERSEDED sent, REFUSAL_UNAUTHENTICATED / REFUSAL_LIMIT, bounded numbers;
# 5: UpdateBatch frames (several whole updates in one stream message); 6: QuarantineNotice frames; 7: notices go
# to every live peer, and every peer drops a suspect they name from the schedule at one round (the same frames: a
# peer of 6 would compute another graph once anyone quarantines); 8: a payload may come in a deflate envelope
# (peer/compress/deflate.py; the consensus phase's by default, which a peer of 7 would refuse); 9: ConsensusProbe
# frames (a model's count-sketch in a consensus phase round; a peer of 8 would end the stream on one)


@dataclass(frozen=True)
class Identity:
    """Who a peer is on the wire.

    Attributes:
        peer_id: stable id of the peer (state directory identity).
        protocol_version: wire protocol version (peers with another one are refused).
        fingerprint: model architecture + config fingerprint (peers with another one are refused).
        fleet: operator-chosen fleet name (peers of another fleet are refused).
        listen_addr: ``host:port`` the peer's gRPC server listens on.
        algorithm: gossip algorithm id ("sgp", "deepsqueeze", "choco"); "" = not checked.
    """

    peer_id: str
    protocol_version: int
    fingerprint: str
    fleet: str
    listen_addr: str = ""
    algorithm: str = ""

    def mismatch(self, other: "Identity") -> tuple[str, str, str] | None:
        """The first field that forbids gossip between the two peers: (reason, ours, theirs), or None.

        Reasons are counter keys: "protocol", "fleet", "fingerprint", "algorithm", "self".
        An empty algorithm on either side is not checked (older or non-gossiping peers).
        """
        if other.protocol_version != self.protocol_version:
            return "protocol", str(self.protocol_version), str(other.protocol_version)
        if other.fleet != self.fleet:
            return "fleet", self.fleet, other.fleet
        if other.fingerprint != self.fingerprint:
            return "fingerprint", self.fingerprint, other.fingerprint
        if self.algorithm and other.algorithm and other.algorithm != self.algorithm:
            return "algorithm", self.algorithm, other.algorithm
        if other.peer_id == self.peer_id:
            return "self", self.peer_id, other.peer_id
        return None


class StreamGate(Protocol):
    """What both halves of a Gossip stream need of a peer (peer/net/inbound.py, peer/net/outbound.py): its identity
    and the exactly-once entry points. Every method is synchronous and atomic (the peer's lock)."""

    def identity(self) -> Identity:
        """This peer's identity (constant while the server runs)."""
        ...

    def answer_hello(self, sender_id: str, hello: ledger.Hello) -> ledger.HelloReply:
        """Receiver side of the exactly-once handshake for edge ``sender_id -> self``.

        Raises:
            peer.gossip.engine.GossipInputError: malformed Hello or the peer is not accepting; nothing changed.
        """
        ...

    def receive(self, sender_id: str, seq: int, weight: float, scale: float, payload: bytes | memoryview) -> bool:
        """Apply one complete update once; True if applied, False if a duplicate/fenced copy was dropped.
        ``payload`` is read-only and bytes-like: the server passes a memoryview into the received frame (no copy),
        so a gate that keeps the payload beyond the call copies it (a kept slice would pin the whole frame).

        Raises:
            peer.gossip.engine.GossipInputError: the update is malformed or hostile; nothing changed.
        """
        ...

    def note_quarantines(self, sender_id: str, quarantined: list[str]) -> None:
        """``sender_id`` says it quarantined the peers ``quarantined`` (a QuarantineNotice; each names every peer
        the sender quarantines now, so it replaces the sender's earlier one). Never raises for what it names.

        Raises:
            peer.gossip.engine.GossipInputError: the sender is over its rate ("update_rate"); nothing changed.
        """
        ...

    def note_probe(self, sender_id: str, sketch: bytes) -> None:
        """``sender_id``'s ConsensusProbe arrived: ``sketch`` is the count-sketch of its model
        (peer/gossip/sketch.py), for this peer's consensus phase to judge its distance by.

        Raises:
            peer.gossip.engine.GossipInputError: the sender is over its rate ("update_rate") or the sketch is not
                one ("bad_probe"); nothing changed.
        """
        ...

    def hello_for(self, receiver_id: str) -> ledger.Hello:
        """Sender side: the Hello that (re)opens edge ``self -> receiver_id``."""
        ...

    def on_hello_reply(self, receiver_id: str, hello: ledger.Hello,
                       reply: ledger.HelloReply) -> ledger.Settlement[Sent]:
        """Sender side: settle every in-flight message of the edge (delivered, or mass taken back)."""
        ...

    def on_ack(self, receiver_id: str, seq: int) -> ledger.Settlement[Sent]:
        """Sender side: the receiver acknowledged ``seq`` and every earlier seq; stale acks settle nothing."""
        ...

    def in_flight_count(self, receiver_id: str) -> int:
        """Messages to ``receiver_id`` sent and not yet settled."""
        ...

    def max_payload_bytes(self) -> int:
        """Largest valid update payload for this peer's model layout (bytes): what the server may buffer for one
        update (peer.compress.codec.max_payload_bytes)."""
        ...


class GossipGate(StreamGate, Protocol):
    """What the daemon gives the gRPC transport: the stream's entry points (:class:`StreamGate`) plus pacing, the
    model for joiners and status."""

    def model_bytes(self) -> bytes:
        """The de-biased model z = x / w, for a joiner (format: see :func:`model_to_bytes`)."""
        ...

    async def before_ack(self, sender_id: str) -> None:
        """Awaited after an update was applied and before its Ack goes out: the receiver's backpressure.

        The update's mass is already applied (exactly once); delaying the Ack only keeps the sender's window full,
        so a fast sender cannot push many messages into a slow receiver between two of its rounds.
        """
        ...

    def status(self) -> dict[str, Any]:
        """JSON-ready status snapshot (served by the Status RPC: the same document as the control socket)."""
        ...


def model_to_bytes(z: torch.Tensor) -> bytes:
    """A flat model vector as little-endian float32 bytes (4 bytes per parameter, layout order)."""
    return z.detach().to(torch.float32).cpu().contiguous().numpy().astype("<f4", copy=False).tobytes()


def model_from_bytes(data: bytes, numel: int) -> torch.Tensor:
    """Inverse of :func:`model_to_bytes`; raises ValueError on a length mismatch or non-finite values."""
    if len(data) != 4 * numel:
        raise ValueError(f"model: got {len(data)} bytes, the layout needs {4 * numel} ({numel} float32)")
    z = torch.from_numpy(np.frombuffer(data, dtype="<f4").astype(np.float32))
    if not all_finite(z):
        raise ValueError("model: contains NaN or Inf")
    return z
