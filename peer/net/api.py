"""The interface between the daemon and the transport: what the network may ask of the gossip engine.

The transport never touches a :class:`~peer.gossip.engine.GossipEngine` directly. It calls a :class:`GossipGate`,
whose methods are synchronous and cheap (no I/O; they run on the event loop) and each atomic with respect to the
daemon's trainer, which updates x under the same lock. :class:`EngineGate` is the straightforward implementation.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from peer.gossip import ledger
from peer.gossip.engine import GossipEngine

PROTOCOL_VERSION = 3  # 2: codec payload format v2; 3: a window of in-flight updates per edge, cumulative acks


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


class GossipGate(Protocol):
    """What the daemon gives the transport. All methods are synchronous, cheap, and atomic (engine lock held)."""

    def identity(self) -> Identity:
        """This peer's identity (constant while the server runs)."""
        ...

    def answer_hello(self, sender_id: str, hello: ledger.Hello) -> ledger.HelloReply:
        """Receiver side of the exactly-once handshake for edge ``sender_id -> self``."""
        ...

    def receive(self, sender_id: str, seq: int, weight: float, scale: float, payload: bytes) -> bool:
        """Apply one complete update once; True if applied, False if a duplicate/fenced copy was dropped.

        Raises:
            peer.gossip.engine.GossipInputError: the update is malformed or hostile; nothing changed.
        """
        ...

    def hello_for(self, receiver_id: str) -> ledger.Hello:
        """Sender side: the Hello that (re)opens edge ``self -> receiver_id``."""
        ...

    def on_hello_reply(self, receiver_id: str, reply: ledger.HelloReply) -> ledger.Verdict:
        """Sender side: settle the in-flight message of the edge (delivered or mass taken back)."""
        ...

    def on_ack(self, receiver_id: str, seq: int) -> None:
        """Sender side: the receiver acknowledged ``seq``; stale acks are ignored."""
        ...

    def model_bytes(self) -> bytes:
        """The de-biased model z = x / w, for a joiner (format: see :func:`model_to_bytes`)."""
        ...

    async def before_ack(self, sender_id: str) -> None:
        """Awaited after an update was applied and before its Ack goes out: the receiver's backpressure.

        The update's mass is already applied (exactly once); delaying the Ack only keeps the sender's edge busy, so a
        fast sender cannot push many messages into a slow receiver between two of its rounds.
        """
        ...

    def status(self) -> dict[str, Any]:
        """JSON-ready status snapshot (served by the Status RPC)."""
        ...


def model_to_bytes(z: torch.Tensor) -> bytes:
    """A flat model vector as little-endian float32 bytes (4 bytes per parameter, layout order)."""
    return z.detach().to(torch.float32).cpu().contiguous().numpy().astype("<f4", copy=False).tobytes()


def model_from_bytes(data: bytes, numel: int) -> torch.Tensor:
    """Inverse of :func:`model_to_bytes`; raises ValueError on a length mismatch or non-finite values."""
    if len(data) != 4 * numel:
        raise ValueError(f"model: got {len(data)} bytes, the layout needs {4 * numel} ({numel} float32)")
    z = torch.from_numpy(np.frombuffer(data, dtype="<f4").astype(np.float32))
    if not bool(torch.isfinite(z).all()):
        raise ValueError("model: contains NaN or Inf")
    return z


class EngineGate:
    """:class:`GossipGate` over a :class:`GossipEngine`, every call under ``lock`` (shared with the trainer).

    Args:
        engine: the peer's gossip engine.
        identity: this peer's identity; ``identity.peer_id`` must equal ``engine.peer_id``.
        lock: the lock the daemon's trainer holds while it changes the engine's x.
    """

    def __init__(self, engine: GossipEngine, identity: Identity, lock: threading.Lock) -> None:
        if identity.peer_id != engine.peer_id:
            raise ValueError(f"identity peer_id {identity.peer_id!r} != engine peer_id {engine.peer_id!r}")
        self.engine = engine
        self._identity = identity
        self.lock = lock

    def identity(self) -> Identity:
        return self._identity

    def answer_hello(self, sender_id: str, hello: ledger.Hello) -> ledger.HelloReply:
        with self.lock:
            return self.engine.answer_hello(sender_id, hello)

    def receive(self, sender_id: str, seq: int, weight: float, scale: float, payload: bytes) -> bool:
        with self.lock:
            return self.engine.receive(sender_id, seq, weight, scale, payload)

    def hello_for(self, receiver_id: str) -> ledger.Hello:
        with self.lock:
            return self.engine.hello_for(receiver_id)

    def on_hello_reply(self, receiver_id: str, reply: ledger.HelloReply) -> ledger.Verdict:
        with self.lock:
            return self.engine.on_hello_reply(receiver_id, reply)

    def on_ack(self, receiver_id: str, seq: int) -> None:
        with self.lock:
            self.engine.on_ack(receiver_id, seq)

    async def before_ack(self, sender_id: str) -> None:
        """No pacing: acknowledge at once."""
        return None

    def model_bytes(self) -> bytes:
        with self.lock:
            z = self.engine.x / self.engine.w
        return model_to_bytes(z)

    def status(self) -> dict[str, Any]:
        with self.lock:
            e = self.engine
            return {
                "peer_id": e.peer_id,
                "w": e.w,
                "algorithm": e.algorithm.name,
                "busy_edges": sorted(r for r in e.out_edges if e.busy(r)),
                "out_edges": {r: {"next_seq": s.next_seq, "in_flight_seq": s.in_flight_seq}
                              for r, s in e.out_edges.items()},
                "in_edges": {s: {"last_applied": i.last_applied, "fence": i.fence} for s, i in e.in_edges.items()},
            }
