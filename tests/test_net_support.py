"""Shared helpers for the tests/test_net_*.py files (real gRPC on 127.0.0.1; no tests of its own)."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch

from peer.compress.codec import CodecConfig, max_payload_bytes
from peer.compress.layout import Layout
from peer.gossip import ledger
from peer.gossip.engine import GossipEngine
from peer.gossip.sketch import decode_sketch
from peer.net.api import PROTOCOL_VERSION, Identity, model_to_bytes
from peer.security.credentials import TransportSecurity
from tests.gossip_helpers import PLAIN
from tests.status_helpers import status_json

LAYOUT = Layout.from_named_shapes([("conv.weight", (8, 3, 3, 3)), ("conv.bias", (8,)), ("fc.weight", (10, 8))])
FINGERPRINT = "test-model-fp"
FLEET = "test-fleet"
INSECURE = TransportSecurity.insecure(FLEET)  # the tests that are not about TLS choose none, explicitly


class RecordingGate:
    """A GossipGate over a bare engine (every call under one lock, as the daemon's gate over a Peer) that records
    every applied (sender, seq) to check at-most-once delivery."""

    def __init__(self, engine: GossipEngine, identity: Identity) -> None:
        self.engine = engine
        self._identity = identity
        self.lock = threading.Lock()
        self.applied: list[tuple[str, int]] = []
        self.notices: list[tuple[str, list[str]]] = []
        self.probes: list[tuple[str, bytes]] = []

    def identity(self) -> Identity:
        return self._identity

    def answer_hello(self, sender_id: str, hello: ledger.Hello) -> ledger.HelloReply:
        with self.lock:
            return self.engine.answer_hello(sender_id, hello)

    def receive(self, sender_id: str, seq: int, weight: float, scale: float, payload: bytes) -> bool:
        with self.lock:
            applied = self.engine.receive(sender_id, seq, weight, scale, payload)
        if applied:
            self.applied.append((sender_id, seq))
        return applied

    def note_quarantines(self, sender_id: str, quarantined: list[str]) -> None:
        self.notices.append((sender_id, quarantined))
        with self.lock:
            self.engine.guard.note_notice(sender_id, quarantined)

    def note_probe(self, sender_id: str, sketch: bytes) -> None:
        self.probes.append((sender_id, sketch))
        with self.lock:
            self.engine.observe_probe(sender_id, decode_sketch(sketch))

    def hello_for(self, receiver_id: str) -> ledger.Hello:
        with self.lock:
            return self.engine.hello_for(receiver_id)

    def on_hello_reply(self, receiver_id: str, hello: ledger.Hello, reply: ledger.HelloReply) -> ledger.Settlement:
        with self.lock:
            return self.engine.on_hello_reply(receiver_id, hello, reply)

    def on_ack(self, receiver_id: str, seq: int) -> ledger.Settlement:
        with self.lock:
            return self.engine.on_ack(receiver_id, seq)

    def in_flight_count(self, receiver_id: str) -> int:
        with self.lock:
            edge = self.engine.out_edges.get(receiver_id)
            return 0 if edge is None else len(edge.in_flight)

    async def before_ack(self, sender_id: str) -> None:
        return None

    def model_bytes(self) -> bytes:
        with self.lock:
            return model_to_bytes(self.engine.state.debiased())

    def max_payload_bytes(self) -> int:
        return max_payload_bytes(self.engine.layout)

    def status(self) -> dict[str, Any]:
        return status_json(peer_id=self.engine.peer_id, w=self.engine.w, loss=0.0)  # NaN != NaN after JSON


def make_gate(peer_id: str, algorithm: str = "choco", seed: int = 0, layout: Layout = LAYOUT,
              fingerprint: str = FINGERPRINT, fleet: str = FLEET, window: int = 1,
              max_peers: int = ledger.DEFAULT_MAX_PEERS) -> RecordingGate:
    """A gate over a fresh engine: choco with 90% top-k compression, or dense sgp (8-bit values)."""
    gen = torch.Generator().manual_seed(seed)
    x0 = torch.randn(layout.numel, generator=gen)
    codec = CodecConfig(compression=0.9 if algorithm != "sgp" else 0.0)
    engine = GossipEngine(peer_id, layout, x0, algorithm, codec, gamma=0.2, window=window, seed=seed,
                          max_peers=max_peers, robust=PLAIN)  # models far apart: the ledger's tests, not the rule's
    identity = Identity(peer_id, PROTOCOL_VERSION, fingerprint, fleet, "", algorithm)
    return RecordingGate(engine, identity)


@dataclass
class Totals:
    """sum x + in-flight mass and sum w + in-flight weight over a set of engines (float64)."""

    mass: torch.Tensor
    weight: float


def totals(gates: list[RecordingGate]) -> Totals:
    mass = torch.zeros(LAYOUT.numel, dtype=torch.float64)
    weight = 0.0
    for gate in gates:
        flying, flying_w = gate.engine.in_flight()
        own, own_w = gate.engine.holdings()
        mass += own + flying.double()
        weight += own_w + flying_w
    return Totals(mass, weight)


def engine_snapshot(gate: RecordingGate) -> dict:
    """Bitwise copy of everything a received message could change."""
    e = gate.engine
    return {
        "x": e.x.clone(), "w": e.w,
        "in_edges": {k: (v.last_applied, v.fence) for k, v in e.in_edges.items()},
        "replicas_in": {k: v.clone() for k, v in getattr(e.algorithm, "replicas_in", {}).items()},
    }


def assert_snapshot_equal(a: dict, b: dict) -> None:
    assert torch.equal(a["x"], b["x"])
    assert a["w"] == b["w"]
    assert a["in_edges"] == b["in_edges"]
    assert a["replicas_in"].keys() == b["replicas_in"].keys()
    for k in a["replicas_in"]:
        assert torch.equal(a["replicas_in"][k], b["replicas_in"][k])
