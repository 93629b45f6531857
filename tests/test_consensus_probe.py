"""Consensus probes (docs/method.md#the-consensus-phase): a model's count-sketch estimates a neighbour's distance,
travels as a ConsensusProbe frame through the stream classes both transports run, and replaces the phase round
that only confirms the averaging is done. The phase itself is in tests/test_consensus.py."""

from __future__ import annotations

import math

import pytest
import torch

from peer.config import DataSpec, GossipSpec, ModelSpec, OptimSpec, RunSpec
from peer.data import load_dataset
from peer.gossip.consensus import ConsensusPhase, ConsensusSettings, Mixing, NeighbourDistances
from peer.gossip.engine import GossipInputError
from peer.gossip.sketch import (PROBE_BUCKETS, SKETCH_BYTES, SketchError, decode_sketch, encode_sketch,
                                estimated_distance, sketch)
from peer.net.inbound import InboundStreams
from peer.net.config import NetConfig
from peer.net.wire import probe_frame
from peer.sim.simulation import Simulation
from tests.test_gossip_notices import open_stream
from tests.test_net_support import make_gate, totals


# --- the sketch ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("relative", [0.3, 0.02, 0.001])
def test_the_sketch_estimates_the_relative_distance_within_a_tenth(relative: float) -> None:
    """At 1024 buckets one standard deviation is about 2% of the distance; 30 random directions, none off by 10%."""
    gen = torch.Generator().manual_seed(0)
    own = torch.randn(100_000, generator=gen) * torch.rand(100_000, generator=gen) * 3  # uneven magnitudes
    errors = []
    for _ in range(30):
        step = torch.randn(own.numel(), generator=gen)
        other = own + step * (relative * float(own.norm()) / float(step.norm()))
        errors.append(estimated_distance(sketch(other), own) / relative - 1)
    assert max(abs(e) for e in errors) < 0.10, errors
    assert abs(sum(errors) / len(errors)) < 0.03  # unbiased
    assert estimated_distance(sketch(own), own) == 0.0


def test_the_sketch_is_the_same_fixed_integer_hash_everywhere() -> None:
    """Bucket ((1103515245 j + 12345) mod (2^31 - 1)) mod B, sign from ((214013 j + 2531011) mod (2^31 - 1)) mod 2,
    computed here in plain Python: two peers on different machines or torch versions sketch alike."""
    values = torch.arange(1, 41, dtype=torch.float32)
    expected = [0.0] * 8
    for j, v in enumerate(values.tolist()):
        bucket = (1_103_515_245 * j + 12_345) % 2_147_483_647 % 8
        sign = 1 - 2 * ((214_013 * j + 2_531_011) % 2_147_483_647 % 2)
        expected[bucket] += sign * v
    assert sketch(values, 8).tolist() == expected
    a, b = torch.randn(5000), torch.randn(5000)
    torch.testing.assert_close(sketch(a) - sketch(b), sketch(a - b), rtol=0, atol=1e-4)  # linear


def test_a_sketch_crosses_the_wire_exactly_and_a_wrong_one_is_refused() -> None:
    values = sketch(torch.randn(3000))
    raw = encode_sketch(values)
    assert len(raw) == SKETCH_BYTES == 4 * PROBE_BUCKETS
    assert torch.equal(decode_sketch(raw), values)
    with pytest.raises(SketchError, match="expected 4096"):
        decode_sketch(raw[:-4])
    poisoned = values.clone()
    poisoned[7] = math.nan
    with pytest.raises(SketchError, match="NaN"):
        decode_sketch(encode_sketch(poisoned))


# --- the phase's rule ----------------------------------------------------------------------------------------------
def test_a_probe_is_due_from_the_horizon_on_never_twice_in_a_row_and_never_when_turned_off() -> None:
    base = {"tolerance": 0.02, "patience": 1, "max_rounds": 10, "mixing": Mixing(0.0, 1.0)}
    phase = ConsensusPhase(ConsensusSettings(**base, probe=True), final=True)  # type: ignore[arg-type]
    kinds = []
    for _ in range(8):
        probe = phase.probe_due(horizon=3)
        kinds.append("p" if probe else "d")
        phase.count_round(100 if not probe else 4096, probe=probe)
    assert "".join(kinds) == "dddpdpdp" and phase.probes == 3 and phase.rounds == 8
    assert phase.payload_bytes == 5 * 100 + 3 * 4096
    off = ConsensusPhase(ConsensusSettings(**base), final=True)  # type: ignore[arg-type]  # off by default
    off.rounds = 5
    assert not off.probe_due(horizon=3)


