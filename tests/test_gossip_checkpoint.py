"""The engine's checkpoint state has named fields, survives torch's weights-only loader, and a checkpoint written
with the earlier positional edge tuples still loads into the same engine."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch

from peer.gossip.checkpoint import EngineState
from peer.gossip.engine import GossipEngine
from tests.gossip_helpers import make_engines


def _busy_engine(algorithm: str) -> GossipEngine:
    """p0 with a message in flight to p1, one applied from p1, and p2 forgotten after it sent one."""
    engines = make_engines(3, algorithm, 0.9 if algorithm != "sgp" else 0.0, 8, window=4)
    a, b, c = engines["p0"], engines["p1"], engines["p2"]
    a.send_round(["p1"], 0)
    for sender in (b, c):
        msg = sender.send_round(["p0"], 0)[0]
        assert a.receive(sender.peer_id, msg.seq, msg.weight, msg.scale, msg.payload)
    assert a.forget_peer("p2")
    return a


def _positional(sd: dict[str, Any]) -> dict[str, Any]:
    """``sd`` in the form of an earlier version: edges as positional tuples."""
    return {**sd,
            "out_edges": {k: (e["next_seq"], e["in_flight"]) for k, e in sd["out_edges"].items()},
            "in_edges": {k: (e["last_applied"], e["fence"]) for k, e in sd["in_edges"].items()},
            "departed_in_edges": {k: (e["last_applied"], e["fence"]) for k, e in sd["departed_in_edges"].items()}}


def _weights_only(sd: dict[str, Any]) -> dict[str, Any]:
    buffer = io.BytesIO()
    torch.save(sd, buffer)
    buffer.seek(0)
    loaded: dict[str, Any] = torch.load(buffer, weights_only=True)
    return loaded


def _same(a: GossipEngine, b: GossipEngine) -> None:
    sa, sb = a.checkpoint_state(), b.checkpoint_state()
    assert torch.equal(sa.x, sb.x) and sa.w == sb.w and sa.in_edges == sb.in_edges
    assert sa.departed_in_edges == sb.departed_in_edges
    assert {k: (e.next_seq, set(e.in_flight)) for k, e in sa.out_edges.items()} == \
        {k: (e.next_seq, set(e.in_flight)) for k, e in sb.out_edges.items()}
    assert a.in_flight()[1] == b.in_flight()[1] and torch.equal(a.in_flight()[0], b.in_flight()[0])


@pytest.mark.parametrize("algorithm", ["sgp", "deepsqueeze", "choco"])
def test_named_state_round_trips_through_a_weights_only_checkpoint(algorithm: str) -> None:
    engine = _busy_engine(algorithm)
    sd = _weights_only(engine.state_dict())
    assert sd["out_edges"]["p1"]["next_seq"] == 2 and set(sd["out_edges"]["p1"]["in_flight"]) == {1}
    assert sd["in_edges"]["p1"] == {"last_applied": 1, "fence": 0}
    assert sd["departed_in_edges"]["p2"] == {"last_applied": 1, "fence": 0}
    _same(engine, GossipEngine.from_state_dict("p0", sd))


@pytest.mark.parametrize("algorithm", ["sgp", "choco"])
def test_a_checkpoint_with_positional_edges_still_loads(algorithm: str) -> None:
    engine = _busy_engine(algorithm)
    old = _weights_only(_positional(engine.state_dict()))
    assert old["in_edges"]["p1"] == (1, 0)
    _same(engine, GossipEngine.from_state_dict("p0", old))
    assert EngineState.from_dict(old).out_edges["p1"].next_seq == 2
