"""The runtime floor every driver shares: one assembly, one round over a Transport, one state schema."""

from __future__ import annotations

import asyncio
import pickle
import threading
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from peer.config import DataSpec, GossipSpec, ModelSpec, OptimSpec, RunSpec
from peer.data import load_dataset
from peer.gossip.engine import GossipEngine
from peer.runtime import state
from peer.runtime.build import build_peer, build_peer_model
from peer.runtime.round import PeerDiverged, run_round
from peer.runtime.schedule import lr_at
from peer.sim.simulation import Simulation
from peer.sim.transport import InMemoryTransport

SPEC = RunSpec(model=ModelSpec(name="mnist-cnn", precision="sim8"), data=DataSpec(dataset="synthetic", batch_size=16),
               optim=OptimSpec(lr=0.05, epochs=2.0), gossip=GossipSpec(algorithm="choco", compression=0.9, window=2))


@pytest.fixture(scope="module")
def splits():
    return load_dataset("synthetic", n_train=160, n_test=32, image_size=12, in_channels=1)


def peers(splits, n: int = 2, spec: RunSpec = SPEC) -> dict:
    built = build_peer_model(spec.model, splits, torch.device("cpu"), seed=spec.data.seed)
    return {f"p{r}": build_peer(spec, f"p{r}", (r, n), splits, torch.device("cpu"), built) for r in range(n)}


def test_one_assembly_gives_identical_peers_to_every_driver(splits) -> None:
    """The simulator's peer of rank 1 and a peer assembled directly (as the daemon and fleet do) are identical:
    same starting model, same shard, same batch order."""
    sim = Simulation(SPEC, splits, 2)
    direct = peers(splits)["p1"]
    simulated = sim.peers["peer-001"]
    assert torch.equal(direct.flat.z, simulated.flat.z)
    x1, y1 = next(direct.batches)
    x2, y2 = next(simulated.batches)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)


def test_a_peer_holds_its_shard_only_with_the_same_batches(splits) -> None:
    """The loader gets a compact copy of the shard (the full split can be freed) and draws exactly the batches a
    loader over the full split restricted to the shard's indices draws with the same seed."""
    from peer.data import BatchLoader, skew_partition
    from peer.runtime.build import loader_seed, shard_of

    indices = skew_partition(splits.train.labels.numpy(), 2, 0.0, seed=SPEC.data.seed)[1]
    shard = shard_of(splits.train, indices)
    assert len(shard) == len(indices) < len(splits.train)
    kwargs = dict(batch_size=16, mean=splits.mean, std=splits.std, seed=loader_seed(SPEC, 1))
    full, compact = BatchLoader(splits.train, indices, **kwargs), BatchLoader(shard, **kwargs)
    for (x1, y1), (x2, y2) in zip(full, compact, strict=True):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)


def test_checkpoint_restores_everything_including_model_buffers(tmp_path: Path, splits) -> None:
    ps = peers(splits)
    transport = InMemoryTransport(ps)
    for t in range(3):
        transport.begin_round(t)
        for peer_id, p in ps.items():
            run_round(p, transport, [q for q in ps if q != peer_id], t, local_steps=1)
        transport.deliver(t)
    a = ps["p0"]
    ranges = {n: b.clone() for n, b in a.model.named_buffers() if b.is_floating_point()}
    assert ranges and any(bool((b != 0).any()) for b in ranges.values()), "sim8 training should set activation ranges"
    path = state.save(a, tmp_path / "checkpoint.pt", 3, {"note": "test"}, "fp-test")
    fresh = peers(splits)["p0"]
    assert not all(torch.equal(dict(fresh.model.named_buffers())[n], b) for n, b in ranges.items())
    assert state.restore(fresh, state.load(path, "fp-test")) == 3
    for name, buf in fresh.model.named_buffers():
        if name in ranges:
            assert torch.equal(buf, ranges[name]), f"buffer {name} not restored"
    assert torch.equal(fresh.engine.x, a.engine.x) and fresh.engine.w == a.engine.w and fresh.steps == a.steps
    assert torch.equal(fresh.engine.in_flight()[0], a.engine.in_flight()[0])


def test_checkpoint_refuses_other_model_schema_and_code(tmp_path: Path, splits) -> None:
    a = peers(splits)["p0"]
    path = state.save(a, tmp_path / "checkpoint.pt", 0, {}, "fp-test")
    with pytest.raises(state.CheckpointError, match="fingerprint"):
        state.load(path, "another-model")
    torch.save({"schema": 1, "fingerprint": "fp-test"}, tmp_path / "old.pt")
    with pytest.raises(state.CheckpointError, match="schema"):
        state.load(tmp_path / "old.pt")

    class Planted:
        def __reduce__(self):
            return (Path("/nonexistent").touch, ())

    (tmp_path / "planted.pt").write_bytes(pickle.dumps({"schema": state.SCHEMA, "x": Planted()}, protocol=2))
    with pytest.raises(state.CheckpointError, match="unreadable"):
        state.load(tmp_path / "planted.pt")
    assert not list(tmp_path.glob(".checkpoint.pt.*.tmp")), "a temporary file stayed behind"