def test_past_the_byte_budget_a_round_is_a_probe_from_the_horizon_on_and_never_twice_in_a_row() -> None:
    base = {"tolerance": 0.02, "patience": 1, "max_rounds": 10, "mixing": Mixing(0.0, 1.0)}
    phase = ConsensusPhase(ConsensusSettings(**base, budget=2.0), final=True,  # type: ignore[arg-type]
                           training_bytes=1000)
    kinds = []
    for _ in range(7):
        probe = phase.probe_due(horizon=2)
        kinds.append("p" if probe else "d")
        phase.count_round(4096 if probe else 600, probe=probe)
    # three dense rounds (1800) fit in 2000, a fourth would not: probes from then on, dense rounds between them
    assert "".join(kinds) == "dddpdpd", kinds
    for settings, training_bytes in ((ConsensusSettings(**base, budget=2.0), 0),  # type: ignore[arg-type]
                                     (ConsensusSettings(**base, budget=0.0), 1000)):  # type: ignore[arg-type]
        unbounded = ConsensusPhase(settings, final=True, training_bytes=training_bytes)
        for _ in range(6):
            assert not unbounded.probe_due(horizon=2)
            unbounded.count_round(600)


def test_a_probe_counts_as_news_even_where_only_dense_messages_do() -> None:
    distances = NeighbourDistances()
    distances.restart(dense_only=True)
    distances.observe("a", torch.ones(4), torch.ones(4), dense=False)
    assert distances.fresh_distances() == {}
    distances.observe_distance("a", 0.004)
    assert distances.fresh_distances() == {"a": 0.004} and distances.heard() == {"a": 1}


# --- the frame through the stream classes both transports run -----------------------------------------------------
def test_a_probe_frame_reaches_the_receivers_distances_and_moves_no_mass() -> None:
    a, b, out, _, stream = open_stream()
    before = totals([a, b])
    out.probe(encode_sketch(sketch(torch.zeros(a.engine.layout.numel))), 1)
    out.probe(encode_sketch(a.engine.model_sketch()), 2)  # only the newest is kept: it sketches the model now
    frames = list(out.frames(lambda: 0.0))
    assert len(frames) == 1
    received = stream.on_frame(frames[0], 0.0)
    assert received.refusal is None and received.reply is None and received.ack is None
    assert [sender for sender, _ in b.probes] == ["peer-a"]
    own, theirs = b.engine.state.debiased(), a.engine.state.debiased()
    exact = float((theirs - own).norm() / own.norm())
    assert b.engine.distances.fresh_distances()["peer-a"] == pytest.approx(exact, rel=0.1)
    after = totals([a, b])
    assert after.weight == before.weight and bool((after.mass == before.mass).all())


@pytest.mark.parametrize("size", [0, SKETCH_BYTES - 4, SKETCH_BYTES + 4])
def test_a_probe_of_another_size_is_refused_and_recorded_nowhere(size: int) -> None:
    _, b, _, _, stream = open_stream()
    received = stream.on_frame(probe_frame(b"\0" * size, 3), 0.0)
    assert received.refusal is not None and received.refusal.reason == "bad_probe"
    assert b.probes == [] and b.engine.distances.latest == {}


def test_a_probe_before_the_hello_is_refused() -> None:
    b = make_gate("peer-b", seed=2)
    stream = InboundStreams(b, NetConfig()).open("wire", caller="peer-a")
    received = stream.on_frame(probe_frame(b"\0" * SKETCH_BYTES, 1), 0.0)
    assert received.refusal is not None and received.refusal.reason == "no_hello" and b.probes == []


# --- a peer --------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def peers():
    splits = load_dataset("synthetic", n_train=64, n_test=16, image_size=12, in_channels=1)
    spec = RunSpec(model=ModelSpec(name="mnist-cnn", precision="fp32"),
                   data=DataSpec(dataset="synthetic", batch_size=16), optim=OptimSpec(lr=0.0, epochs=1.0),
                   gossip=GossipSpec(consensus_rounds=10, robust=True))
    return Simulation(spec, splits, 2).peers


def test_a_non_finite_probe_is_refused_naming_it_and_a_quarantined_senders_probe_changes_nothing(peers) -> None:
    a, b = peers.values()
    b.engine.distances.latest.clear()
    poisoned = sketch(a.engine.state.debiased())
    poisoned[0] = math.inf
    with pytest.raises(GossipInputError, match="consensus probe refused: sketch holds a NaN") as refused:
        b.note_probe(a.peer_id, encode_sketch(poisoned))
    assert refused.value.reason == "bad_probe" and b.engine.distances.latest == {}
    b.engine.guard.quarantine(a.peer_id, "test")
    try:
        b.note_probe(a.peer_id, a.probe_sketch())
        assert b.engine.distances.latest == {} and b.engine.distances.heard() == {}
    finally:
        b.engine.guard.release(a.peer_id)
    b.note_probe(a.peer_id, a.probe_sketch())
    assert set(b.engine.distances.latest) == {a.peer_id}

