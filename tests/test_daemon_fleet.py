"""Four real daemons (separate processes, loopback, static neighbours) train MNIST together, and reach the accuracy the
simulator reaches with the same RunSpec, peer ids, shards and number of rounds (same gossip code, different
transport: docs/design.md#architecture). Also the operator-facing surface: status over the control socket (neighbours
active with bytes sent, precision backend), SIGTERM exit code 0, final checkpoint."""

from __future__ import annotations

import math
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from peer.config import load_run_spec
from peer.data import load_dataset
from peer.runtime.evaluation import evaluate
from peer.sim.simulation import Simulation
from tests.daemon_helpers import kill_all, static_fleet, stop_all

pytestmark = pytest.mark.slow

N = 4
ROUNDS = 96  # 3 epochs of a 1/4 shard (1,000 images, batch 32: 31 steps per epoch), one local step per round
EPOCHS = 3.0
FLAGS = {
    "model": {"name": "mnist-cnn", "precision": "fp32"},
    "data": {"dataset": "mnist5k", "batch_size": 32},
    "optim": {"lr": 0.05, "epochs": EPOCHS},
    # the largest window: a daemon whose receiver runs a few rounds behind (a busy machine) keeps sending every round
    # instead of skipping rounds for backpressure, so bytes per round compare with the lockstep simulator's
    "gossip": {"algorithm": "choco", "compression": 0.9, "window": 64},
}
CLI_FLAGS = ["--model", "mnist-cnn", "--precision", "fp32", "--dataset", "mnist5k", "--batch-size", "32",
             "--lr", "0.05", "--epochs", str(EPOCHS), "--algorithm", "choco", "--compression", "0.9",
             "--window", "64"]