def test_roll_back_restores_the_model_and_keeps_weight_and_edges(tmp_path: Path, splits) -> None:
    a = peers(splits)["p0"]
    a.engine.state.w = 0.5
    a.engine.state.x.mul_(0.5)
    good = state.debiased({"engine": {"x": a.engine.x.clone(), "w": 0.5}})
    path = state.save(a, tmp_path / "checkpoint.pt", 7, {}, "fp-test")
    a.engine.state.w = 0.25
    a.engine.state.x.fill_(float("nan"))
    state.roll_back(a, state.load(path))
    assert a.engine.w == 0.25 and torch.allclose(a.engine.x / a.engine.w, good)


def test_no_lock_is_held_while_encoding(splits, monkeypatch: pytest.MonkeyPatch) -> None:
    """A message arriving while the peer compresses its own is applied at once, not after the encode."""
    ps = peers(splits)
    a, b = ps["p0"], ps["p1"]
    incoming = b.send(["p0"], {"p0"}, 0)[0]
    encoding, release = threading.Event(), threading.Event()
    real_encode = GossipEngine.encode_round

    def slow_encode(self, plan):
        encoding.set()
        assert release.wait(10), "receive never ran while encoding"
        return real_encode(self, plan)

    monkeypatch.setattr(GossipEngine, "encode_round", slow_encode)
    sender = threading.Thread(target=a.send, args=(["p1"], {"p1"}, 1))
    sender.start()
    assert encoding.wait(10)
    applied = a.receive("p1", incoming.seq, incoming.weight, incoming.scale, incoming.payload)
    release.set()
    sender.join(10)
    assert applied and not sender.is_alive()


def test_average_model_and_consensus_distance_have_one_definition() -> None:
    zs = [torch.tensor([0.0, 0.0]), torch.tensor([2.0, 0.0]), torch.tensor([4.0, 0.0])]
    assert torch.equal(state.average_model(zs), torch.tensor([2.0, 0.0]))
    assert state.consensus_distance(zs) == pytest.approx((2 + 0 + 2) / 3)


def test_in_memory_transport_settles_everything(splits) -> None:
    ps = peers(splits, 3)
    transport = InMemoryTransport(ps)
    transport.begin_round(0)
    for peer_id, p in ps.items():
        run_round(p, transport, [q for q in ps if q != peer_id], 0, local_steps=1)
    assert any(p.engine.in_flight()[1] > 0 for p in ps.values())
    report = asyncio.run(transport.settle(1.0))
    assert report.delivered >= 3 and not report.pending
    assert all(p.engine.in_flight()[1] == 0 for p in ps.values())


def test_status_snapshot_reads_the_engine_under_the_lock(splits) -> None:
    ps = peers(splits, 3)
    transport = InMemoryTransport(ps)
    transport.begin_round(0)
    a = ps["p0"]
    run_round(a, transport, ["p1", "p2"], 0, local_steps=1)
    seen = a.status_snapshot()
    e = a.engine
    assert (seen.w, seen.gamma, seen.known_peers) == (e.w, e.gamma, frozenset(e.known_peers()))
    assert seen.in_flight == {r: a.in_flight_count(r) for r in e.out_edges if a.in_flight_count(r)} != {}
    assert seen.gossip_state_bytes == e.algorithm.state_nbytes()
    with a.lock:  # a status call while the round holds the lock waits for it: no half-applied update is read
        reader = threading.Thread(target=a.status_snapshot)
        reader.start()
        reader.join(0.2)
        assert reader.is_alive()
    reader.join()


