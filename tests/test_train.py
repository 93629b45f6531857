"""Centralised training (``lpdl-peer train`` / run_training) on the bundled real MNIST subset.

Acceptance goal of the issue: the MNIST CNN reaches at least 90% test accuracy in fp32 and in int8 within a bounded
number of steps (250 steps of batch 32 = 2 epochs of the 4,000 training images).

The int8 test runs the mode resolve_precision selects on this machine (int8 on the kernels its probe proved exact
and fastest here) and counts every int8 product, so it cannot pass on a silent fallback.
"""

from __future__ import annotations

import collections
import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import peer.runtime.build
from peer.cli.main import cli
from peer.cli.train import run_training
from peer.config import DataSpec, GossipSpec, ModelSpec, OptimSpec, RunSpec
from peer.lowp.plan import KernelPlan

MAX_STEPS = 250  # 2 epochs of 125 steps
TARGET = 0.90


def mnist_spec(precision: str) -> RunSpec:
    """The paper's optimizer (SGD Nesterov 0.9, wd 1e-4, batch 32) at lr 0.01 on a 2-epoch step schedule.

    lr 0.01: at the paper's lr 0.1 after a 0.2-epoch warm-up the int8 run died within the first epoch (loss back to
    ln 10, 10% accuracy; the fp32 one reached 90%); at lr 0.01 one epoch gives ~94% in every precision
    (docs/RESULTS.md, warm-up epoch of the centralised runs).
    Range EvoNorm in both precisions (the default norm), so the two tests differ only in precision. The paper's
    fp32 choice, EvoNorm-S0, diverges on this model at lr 0.1 (docs/RESULTS.md).
    """
    return RunSpec(model=ModelSpec(name="mnist-cnn", precision=precision, norm="range-evonorm"),
                   data=DataSpec(dataset="mnist5k", batch_size=32, seed=0),
                   optim=OptimSpec(lr=0.01, epochs=2.0, warmup_epochs=0.0),
                   gossip=GossipSpec(algorithm="sgp", compression=0.0, bits=32))


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
def test_fp32_mnist_cnn_reaches_90_percent(tmp_path: Path, one_thread) -> None:
    metrics = run_training(mnist_spec("fp32"), torch.device("cpu"), tmp_path, max_steps=MAX_STEPS)
    assert metrics["precision"]["backend"] == "fp32"
    assert metrics["epochs"][-1]["step"] == MAX_STEPS
    assert metrics["epochs"][-1]["test_acc"] >= TARGET, metrics["epochs"]
    saved = json.loads((tmp_path / "metrics.json").read_text())
    assert saved["epochs"] == metrics["epochs"]
    assert (tmp_path / "checkpoint.pt").exists()


def _count_products(monkeypatch: pytest.MonkeyPatch) -> collections.Counter:
    """Count every int8 product by op kind (each goes through KernelPlan.choose to find its kernel)."""
    calls: collections.Counter = collections.Counter()
    real_choose = KernelPlan.choose

    def counting_choose(self, case, source="model"):
        if source == "model":
            calls[case.op] += 1
        return real_choose(self, case, source)

    monkeypatch.setattr(KernelPlan, "choose", counting_choose)
    return calls


@pytest.mark.slow
def test_int8_mnist_cnn_reaches_90_percent_in_the_selected_8bit_mode(tmp_path: Path, one_thread,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The mode resolve_precision selects here (int8, with whatever kernels the probe chose), not a forced one."""
    calls = _count_products(monkeypatch)
    metrics = run_training(mnist_spec("int8"), torch.device("cpu"), tmp_path, max_steps=MAX_STEPS)
    assert metrics["precision"]["requested"] == "int8"
    assert metrics["precision"]["backend"].startswith("int8/"), metrics["precision"]
    # 4 quantized layers: 4 forward and 3 input-gradient int8 products per step (the first conv needs no input
    # gradient); evaluation adds forward ones, and the once-per-process int8-vs-fp32 step check (peer/lowp/steptime)
    # runs an int8 copy of the model for one warm-up and DEFAULT_STEPS timed passes - unless an earlier process of
    # this host measured it (the host probe record): then it is read, and runs nothing.
    from peer.lowp.steptime import DEFAULT_STEPS

    step = metrics["precision"].get("step_time_vs_fp32")
    check_passes = 1 + DEFAULT_STEPS if step and not step["recorded"] else 0
    assert calls["conv.fwd"] + calls["linear.fwd"] >= MAX_STEPS * 4
    assert calls["conv.dgrad"] + calls["linear.dgrad"] == (MAX_STEPS + check_passes) * 3, metrics["precision"]
    assert metrics["epochs"][-1]["test_acc"] >= TARGET, metrics["epochs"]
    ckpt = torch.load(tmp_path / "checkpoint.pt", weights_only=False)
    assert ckpt["spec"]["model"]["precision"] == "int8"


def test_int8_model_runs_every_product_through_the_kernel_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fast check: the built model's layers are int8, and a step's products all go through the probed kernels."""
    from peer.data import load_dataset
    from peer.lowp import QConv2d, QLinear

    monkeypatch.setenv("LPDL_LOWP_EAGER", "1")
    splits = load_dataset("synthetic", n_train=32, n_test=8, image_size=28, in_channels=1)
    built = peer.runtime.build.build_peer_model(ModelSpec(name="mnist-cnn", precision="int8"), splits,
                                                torch.device("cpu"))
    layers = [m for m in built.model.modules() if isinstance(m, (QConv2d, QLinear))]
    assert len(layers) == 4 and all(m.precision.mode == "int8" for m in layers)
    assert built.precision.backend.startswith("int8/")
    calls = _count_products(monkeypatch)
    built.model(torch.randn(4, 1, 28, 28)).sum().backward()
    assert calls == {"conv.fwd": 2, "linear.fwd": 2, "conv.dgrad": 1, "linear.dgrad": 2, "conv.wgrad": 2,
                     "linear.wgrad": 2}


def test_train_cifar10_missing_root_names_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nonexistent"
    result = CliRunner().invoke(cli, ["train", "--dataset", "cifar10", "--data-root", str(missing),
                                      "--out", str(tmp_path / "out"), "--max-steps", "1"])
    assert result.exit_code == 1, result.output
    assert str(missing) in result.output
    assert "CIFAR-10" in result.output and "not a directory" in result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "out").exists()


def test_train_cifar10_without_root_is_a_clear_error(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["train", "--dataset", "cifar10", "--out", str(tmp_path / "out")])
    assert result.exit_code == 1, result.output
    assert "root" in result.output and "cifar10" in result.output
