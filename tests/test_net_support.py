"""Shared helpers for the tests/test_net_*.py files (real gRPC on 127.0.0.1; no tests of its own)."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from peer.compress.codec import CodecConfig
from peer.compress.layout import Layout
from peer.gossip.engine import GossipEngine
from peer.net.api import PROTOCOL_VERSION, EngineGate, Identity

LAYOUT = Layout.from_named_shapes([("conv.weight", (8, 3, 3, 3)), ("conv.bias", (8,)), ("fc.weight", (10, 8))])
FINGERPRINT = "test-model-fp"
FLEET = "test-fleet"


class RecordingGate(EngineGate):
    """EngineGate that records every applied (sender, seq) to check at-most-once delivery."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.applied: list[tuple[str, int]] = []

    def receive(self, sender_id: str, seq: int, weight: float, scale: float, payload: bytes) -> bool:
        applied = super().receive(sender_id, seq, weight, scale, payload)
        if applied:
            self.applied.append((sender_id, seq))
        return applied


def make_gate(peer_id: str, algorithm: str = "choco", seed: int = 0, layout: Layout = LAYOUT,
              fingerprint: str = FINGERPRINT, fleet: str = FLEET) -> RecordingGate:
    """A gate over a fresh engine: choco with 90% top-k compression, or dense sgp (8-bit values)."""
    gen = torch.Generator().manual_seed(seed)
    x0 = torch.randn(layout.numel, generator=gen)
    codec = CodecConfig(compression=0.9 if algorithm != "sgp" else 0.0)
    engine = GossipEngine(peer_id, layout, x0, algorithm, codec, gamma=0.2, seed=seed)
    identity = Identity(peer_id, PROTOCOL_VERSION, fingerprint, fleet, "", algorithm)
    return RecordingGate(engine, identity, threading.Lock())


@dataclass
class Totals:
    """sum x + in-flight mass and sum w + in-flight weight over a set of engines (float64)."""

    mass: torch.Tensor
    weight: float


def totals(gates: list[EngineGate]) -> Totals:
    mass = torch.zeros(LAYOUT.numel, dtype=torch.float64)
    weight = 0.0
    for gate in gates:
        flying, flying_w = gate.engine.in_flight()
        mass += gate.engine.x.double() + flying.double()
        weight += gate.engine.w + flying_w
    return Totals(mass, weight)


def engine_snapshot(gate: EngineGate) -> dict:
    """Bitwise copy of everything a received message could change."""
    e = gate.engine
    return {
        "x": e.x.clone(), "w": e.w,
        "in_edges": {k: (v.last_applied, v.fence) for k, v in e.in_edges.items()},
        "replicas_in": {k: v.clone() for k, v in e._replicas_in.items()},
    }


def assert_snapshot_equal(a: dict, b: dict) -> None:
    assert torch.equal(a["x"], b["x"])
    assert a["w"] == b["w"]
    assert a["in_edges"] == b["in_edges"]
    assert a["replicas_in"].keys() == b["replicas_in"].keys()
    for k in a["replicas_in"]:
        assert torch.equal(a["replicas_in"][k], b["replicas_in"][k])
