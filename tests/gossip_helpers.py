"""Builders shared by the gossip tests: small layouts and engines with random models, and an adapter that lets the
simulator's in-memory transport carry messages between bare engines (no model, no training)."""

from __future__ import annotations

import torch

from peer.compress.codec import CodecConfig
from peer.compress.layout import Layout
from peer.gossip.engine import GossipEngine
from peer.gossip.ledger import Hello, HelloReply, Settlement
from peer.gossip.robust import RobustConfig

#: The ledger and push-sum tests start every engine from a different random model (a spread of the model's own norm,
#: far beyond any fleet built from one seed), so they run without the robust receive rule; tests/test_gossip_robust.py
#: runs it.
PLAIN = RobustConfig(enabled=False)

LAYOUT = Layout.from_named_shapes([("conv.weight", (4, 3, 3, 3)), ("conv.bias", (4,)), ("fc.weight", (5, 36))])


def make_engines(n: int, algorithm: str, compression: float = 0.0, bits: int = 32, gamma: float = 0.5,
                 seed: int = 0, window: int = 1, robust: RobustConfig = PLAIN,
                 **limits: int) -> dict[str, GossipEngine]:
    """n engines over LAYOUT with different random starting models (``limits``: the engine's max_peers)."""
    gen = torch.Generator().manual_seed(seed)
    engines = {}
    for r in range(n):
        x0 = torch.randn(LAYOUT.numel, generator=gen)
        codec = CodecConfig(compression=compression, bits=bits)
        engines[f"p{r}"] = GossipEngine(f"p{r}", LAYOUT, x0, algorithm, codec, gamma=gamma, window=window,
                                        seed=seed + r, robust=robust, **limits)
    return engines


class EngineEndpoint:
    """The transport-facing entry points of :class:`peer.runtime.peer.Peer`, over a bare engine."""

    def __init__(self, engine: GossipEngine) -> None:
        self.engine = engine

    def receive(self, sender: str, seq: int, weight: float, scale: float, payload: bytes) -> bool:
        return self.engine.receive(sender, seq, weight, scale, payload)

    def on_ack(self, receiver: str, seq: int) -> Settlement:
        return self.engine.on_ack(receiver, seq)

    def hello_for(self, receiver: str) -> Hello:
        return self.engine.hello_for(receiver)

    def answer_hello(self, sender: str, hello: Hello) -> HelloReply:
        return self.engine.answer_hello(sender, hello)

    def on_hello_reply(self, receiver: str, hello: Hello, reply: HelloReply) -> Settlement:
        return self.engine.on_hello_reply(receiver, hello, reply)

    def in_flight_count(self, receiver: str) -> int:
        edge = self.engine.out_edges.get(receiver)
        return 0 if edge is None else len(edge.in_flight)


def endpoints(engines: dict[str, GossipEngine]) -> dict[str, EngineEndpoint]:
    return {peer_id: EngineEndpoint(e) for peer_id, e in engines.items()}


def totals(engines: dict[str, GossipEngine]) -> tuple[torch.Tensor, float]:
    """sum x + held + in-flight mass, and sum w + held + in-flight weight, in float64."""
    mass = torch.zeros_like(next(iter(engines.values())).x, dtype=torch.float64)
    weight = 0.0
    for e in engines.values():
        flight_mass, flight_w = e.in_flight()
        own_mass, own_w = e.holdings()
        mass += own_mass + flight_mass.double()
        weight += own_w + flight_w
    return mass, weight
