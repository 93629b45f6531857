"""``lpdl-peer prepare`` (peer/daemon/prepare.py): the int8 pass graphs of a config compiled into the host's store
before a daemon starts, so that the daemon queues none and runs them compiled from its first step; configs with
nothing to compile say why; bad input gets a clear error. The compiling test needs a C++ compiler (skipped, saying
so, without one)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from peer.cli.main import cli
from peer.lowp import aot_queue
from peer.lowp.aot_graphs import QUEUED
from tests.daemon_helpers import free_ports, lpdl_peer_argv, start_daemon

ROOT = Path(__file__).resolve().parents[1]
NO_COMPILER = shutil.which("g++") is None and shutil.which("c++") is None
#: A user's model small enough that its pass graphs compile in a minute or less: one int8 linear layer.
TINY_MODEL = """
from torch import nn

def build(num_classes=10, in_channels=1):
    return nn.Sequential(nn.Flatten(), nn.Linear(784 * in_channels, num_classes))
"""


def prepare_argv(model: Path) -> list[str]:
    return [*lpdl_peer_argv(), "prepare", "--model", f"{model}:build", "--batch-size", "16"]


def compiling_env(cache: Path) -> dict[str, str]:
    """A process that compiles (the suite runs the passes eagerly) into ``cache``; LPDL_LOWP_EAGER=0 also compiles
    a converted model's passes, which run eagerly by default."""
    env = {**os.environ, "LPDL_CACHE_DIR": str(cache), "LPDL_LOWP_EAGER": "0",
           "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    env.pop("LPDL_LOWP_AOT", None)
    return env


@pytest.mark.slow  # compiles the tiny model's pass graphs, 5-25 s each
@pytest.mark.skipif(NO_COMPILER, reason="no C++ compiler: the passes run eagerly, there is nothing to prepare")
def test_a_daemon_started_after_prepare_queues_no_pass_graph_and_a_second_prepare_compiles_none(tmp_path) -> None:
    model = tmp_path / "tiny.py"
    model.write_text(TINY_MODEL)
    cache = tmp_path / "cache"
    env = compiling_env(cache)

    first = subprocess.run(prepare_argv(model), env=env, capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stderr[-3000:]
    compiled, found = map(int, re.search(r"(\d+) compiled, (\d+) found stored", first.stdout).groups())
    assert compiled >= found >= 1, first.stdout  # a fresh store: what the check found, this run compiled
    (store,) = (cache / "aot-graphs").iterdir()
    assert not aot_queue.pending(store) and not list((store / aot_queue.FAILED).glob("*.pt"))

    # a daemon of the same config (alone: its one neighbour never answers) trains, evaluates and queues nothing
    port, absent = free_ports(2)
    daemon = start_daemon(tmp_path / "state", "p0", port, neighbors=[f"127.0.0.1:{absent}"], max_rounds=6,
                          eval_every=2, join_wait_s=0, run_flags=["--model", f"{model}:build", "--batch-size", "16"],
                          env={"LPDL_CACHE_DIR": str(cache), "LPDL_LOWP_EAGER": "0",
                               "LPDL_LOWP_AOT": "background"})  # a daemon's default, which the suite's env overrides
    try:
        assert daemon.proc.wait(timeout=180) == 0
    finally:
        daemon.proc.kill()
    log = daemon.log_path.read_text()
    assert "quantizers compiled ahead of time" in log, log[-3000:]
    assert QUEUED not in log, log[-3000:]
    assert not aot_queue.pending(store)

    second = subprocess.run(prepare_argv(model), env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr[-3000:]
    assert re.search(r" 0 compiled, (\d+) found stored", second.stdout), second.stdout


def test_a_config_without_int8_passes_has_nothing_to_prepare() -> None:
    result = CliRunner().invoke(cli, ["prepare", "--precision", "fp32"])
    assert result.exit_code == 0, result.output
    assert "nothing to prepare for mnist-cnn, batch 32, fp32: precision fp32" in result.output


def test_passes_run_eagerly_by_the_operators_switch_have_nothing_to_prepare(monkeypatch) -> None:
    monkeypatch.setenv("LPDL_LOWP_EAGER", "1")
    result = CliRunner().invoke(cli, ["prepare"])
    assert result.exit_code == 0, result.output
    assert "int8 passes run eagerly on this host (LPDL_LOWP_EAGER set)" in result.output


def test_a_missing_data_directory_is_named(tmp_path) -> None:
    missing = tmp_path / "no-such-cifar"
    result = CliRunner().invoke(cli, ["prepare", "--dataset", "cifar10", "--data-root", str(missing)])
    assert result.exit_code == 1
    assert str(missing) in result.output and "Traceback" not in result.output


def test_a_wrong_config_value_is_a_usage_error_naming_the_field() -> None:
    done = subprocess.run([*lpdl_peer_argv(), "prepare", "--batch-size", "0"], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 2
    assert "batch_size" in done.stderr and "Traceback" not in done.stderr


def test_a_model_file_that_does_not_exist_is_named(tmp_path) -> None:
    missing = tmp_path / "no_such_model.py"
    result = CliRunner().invoke(cli, ["prepare", "--model", f"{missing}:build"])
    assert result.exit_code == 1 and str(missing) in result.output and "Traceback" not in result.output


def test_a_host_without_a_working_cpp_compiler_fails_with_the_reason(tmp_path) -> None:
    """No pass can be compiled: exit 1 and why (a daemon runs them eagerly), not "nothing to prepare"."""
    env = {**compiling_env(tmp_path / "cache"), "CXX": str(tmp_path / "no-such-g++")}
    done = subprocess.run([*lpdl_peer_argv(), "prepare"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr[-2000:]
    assert "the passes: not compiled" in done.stderr and "No working C++ compiler" in done.stderr


def test_prepare_compiles_a_registry_model_on_a_small_machine_and_leaves_plug_in_models_as_their_daemons(
        tmp_path, monkeypatch) -> None:
    """The rule that keeps a machine under 4 GiB from compiling is for a compiler beside its daemons: prepare runs
    alone and compiles a registry model's passes whatever the memory (LPDL_LOWP_EAGER=0 lifts the rule); a plug-in
    model's passes stay as its daemon runs them (eager unless the operator sets LPDL_LOWP_EAGER=0), and the
    operator's own setting is kept. (Compiling the MNIST CNN takes minutes: the environment is what is checked.)"""
    from peer.config import ModelSpec, RunSpec
    from peer.daemon.prepare import compiling_environment

    monkeypatch.delenv("LPDL_LOWP_EAGER", raising=False)
    assert compiling_environment(RunSpec()) == {"LPDL_LOWP_AOT": "1", "LPDL_LOWP_EAGER": "0"}
    model = tmp_path / "tiny.py"
    model.write_text(TINY_MODEL)
    assert compiling_environment(RunSpec(model=ModelSpec(name=f"{model}:build"))) == {"LPDL_LOWP_AOT": "1"}
    monkeypatch.setenv("LPDL_LOWP_EAGER", "1")
    assert compiling_environment(RunSpec()) == {"LPDL_LOWP_AOT": "1"}
