"""The simulator and ``lpdl-peer simulate``: output files, wire-counted bytes, exact mass conservation under chaos,
compressed vs dense traffic, and usage errors that name the field. Small models on the synthetic dataset (fast)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from peer.cli.main import cli
from peer.config import DataSpec, GossipSpec, ModelSpec, OptimSpec, RunSpec
from peer.data import load_dataset
from peer.net.accounting import GRPC_FRAME_OVERHEAD
from peer.net.outbound import OutboundStream
from peer.net.proto.lpdl.v1 import peer_pb2 as pb
from peer.sim.simulation import EpochRow, Simulation
from peer.sim.transport import ChaosSpec, InMemoryTransport
from tests.gossip_helpers import totals as engine_totals

ROW_FIELDS = list(EpochRow.__dataclass_fields__)


@pytest.fixture(scope="module")
def splits():
    return load_dataset("synthetic", n_train=320, n_test=64, image_size=12, in_channels=1)


def make_spec(algorithm: str = "choco", compression: float = 0.9, lr: float = 0.1, bits: int = 8,
              gamma: float = 0.5, precision: str = "fp32") -> RunSpec:
    return RunSpec(model=ModelSpec(name="mnist-cnn", precision=precision, norm="evonorm" if precision == "fp32"
                                   else "range-evonorm"),
                   data=DataSpec(dataset="synthetic", batch_size=16),
                   optim=OptimSpec(lr=lr, epochs=2.0),
                   gossip=GossipSpec(algorithm=algorithm, compression=compression, bits=bits, gamma=gamma))


def test_simulate_cli_writes_results_with_bytes_counted_by_the_wire_rule(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Bytes are the frames the gRPC transport would put on the wire for every message handed to the transport
    (update chunks and the acks, each protobuf size + 5) and for the handshake that opens each stream, averaged
    over peers."""
    sent: dict[str, int] = {}
    real_submit = InMemoryTransport.submit

    def counting_submit(self, messages):
        for m in messages:
            update = pb.Update(seq=m.seq, round=m.round, weight=m.weight, scale=m.scale, algorithm="choco",
                               chunk_index=0, chunk_count=1, total_length=len(m.payload), data=m.payload)
            ack = pb.GossipReply(ack=pb.Ack(seq=m.seq, applied=True))
            sent[m.sender] = sent.get(m.sender, 0) + pb.GossipFrame(update=update).ByteSize() + GRPC_FRAME_OVERHEAD
            sent[m.receiver] = sent.get(m.receiver, 0) + ack.ByteSize() + GRPC_FRAME_OVERHEAD
        return real_submit(self, messages)

    real_hello, real_on_reply = OutboundStream.hello, OutboundStream.on_reply

    def counting_hello(self):  # each stream opens with a handshake: Hello ...
        raw = real_hello(self)
        me = self.gate.identity().peer_id
        sent[me] = sent.get(me, 0) + len(raw) + GRPC_FRAME_OVERHEAD
        return raw

    def counting_on_reply(self, reply, now):  # ... and HelloReply
        if reply.WhichOneof("reply") == "hello_reply":
            sent[self.receiver_id] = sent.get(self.receiver_id, 0) + reply.ByteSize() + GRPC_FRAME_OVERHEAD
        return real_on_reply(self, reply, now)

    monkeypatch.setattr(InMemoryTransport, "submit", counting_submit)
    monkeypatch.setattr(OutboundStream, "hello", counting_hello)
    monkeypatch.setattr(OutboundStream, "on_reply", counting_on_reply)
    out = tmp_path / "sim"
    result = CliRunner().invoke(cli, [
        "simulate", "--peers", "3", "--dataset", "synthetic", "--precision", "fp32", "--norm", "evonorm",
        "--algorithm", "choco", "--compression", "0.9", "--gamma", "0.5", "--batch-size", "32",
        "--epochs", "0.5", "--threads", "1", "--no-plot", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "3 peers" in result.output and "choco" in result.output
    assert "each peer hears 1 peer a period of the graph: no local rule can bound an insider" in result.output

    with (out / "results.csv").open() as fh:
        reader = csv.DictReader(fh)
        assert reader.fieldnames == ROW_FIELDS
        rows = list(reader)
    assert rows, "results.csv has no data rows"
    data = json.loads((out / "results.json").read_text())
    assert {"spec", "peers", "chaos", "spectral_gap", "precision", "rows"} <= set(data)
    assert data["peers"] == 3
    assert data["spec"]["gossip"]["algorithm"] == "choco"
    assert data["precision"]["backend"] == "fp32"
    assert not (out / "results.png").exists()
    last = data["rows"][-1]
    assert set(last) == set(ROW_FIELDS)
    assert 0.0 <= last["avg_model_acc"] <= 1.0 and 0.0 <= last["mean_peer_acc"] <= 1.0
    assert last["bytes_per_peer"] > 0
    assert last["bytes_per_peer"] == pytest.approx(sum(sent.values()) / 3)
    assert float(rows[-1]["bytes_per_peer"]) == pytest.approx(last["bytes_per_peer"])


def _totals(sim: Simulation) -> tuple[torch.Tensor, float]:
    """sum x + mass in flight (float64), sum w + weight in flight."""
    return engine_totals({p: peer.engine for p, peer in sim.peers.items()})


@pytest.mark.parametrize("algorithm", ["choco", "deepsqueeze"])
def test_lr_zero_with_chaos_conserves_mass_and_weight(splits, algorithm: str) -> None:
    n = 4
    sim = Simulation(make_spec(algorithm, compression=0.9, lr=0.0), splits, n,
                     chaos=ChaosSpec(drop=0.3, delay=1, churn=0.2, offline_rounds=2))
    mass0, weight0 = _totals(sim)
    assert weight0 == pytest.approx(n)
    saw_in_flight = False
    for _ in range(12):
        sim.step_round()
        mass, weight = _totals(sim)
        assert weight == pytest.approx(weight0, abs=1e-9)
        torch.testing.assert_close(mass, mass0, rtol=0, atol=1e-4)
        saw_in_flight |= any(w.engine.in_flight()[1] > 0 for w in sim.peers.values())
    assert saw_in_flight, "delay=1 should leave messages in flight between rounds"
    assert sim.transport.offline_until, "churn should have taken a peer offline at some point"
    sim.transport.flush()
    mass, weight = _totals(sim)
    assert all(w.engine.in_flight()[1] == 0 for w in sim.peers.values())
    assert weight == pytest.approx(weight0, abs=1e-9)
    torch.testing.assert_close(mass, mass0, rtol=0, atol=1e-4)
    # gossip really moved mass around: the peers' weights are no longer all 1
    assert any(abs(w.engine.w - 1.0) > 1e-6 for w in sim.peers.values())


def test_compressed_gossip_sends_far_fewer_bytes_than_dense(splits) -> None:
    def bytes_after(spec: RunSpec, rounds: int = 3) -> float:
        sim = Simulation(spec, splits, 4)
        for _ in range(rounds):
            sim.step_round()
        return sum(sim.transport.bytes_sent(p) for p in sim.ids)

    numel = sum(p.numel() for p in Simulation(make_spec(), splits, 1).eval_model.parameters())
    dense8 = bytes_after(make_spec("deepsqueeze", compression=0.0, bits=8, gamma=1.0))
    dense32 = bytes_after(make_spec("sgp", compression=0.0, bits=32, gamma=1.0))
    sparse = bytes_after(make_spec("choco", compression=0.99, bits=8))
    messages = 4 * 3  # directed ring: one message per peer per round
    assert numel <= dense8 / messages < 1.1 * numel  # 1 byte per entry plus headers and scales
    assert 4 * numel <= dense32 / messages < 4.1 * numel
    assert sparse / dense8 < 0.05  # keeps 1%: int8 value + entropy-near index per kept entry
    assert sparse / dense32 < 0.0125


@pytest.mark.parametrize(("flag", "value", "field"), [
    ("--compression", "1.5", "gossip.compression"),
    ("--skew", "2", "data.skew"),
    ("--gamma", "0", "gossip.gamma"),
    ("--batch-size", "0", "data.batch_size"),
])
def test_bad_flag_value_is_a_usage_error_naming_the_field(tmp_path: Path, flag: str, value: str,
                                                          field: str) -> None:
    result = CliRunner().invoke(cli, ["simulate", "--dataset", "synthetic", "--peers", "2", "--no-plot",
                                      "--out", str(tmp_path), flag, value])
    assert result.exit_code == 2, result.output
    assert field in result.output and value in result.output
    assert not (tmp_path / "results.json").exists()


def test_bad_chaos_value_is_an_error_naming_it(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["simulate", "--dataset", "synthetic", "--peers", "2", "--no-plot",
                                      "--out", str(tmp_path), "--drop", "1.5"])
    assert result.exit_code != 0
    assert "drop" in result.output and "1.5" in result.output


def test_diverging_simulation_is_a_clear_error(tmp_path):
    from click.testing import CliRunner

    from peer.cli.main import cli

    result = CliRunner().invoke(cli, ["simulate", "--peers", "2", "--dataset", "synthetic", "--model", "mnist-cnn",
                                      "--precision", "fp32", "--lr", "1e30", "--epochs", "1", "--no-plot",
                                      "--out", str(tmp_path / "out")])
    assert result.exit_code != 0
    assert "diverged" in result.output and "--lr" in result.output
    assert "the learning rate 4 time(s)" in result.output  # the bounded recoveries were tried first, on the lr


def test_a_peer_that_diverges_recovers_and_the_simulation_runs_on(splits, tmp_path: Path) -> None:
    """The simulator gets recovery from the runtime's round: one peer's model goes non-finite in its training of
    round 5, it is rolled back and - its own step's fault - its learning rate halved, gamma kept, the run finishes
    with every model finite, and the event is in results.json."""
    from peer.sim.results import write_results

    sim = Simulation(make_spec(gamma=0.5), splits, 3)
    victim = sim.peers["peer-001"]
    real = victim.train_steps

    def nan_in_round_5(n: int) -> float:
        loss = real(n)
        if sim.round == 5:
            with victim.lock:
                victim.engine.state.x.view(-1)[3] = float("inf")
        return loss

    victim.train_steps = nan_in_round_5
    rows = sim.run(1.0)
    assert [(e.peer_id, e.round, e.gamma, e.lr_factor) for e in sim.recoveries] == [("peer-001", 5, 0.5, 0.5)]
    assert victim.engine.gamma == 0.5 and victim.recovery.lr_factor == 0.5
    assert sim.peers["peer-000"].recovery.lr_factor == 1.0
    assert all(torch.isfinite(p.engine.x).all() for p in sim.peers.values())
    assert rows[-1].recoveries == 1 and all(torch.isfinite(torch.tensor(r.train_loss)) for r in rows)
    write_results(tmp_path, sim.spec, sim, rows, 0.5, plot=False)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["recoveries"][0]["peer_id"] == "peer-001" and saved["rows"][-1]["recoveries"] == 1


@pytest.mark.slow
def test_default_recipe_holds_under_skew_at_99_percent_compression() -> None:
    """Issue 12's guard: the product's default recipe (int8, Choco at 99% top-k, default gamma / lr / schedule,
    8-peer ring) on skewed real data (skew 0.8) for a short run (3 epochs, 45 rounds) ends finite, without a single
    divergence recovery, and above chance (10%): measured 73.0% averaged model / 27.7% mean per peer (each peer
    still leans towards its own two classes after 45 rounds). The collapse of the old recipe ended at 9-19%
    (averaged model) or in NaN; the floors leave room for another machine's kernels, not for a collapse."""
    import math

    from peer.config import load_run_spec

    spec = load_run_spec(flags={"data": {"skew": 0.8}, "optim": {"epochs": 3}})
    g = spec.gossip
    assert (g.algorithm, g.compression, g.gamma, spec.model.precision) == ("choco", 0.99, None, "int8")
    sim = Simulation(spec, load_dataset("mnist5k"), 8)
    losses = [sim.step_round() for _ in range(3 * sim.rounds_per_epoch)]
    row = sim.measure(losses[-1], 0.0)
    assert all(bool(torch.isfinite(p.engine.x).all()) for p in sim.peers.values())
    assert all(math.isfinite(v) for v in losses)
    assert sim.recoveries == []
    assert row.avg_model_acc >= 0.5, row
    assert row.mean_peer_acc >= 0.15, row