def test_status_says_how_many_senders_the_graph_gives_and_a_change_is_taken_once(splits) -> None:
    """A directed ring gives each peer one sender: no local rule bounds an insider within the honest spread
    (peer/gossip/reach.py); a graph where every peer of 4 hears the 3 others lets one be bounded. The daemon logs
    each change once (``take_reach_change``); a quarantined sender no longer counts, and with the rule off there is
    no bound to state."""
    dense_spec = replace(SPEC, gossip=replace(SPEC.gossip, topology="random", k=3))
    for spec, senders, bounded in ((SPEC, 1, 0), (dense_spec, 3, 1)):
        ps = peers(splits, 4, spec)
        assert ps["p0"].status_snapshot().senders is None and ps["p0"].take_reach_change() is None  # no schedule
        transport = InMemoryTransport(ps)
        changes = []
        for round_index in range(3):
            transport.begin_round(round_index)
            run_round(ps["p0"], transport, ["p1", "p2", "p3"], round_index, local_steps=1)
            changes.append(ps["p0"].take_reach_change())
        seen = ps["p0"].status_snapshot()
        assert seen.robust and (seen.senders, seen.max_insiders) == (senders, bounded)
        assert changes == [(senders, bounded), None, None]
    guard = ps["p0"].engine.guard  # the dense graph's
    guard.neighbours["p1"].quarantined_since = 3
    assert (ps["p0"].status_snapshot().senders, ps["p0"].take_reach_change()) == (2, (2, 0))
    for quarantined in ("p2", "p3"):
        guard.record(quarantined).quarantined_since = 3
    assert ps["p0"].take_reach_change() == (0, 0) and ps["p0"].take_reach_change() is None

    off = peers(splits, 2, replace(SPEC, gossip=replace(SPEC.gossip, robust=False)))
    transport = InMemoryTransport(off)
    transport.begin_round(0)
    run_round(off["p0"], transport, ["p1"], 0, local_steps=1)
    seen = off["p0"].status_snapshot()
    assert (seen.robust, seen.senders, seen.max_insiders) == (False, 1, None)
    assert off["p0"].take_reach_change() is None


def test_engine_limits_are_constructor_arguments(splits) -> None:
    built = build_peer_model(SPEC.model, splits, torch.device("cpu"), seed=SPEC.data.seed)
    p = build_peer(SPEC, "p0", (0, 1), splits, torch.device("cpu"), built, max_peers=5)
    assert p.engine.max_peers == 5 and p.engine.max_sender_weight == 5.0  # a fleet's weights sum to its size


# --- divergence recovery (peer/runtime/recovery.py), the round's own -------------------------------------------
def poison_next_round(peer, how: str = "nan") -> None:
    """Make the peer's next local round diverge: its model goes NaN, or its loss explodes (model finite)."""
    real = peer.train_steps

    def poisoned(n: int) -> float:
        peer.train_steps = real
        loss = real(n)
        if how == "nan":
            with peer.lock:
                peer.engine.state.x.view(-1)[0] = float("nan")
            return loss
        return 1e6

    peer.train_steps = poisoned


def run_rounds(ps: dict, transport, start: int, count: int) -> list:
    results = []
    for t in range(start, start + count):
        transport.begin_round(t)
        for peer_id, p in ps.items():
            results.append(run_round(p, transport, [q for q in ps if q != peer_id], t, local_steps=1))
        transport.deliver(t)
    return results


@pytest.mark.parametrize("how", ["nan", "loss"])
def test_a_diverged_round_rolls_back_halves_gamma_and_training_goes_on(splits, how: str) -> None:
    ps = peers(splits, 3)
    transport = InMemoryTransport(ps)
    run_rounds(ps, transport, 0, 12)  # snapshots at rounds 0 and 10
    a = ps["p0"]
    gamma = a.engine.gamma
    good = a.recovery.snapshots[0]
    assert good.round == 0 and torch.isfinite(good.z).all()
    poison_next_round(a, how)
    transport.begin_round(12)
    result = run_round(a, transport, ["p1", "p2"], 12, local_steps=1)
    assert result.diverged and result.sent == []  # a diverged model is never gossiped
    assert result.recovery.rolled_back_to == 0 and result.recovery.round == 12
    assert ("not finite" in result.recovery.reason) if how == "nan" else ("exploded" in result.recovery.reason)
    assert a.engine.gamma == pytest.approx(gamma / 2) and a.recovery.recoveries == 1
    assert torch.isfinite(a.engine.x).all()
    assert torch.allclose(a.engine.x / a.engine.w, good.z, atol=1e-6)  # the snapshot's model, at today's weight
    assert float(a.optimizer.buf.abs().sum()) == 0.0  # momentum cleared
    for peer_id, p in ps.items():
        if peer_id != "p0":
            run_round(p, transport, [q for q in ps if q != peer_id], 12, local_steps=1)
    transport.deliver(12)
    later = run_rounds(ps, transport, 13, 6)
    assert not any(r.diverged for r in later)
    assert all(torch.isfinite(p.engine.x).all() for p in ps.values())
    assert a.recovery.recoveries == 1 and a.engine.gamma == pytest.approx(gamma / 2)
    assert ps["p1"].engine.gamma == pytest.approx(gamma)  # only the peer that diverged slows its gossip