def simulated_run(abort: threading.Event | None = None) -> tuple[list[float], list[float]]:
    """Per-peer test accuracy of the simulator after ROUNDS synchronous rounds (same spec, ids peer-000...), and
    per-peer bytes sent per round over rounds ROUNDS/2 .. ROUNDS (the transport's frame rule)."""
    import torch

    torch.set_num_threads(1)
    spec = load_run_spec(None, flags=FLAGS)
    sim = Simulation(spec, load_dataset("mnist5k"), N)
    assert sim.ids == [f"peer-{i:03d}" for i in range(N)]
    halfway: list[int] = []
    for r in range(ROUNDS):
        if abort is not None and abort.is_set():
            raise RuntimeError("simulation aborted: the daemon part of the test failed")
        if r == ROUNDS // 2:
            halfway = [sim.transport.bytes_sent(p) for p in sim.ids]
        sim.step_round()
    rates = [(sim.transport.bytes_sent(p) - b) / (ROUNDS - ROUNDS // 2) for p, b in zip(sim.ids, halfway)]
    for peer in sim.peers.values():
        peer.sync_model()
    return [evaluate(p.model, sim.test_batches)[1] for p in sim.peers.values()], rates


def sent_bytes(status: dict) -> int:
    """Bytes a daemon sent over all its links (status document)."""
    return sum(n["bytes_sent"] for n in status["neighbours"].values())


def test_four_daemons_train_like_the_simulator(tmp_path: Path) -> None:
    started = time.monotonic()
    fleet = static_fleet(tmp_path, N, CLI_FLAGS, max_rounds=3 * ROUNDS, eval_every=ROUNDS, checkpoint_every=40)
    ids = [d.peer_id for d in fleet]
    # the simulator runs meanwhile in a thread of this process (torch releases the GIL; one intra-op thread)
    pool = ThreadPoolExecutor(max_workers=1)
    abort = threading.Event()
    simulated = pool.submit(simulated_run, abort)
    try:
        for d in fleet:
            s = d.wait_ready()
            assert s["precision"] == {"requested": "fp32", "backend": "fp32", "reason": s["precision"]["reason"]}
            assert s["gossip"]["algorithm"] == "choco" and s["gossip"]["compression"] == 0.9
        # status: every other peer is a live out-neighbour with an open stream and bytes sent to it
        for d in fleet:
            others = [p for p in ids if p != d.peer_id]
            s = d.wait_status(lambda st, others=others: all(
                st["neighbours"].get(p, {}).get("state") in ("active", "busy")
                and st["neighbours"][p]["bytes_sent"] > 0 and st["neighbours"][p]["live"] for p in others)
                and st["applied"] > 0, 150, "all neighbours active with bytes sent, messages applied")
            n = s["neighbours"]
            assert any(n[p]["state"] == "active" for p in others) or s["round"] > 0
            assert all(n[p]["bytes_received"] > 0 for p in others), n
        # bytes per round in the second half, by the transport's frame rule (compared with the simulator below)
        halfway = {d.peer_id: d.wait_status(lambda st: st["round"] >= ROUNDS // 2, 240, "half-way round")
                   for d in fleet}
        # train to ROUNDS: every peer evaluates at exactly that round (eval_every = ROUNDS)
        daemon_rates = []
        for d in fleet:
            d.wait_log(rf"round {ROUNDS} epoch [\d.]+: train loss \S+, test acc", timeout_s=240)
            s = d.status()
            h = halfway[d.peer_id]
            daemon_rates.append((sent_bytes(s) - sent_bytes(h)) / (s["round"] - h["round"]))
            assert s["eval"] and s["eval"]["round"] >= ROUNDS and 0.0 <= s["eval"]["test_acc"] <= 1.0
            assert math.isfinite(s["w"]) and s["w"] > 0
        codes = stop_all(fleet)
        assert codes == [0] * N, "SIGTERM must exit 0: " + "; ".join(
            d.fail(f"rc {c}").args[0] for d, c in zip(fleet, codes) if c != 0)
        daemon_acc = [dict(d.test_accuracies())[ROUNDS] for d in fleet]
        for d in fleet:
            assert f"peer {d.peer_id} stopped after" in d.log_text()
            state = d.checkpoint()
            assert state["peer_id"] == d.peer_id and state["round"] >= ROUNDS
            assert math.isfinite(state["engine"]["w"]) and state["engine"]["w"] > 0
            assert not d.control_socket.exists()  # removed on clean shutdown
    except BaseException:
        abort.set()
        raise
    finally:
        kill_all(fleet)
        pool.shutdown(wait=False)
    daemon_s = time.monotonic() - started
    sim_acc, sim_rates = simulated.result(timeout=300)
    mean_daemon, mean_sim = sum(daemon_acc) / N, sum(sim_acc) / N
    print(f"daemons ({daemon_s:.0f} s): {[f'{a:.3f}' for a in daemon_acc]} mean {mean_daemon:.3f}; "
          f"simulator: {[f'{a:.3f}' for a in sim_acc]} mean {mean_sim:.3f}")
    print(f"bytes sent per round: daemons {[round(r) for r in daemon_rates]}, simulator {[round(r) for r in sim_rates]}")
    # one byte rule: a daemon's steady traffic per round is one ring message + the Acks it returns, counted like the
    # simulator's frames: the fleet's median must match the simulator's to 1%.
    assert statistics.median(daemon_rates) == pytest.approx(statistics.median(sim_rates), rel=0.01), (
        daemon_rates, sim_rates)
    # single daemons may differ a little: a reconnect under load adds a handshake and re-sends what it retracted
    assert all(0.85 * max(sim_rates) <= rate <= 1.1 * max(sim_rates) for rate in daemon_rates), (daemon_rates,
                                                                                               sim_rates)
    assert mean_sim > 0.8, "the simulator itself must learn this config"
    assert abs(mean_daemon - mean_sim) < 0.05, (daemon_acc, sim_acc)
    assert min(daemon_acc) > mean_sim - 0.08, (daemon_acc, sim_acc)
