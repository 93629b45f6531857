"""The gossip engine's checkpointed state, with named fields.

:class:`EngineState` is what :meth:`peer.gossip.engine.GossipEngine.state_dict` writes into a checkpoint, as plain
dicts of tensors and numbers (:meth:`EngineState.to_dict`) that torch's weights-only loader reads back. A checkpoint
of an earlier version held each edge as a positional tuple (``(next_seq, in_flight)`` outbound, ``(last_applied,
fence)`` inbound); :meth:`EngineState.from_dict` reads both forms, so such checkpoints still load.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from peer.compress.codec import CodecConfig
from peer.gossip.ledger import InboundEdge


@dataclass(frozen=True)
class OutEdgeState:
    """One outbound edge: the seq its next message gets and its unsettled messages, seq -> the sender's record
    (:meth:`peer.gossip.algorithms.Sent.checkpoint_record`)."""

    next_seq: int
    in_flight: dict[int, dict[str, Any]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"next_seq": self.next_seq, "in_flight": dict(self.in_flight)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | tuple[int, dict[int, dict[str, Any]]]) -> OutEdgeState:
        if isinstance(data, Mapping):
            return cls(int(data["next_seq"]), dict(data["in_flight"]))
        next_seq, in_flight = data  # the positional form of earlier checkpoints
        return cls(int(next_seq), dict(in_flight))


def _in_edge_to_dict(edge: InboundEdge) -> dict[str, int]:
    return {"last_applied": edge.last_applied, "fence": edge.fence}


def _in_edge_from_dict(data: Mapping[str, Any] | tuple[int, int]) -> InboundEdge:
    if isinstance(data, Mapping):
        return InboundEdge(int(data["last_applied"]), int(data["fence"]))
    last_applied, fence = data  # the positional form of earlier checkpoints
    return InboundEdge(int(last_applied), int(fence))


@dataclass(frozen=True)
class EngineState:
    """Everything needed to resume an engine exactly, and to rebuild it from this alone.

    Attributes:
        algorithm: the algorithm's name (peer.gossip.kinds.Algorithm value).
        x, w: the push-sum numerator (flat fp32) and weight.
        layout: (name, shape) of every parameter tensor, in order.
        codec: compression of the payloads.
        gamma, window: consensus step in use and the exactly-once window.
        out_edges, in_edges: the ledgers of the live edges by peer id.
        departed_in_edges: inbound ledgers kept for peers that left (their handshake must find what was applied).
        algorithm_state: the algorithm's own tensors (Choco's replicas, Deep-Squeeze's error).
        generator: the state of the stochastic-rounding generator.
        robust: the receive rule's per-neighbour records, quarantines included (peer/gossip/robust.py; empty in
            earlier checkpoints).
        held: per sender, the numerator mass and weight the rule's clipping held back (empty in earlier
            checkpoints).
    """

    algorithm: str
    x: torch.Tensor
    w: float
    layout: list[tuple[str, tuple[int, ...]]]
    codec: CodecConfig
    gamma: float
    window: int
    out_edges: dict[str, OutEdgeState]
    in_edges: dict[str, InboundEdge]
    departed_in_edges: dict[str, InboundEdge]
    algorithm_state: dict[str, Any]
    generator: torch.Tensor
    robust: dict[str, Any] = field(default_factory=dict)
    held: dict[str, tuple[torch.Tensor, float]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """Plain dicts of tensors and numbers (a checkpoint's "engine" entry)."""
        return {
            "algorithm": self.algorithm, "x": self.x, "w": self.w, "layout": list(self.layout),
            "codec": {"compression": self.codec.compression, "bits": self.codec.bits,
                      "rounding": self.codec.rounding},
            "gamma": self.gamma, "window": self.window,
            "out_edges": {k: e.to_dict() for k, e in self.out_edges.items()},
            "in_edges": {k: _in_edge_to_dict(e) for k, e in self.in_edges.items()},
            "departed_in_edges": {k: _in_edge_to_dict(e) for k, e in self.departed_in_edges.items()},
            "algorithm_state": self.algorithm_state,
            "generator": self.generator,
            "robust": self.robust,
            "held": {k: {"mass": mass, "weight": weight} for k, (mass, weight) in self.held.items()},
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EngineState:
        """Read :meth:`to_dict`'s form, or an earlier checkpoint's positional edge tuples."""
        return cls(
            algorithm=str(data["algorithm"]), x=data["x"], w=float(data["w"]),
            layout=[(str(name), tuple(shape)) for name, shape in data["layout"]],
            codec=CodecConfig(**data["codec"]), gamma=float(data["gamma"]), window=int(data["window"]),
            out_edges={k: OutEdgeState.from_dict(e) for k, e in data["out_edges"].items()},
            in_edges={k: _in_edge_from_dict(e) for k, e in data["in_edges"].items()},
            departed_in_edges={k: _in_edge_from_dict(e) for k, e in data.get("departed_in_edges", {}).items()},
            algorithm_state=dict(data["algorithm_state"]), generator=data["generator"],
            robust=dict(data.get("robust", {})),
            held={k: (h["mass"], float(h["weight"])) for k, h in data.get("held", {}).items()},
        )
