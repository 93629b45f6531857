"""Conservation over checkpoints (peer/fleet/mass.py): engines rebuilt from their checkpoints by the engine's own code,
applied messages settled, the rest summed by ``in_flight()``; in-flight records with named fields; one consensus
distance."""

import io
from pathlib import Path

import pytest
import torch

from peer.fleet.mass import fleet_totals
from peer.gossip.engine import GossipEngine
from peer.runtime import state
from tests.gossip_helpers import make_engines, totals


def checkpoint_of(engine: GossipEngine) -> dict:
    """What a checkpoint file gives back: the engine's state through torch.save and the weights-only loader."""
    buffer = io.BytesIO()
    torch.save({"peer_id": engine.peer_id, "engine": engine.state_dict()}, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("algorithm, compression, bits", [("sgp", 0.0, 32), ("deepsqueeze", 0.9, 8),
                                                          ("choco", 0.9, 8)])
def test_totals_count_exactly_the_messages_their_receivers_have_not_applied(algorithm, compression, bits):
    engines = make_engines(3, algorithm, compression, bits, gamma=0.5, window=8)
    initial_x, initial_w = totals(engines)
    delivered, lost = [], []
    for r in range(4):
        for peer_id, engine in engines.items():
            receivers = [p for p in engines if p != peer_id]
            for m in engine.send_round(receivers, r):
                # round 0: applied and acked; 1: applied, ack lost; 2 and 3: still on the wire
                if r < 2:
                    engines[m.receiver].receive(m.sender, m.seq, m.weight, m.scale, m.payload)
                    if r == 0:
                        engine.on_ack(m.receiver, m.seq)
                    else:
                        delivered.append((m.sender, m.receiver, m.seq))
                else:
                    lost.append((m.sender, m.receiver, m.seq))

    result = fleet_totals({p: checkpoint_of(e) for p, e in engines.items()})

    assert sorted(result.unsettled) == sorted(lost)
    assert result.w == pytest.approx(initial_w, abs=1e-9)
    assert torch.allclose(result.x, initial_x, atol=1e-5)
    assert result.in_flight_w > 0 and not set(delivered) & set(result.unsettled)


def test_a_receiver_without_checkpoint_leaves_every_message_to_it_in_flight():
    engines = make_engines(2, "choco", 0.9, 8, window=4)
    for r in range(2):
        engines["p0"].send_round(["p1"], r)
    result = fleet_totals([checkpoint_of(engines["p0"])])
    assert result.unsettled == [("p0", "p1", 1), ("p0", "p1", 2)]
    assert result.w == pytest.approx(1.0, abs=1e-12)


def test_in_flight_records_have_named_fields_and_rebuild_the_same_engine():
    engines = make_engines(2, "choco", 0.9, 8, window=4)
    engines["p0"].send_round(["p1"], 0)
    saved = checkpoint_of(engines["p0"])
    record = saved["engine"]["out_edges"]["p1"]["in_flight"][1]
    assert set(record) == {"indices", "values", "weight", "scale", "undo_indices", "undo_values"}
    rebuilt = state.engine_of(saved)
    original_mass, original_weight = engines["p0"].in_flight()
    rebuilt_mass, rebuilt_weight = rebuilt.in_flight()
    assert torch.equal(rebuilt_mass, original_mass) and rebuilt_weight == original_weight
    assert rebuilt.layout == engines["p0"].layout and rebuilt.gamma == engines["p0"].gamma


def test_consensus_distance_takes_its_dtype():
    zs = [torch.zeros(3), torch.ones(3)]
    assert state.consensus_distance(zs) == float(torch.tensor([0.5, 0.5, 0.5]).norm())
    assert state.consensus_distance(zs, torch.float64) == 0.75 ** 0.5


def test_a_checkpoint_of_the_former_schema_is_refused_by_number(tmp_path: Path):
    path = tmp_path / "checkpoint.pt"
    torch.save({"schema": 2}, path)
    with pytest.raises(state.CheckpointError, match=f"schema 2, this version reads schema {state.SCHEMA}"):
        state.load(path)