def test_recovery_is_bounded_then_a_clear_error(splits) -> None:
    spec = RunSpec(model=SPEC.model, data=SPEC.data, optim=SPEC.optim,
                   gossip=GossipSpec(algorithm="choco", compression=0.9, window=2, max_halvings=2))
    ps = peers(splits, 2, spec)
    transport = InMemoryTransport(ps)
    a = ps["p0"]
    for t in range(2):
        poison_next_round(a)
        assert run_round(a, transport, ["p1"], t, local_steps=1).diverged
    # nothing gossiped: the first has no step before it to blame (gamma halved), the second is its step's (the lr)
    assert a.engine.gamma == pytest.approx(spec.gossip.effective_gamma / 2) and a.lr() == pytest.approx(
        0.5 * lr_at(a.epoch, spec.optim.lr, spec.optim.epochs, spec.optim.warmup_epochs))
    poison_next_round(a)
    with pytest.raises(PeerDiverged, match=r"peer p0 diverged in round 2 .*gamma halved 1 time.*learning rate 1 "
                                           r"time.*--lr"):
        run_round(a, transport, ["p1"], 2, local_steps=1)
    assert torch.isfinite(a.engine.x).all()  # left at the last good model, not the diverged one


def test_a_hard_batch_is_not_an_explosion(splits) -> None:
    """A loss a few times the running mean is training, not divergence: no roll-back."""
    ps = peers(splits, 2)
    a = ps["p0"]
    a.recovery.loss_mean = 0.5
    assert a.recovery.diagnose(3.0, True, 10) is None  # 6x the mean but below twice a uniform guess's loss (2 ln 10)
    assert a.recovery.diagnose(0.5 * 100, True, 10) is not None


def test_checkpoint_keeps_the_halvings_across_a_restart(tmp_path: Path, splits) -> None:
    ps = peers(splits, 2)
    transport = InMemoryTransport(ps)
    a = ps["p0"]
    poison_next_round(a)
    run_round(a, transport, ["p1"], 0, local_steps=1)
    path = state.save(a, tmp_path / "checkpoint.pt", 1, {}, "fp-test")
    fresh = peers(splits)["p0"]
    state.restore(fresh, state.load(path))
    assert fresh.engine.gamma == pytest.approx(a.engine.gamma) == pytest.approx(SPEC.gossip.effective_gamma / 2)
    assert fresh.recovery.recoveries == 1 and fresh.recovery.halvings == 1


def test_batchnorm_statistics_are_recomputed_from_training_batches_before_an_evaluation() -> None:
    from torch import nn

    from peer.runtime.evaluation import refresh_batchnorm

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4, momentum=0.01), nn.ReLU())
    batches = [(torch.randn(8, 1, 6, 6) * 3 + 2, torch.zeros(8, dtype=torch.int64)) for _ in range(4)]
    model.eval()
    assert refresh_batchnorm(model, iter(batches), n_batches=4)
    bn = model[1]
    with torch.no_grad():
        features = torch.cat([model[0](x) for x, _ in batches])
    per_batch_means = torch.stack([model[0](x).mean((0, 2, 3)) for x, _ in batches]).detach()
    torch.testing.assert_close(bn.running_mean, per_batch_means.mean(0))  # the plain mean, not a 0.01 EMA
    assert abs(float(bn.running_mean.mean()) - float(features.mean())) < 0.1
    assert bn.momentum == 0.01 and not model.training  # settings and mode restored
    assert not refresh_batchnorm(nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU()), iter(batches))


def test_a_short_last_batch_is_evaluated_at_the_first_batchs_size_with_its_own_results(monkeypatch) -> None:
    """The test split's remainder batch runs padded to the first batch's size (an int8 model meets no new shape,
    so it plans no kernels and loads no pass graphs for one), and only its own rows count: loss and accuracy are
    those of the unpadded batches (the int8 quantization range of repeated rows is the batch's own)."""
    import torch.nn.functional as F

    from peer.lowp import PrecisionConfig
    from peer.models import build_model
    from peer.runtime.evaluation import evaluate

    monkeypatch.setenv("LPDL_LOWP_EAGER", "1")
    torch.manual_seed(0)
    model = build_model("mnist-cnn", in_channels=1, precision=PrecisionConfig("int8"))
    full = (torch.randn(32, 1, 28, 28), torch.randint(0, 10, (32,)))
    short = (torch.randn(8, 1, 28, 28) * 2, torch.randint(0, 10, (8,)))
    sizes: list[int] = []
    model.register_forward_pre_hook(lambda module, args: sizes.append(args[0].shape[0]))
    loss, acc = evaluate(model, [full, short])
    assert sizes == [32, 32]
    model.eval()
    with torch.no_grad():
        logits = torch.cat([model(full[0]), model(short[0])])  # the short batch alone, at its own size
    labels = torch.cat([full[1], short[1]])
    assert sizes[2:] == [32, 8]
    assert acc == int((logits.argmax(1) == labels).sum()) / 40
    assert loss == pytest.approx(F.cross_entropy(logits, labels).item(), rel=1e-6)
