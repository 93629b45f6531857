"""Builders shared by the gossip tests: small layouts and engines with random models."""

from __future__ import annotations

import torch

from peer.compress.codec import CodecConfig
from peer.compress.layout import Layout
from peer.gossip.engine import GossipEngine

LAYOUT = Layout.from_named_shapes([("conv.weight", (4, 3, 3, 3)), ("conv.bias", (4,)), ("fc.weight", (5, 36))])


def make_engines(n: int, algorithm: str, compression: float = 0.0, bits: int = 32, gamma: float = 0.5,
                 seed: int = 0) -> dict[str, GossipEngine]:
    """n engines over LAYOUT with different random starting models."""
    gen = torch.Generator().manual_seed(seed)
    engines = {}
    for r in range(n):
        x0 = torch.randn(LAYOUT.numel, generator=gen)
        codec = CodecConfig(compression=compression, bits=bits)
        engines[f"p{r}"] = GossipEngine(f"p{r}", LAYOUT, x0, algorithm, codec, gamma=gamma, seed=seed + r)
    return engines


def totals(engines: dict[str, GossipEngine]) -> tuple[torch.Tensor, float]:
    """sum x + in-flight mass, and sum w + in-flight weight, in float64."""
    mass = torch.zeros(LAYOUT.numel, dtype=torch.float64)
    weight = 0.0
    for e in engines.values():
        flight_mass, flight_w = e.in_flight()
        mass += e.x.double() + flight_mass.double()
        weight += e.w + flight_w
    return mass, weight
