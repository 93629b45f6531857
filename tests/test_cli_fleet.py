"""``lpdl-peer fleet``: flags forwarded to the daemons, and a real two-daemon fleet on loopback (slow)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from peer.cli.fleet import daemon_command, fleet, run_flag_args
from peer.cli.options import pop_run_spec
from peer.cli.start import pop_node_spec, start
from peer.config import DataSpec, GossipSpec, ModelSpec, OptimSpec, RunSpec


def test_daemon_command_reproduces_the_fleet_spec():
    """What the fleet passes to `lpdl-peer start` parses back into exactly its RunSpec and the loopback node."""
    spec = RunSpec(model=ModelSpec(precision="fp32"), data=DataSpec(skew=0.5, augment=False),
                   optim=OptimSpec(lr=0.02, epochs=1.5, qgm=True), gossip=GossipSpec(algorithm="sgp", compression=0.0))
    argv = daemon_command(run_flag_args(spec), ["--exit-when-done"], "fl-x", 2, 4, "127.0.0.1:0", Path("/tmp/s"))
    assert argv[:2] == [sys.executable, "-c"]
    ctx = start.make_context("start", argv[argv.index("start") + 1:])
    params = dict(ctx.params)
    node, _ = pop_node_spec(params, None)
    assert pop_run_spec(params) == spec
    assert (node.listen, node.neighbors, node.mdns_ip, node.fleet, node.peer_id, node.shard, node.state_dir,
            node.exit_when_done) == ("127.0.0.1:0", ("auto",), ("127.0.0.1",), "fl-x", "fl-x-p2", "2/4", "/tmp/s",
                                     True)


def test_refuses_a_used_run_directory(tmp_path: Path):
    (tmp_path / "peer-0").mkdir()
    result = CliRunner().invoke(fleet, ["--out", str(tmp_path)])
    assert result.exit_code == 2
    assert "not empty" in result.output


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_daemon_fleet_trains_gossips_and_summarises(tmp_path: Path):
    """2 fp32 daemons, 0.3 epoch each (about 20 rounds): exit 0, summary.json with accuracies, bytes exchanged."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-c", "from peer.cli.main import cli; cli()", "fleet", "--peers", "2", "--precision",
           "fp32", "--epochs", "0.3", "--eval-every", "5", "--refresh", "5", "--out", str(out)]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "averaged model" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ok"] and summary["peers"] == 2
    assert summary["precision"]["backend"] == "fp32"
    assert 0.0 <= summary["averaged_model_acc"] <= 1.0 and 0.0 <= summary["mean_peer_acc"] <= 1.0
    for peer in summary["per_peer"]:
        assert peer["exit_code"] == 0
        assert 0.0 <= peer["final_test_acc"] <= 1.0
        assert peer["rounds"] > 0
        assert peer["bytes_sent"] > 0 and peer["bytes_received"] > 0
        assert Path(peer["log"]).exists()
    assert summary["averaged_model_acc"] > 0.3  # far above chance (10%) after ~20 rounds
