"""``lpdl-peer fleet`` and peer/fleet: flags forwarded to the daemons, the live table, the report, and a real
two-daemon fleet on loopback (slow)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from peer.cli.main import cli
from peer.cli.options import RUN_FLAGS, pop_daemon_config
from peer.cli.start import NODE_FLAGS, start
from peer.config import DataSpec, GossipSpec, ModelSpec, OptimSpec, RunSpec
from peer.daemon.allocator import library_for
from peer.daemon.config import DaemonConfig, NodeSpec
from peer.daemon.status import NeighbourStatus, StatusDocument
from peer.fleet.launch import Daemon, daemon_environment
from peer.fleet.run import FLEET_MAX_UNACKED, FleetOptions, commands
from peer.net.config import NetConfig
from peer.fleet.report import (
    CheckpointEval,
    build_summary,
    evaluate_checkpoints,
    format_summary,
)
from peer.fleet.watch import render_table, table_row
from tests.status_helpers import neighbour_json, status_document


def test_each_daemon_runs_the_resolved_config_file_the_fleet_wrote(tmp_path: Path):
    """The fleet writes each daemon's whole config (run, [node], [net]) into the run directory and starts
    `lpdl-peer start --config FILE`: what `start` loads from that argv is exactly the fleet's spec, the config
    file's own [node] / [net] settings and the loopback node the fleet sets."""
    spec = RunSpec(model=ModelSpec(precision="fp32"), data=DataSpec(skew=0.5, augment=False, root="/d/q\"uote"),
                   optim=OptimSpec(lr=0.02, epochs=1.5, qgm=True),
                   gossip=GossipSpec(algorithm="sgp", compression=0.0, window=7))
    opts = FleetOptions(run_dir=tmp_path, name="fl-x", n_peers=4, threads=2, eval_every=9,
                        node=NodeSpec(round_interval_s=0.5, allocator="glibc", listen="10.0.0.1:1"),
                        net=NetConfig(ack_timeout_s=7.0))
    argvs = commands(spec, opts)
    assert [argv[argv.index("--config") + 1] for argv in argvs] == [str(tmp_path / f"peer-{i}.toml")
                                                                   for i in range(4)]
    argv = argvs[2]
    assert argv[:2] == [sys.executable, "-c"] and argv[argv.index("start") + 1:argv.index("--config")] == []
    params = dict(start.make_context("start", argv[argv.index("start") + 1:]).params)
    config = pop_daemon_config(params, RUN_FLAGS + NODE_FLAGS, None)
    assert config.run == spec and config.net == NetConfig(ack_timeout_s=7.0)
    node = config.node
    assert (node.listen, node.neighbors, node.mdns_ip, node.fleet, node.peer_id, node.shard, node.state_dir,
            node.threads, node.eval_every, node.checkpoint_every, node.join_wait_s, node.exit_when_done) == \
        ("127.0.0.1:0", ("auto",), ("127.0.0.1",), "fl-x", "fl-x-p2", "2/4", str(tmp_path / "peer-2"), 2, 9, 9,
         0.0, True)
    assert (node.round_interval_s, node.allocator) == (0.5, "glibc")  # the config file's own [node] settings


def test_a_placement_moves_each_daemon_off_loopback(tmp_path: Path) -> None:
    """A placement (bench/netns_fleet.py's namespaces) rewrites each daemon's address in the file it runs and
    starts it behind its own argv prefix; the rest of the config stays the fleet's."""
    opts = FleetOptions(run_dir=tmp_path, name="fl-y", n_peers=3)

    def place(config: DaemonConfig, index: int) -> tuple[DaemonConfig, list[str]]:
        node = replace(config.node, listen=f"10.9.0.{index + 1}:0", mdns_ip=(f"10.9.0.{index + 1}",))
        return replace(config, node=node), ["ip", "netns", "exec", f"ns{index}"]

    argvs = commands(RunSpec(), opts, place)
    assert [argv[:4] for argv in argvs] == [["ip", "netns", "exec", f"ns{i}"] for i in range(3)]
    argv = argvs[1][4:]
    params = dict(start.make_context("start", argv[argv.index("start") + 1:]).params)
    node = pop_daemon_config(params, RUN_FLAGS + NODE_FLAGS, None).node
    assert (node.listen, node.mdns_ip, node.peer_id, node.shard) == ("10.9.0.2:0", ("10.9.0.2",), "fl-y-p1", "1/3")


def test_the_fleets_config_variables_stay_with_the_fleet() -> None:
    """LPDL_<SECTION>_* variables are resolved into the daemons' files, so a daemon does not see them (they would
    beat its file); other variables pass, and the fleet's own defaults apply unless the user set them."""
    env = daemon_environment({"LPDL_NODE_LISTEN": "0.0.0.0:9", "LPDL_GOSSIP_WINDOW": "2", "LPDL_NET_MAX_PEERS": "3",
                              "LPDL_LOWP_AOT": "1", "PATH": "/bin"})
    assert env == {"LPDL_LOWP_AOT": "1", "PATH": "/bin", "PYTHONUNBUFFERED": "1"}
    assert daemon_environment({})["LPDL_LOWP_AOT"] == "background"  # the passes from the host's store


def test_the_fleet_reads_the_config_file_once_for_every_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """`lpdl-peer fleet --config FILE`: the file's [node] and [net] tables reach every daemon's file; a wrong value
    in them is refused before any daemon starts, naming the field."""
    import peer.cli.fleet as fleet_cli

    seen: list[tuple[RunSpec, FleetOptions]] = []
    monkeypatch.setattr(fleet_cli, "run_fleet", lambda spec, opts: seen.append((spec, opts)) or {"ok": True})
    monkeypatch.setattr(fleet_cli, "format_summary", lambda summary: "done")
    cfg = tmp_path / "fleet.toml"
    cfg.write_text("[gossip]\nwindow = 5\n[node]\nround_interval_s = 0.25\n[net]\nack_timeout_s = 9.0\n")
    result = CliRunner().invoke(cli, ["fleet", "--config", str(cfg), "--out", str(tmp_path / "run"), "--lr", "0.01"],
                                env={"LPDL_GOSSIP_WINDOW": None})
    assert result.exit_code == 0, result.output
    spec, opts = seen[0]
    assert (spec.gossip.window, spec.optim.lr, spec.optim.epochs) == (5, 0.01, 4.0)
    assert opts.node.round_interval_s == 0.25 and opts.net.ack_timeout_s == 9.0
    assert opts.node.max_unacked == FLEET_MAX_UNACKED == 1  # the fleet's pacing, not start's default (off)
    assert NodeSpec().max_unacked == 0
    cfg.write_text("[node]\nmax_unacked = 3\n")  # the operator's own value wins
    assert CliRunner().invoke(cli, ["fleet", "--config", str(cfg), "--out", str(tmp_path / "run3")]).exit_code == 0
    assert seen[-1][1].node.max_unacked == 3
    del seen[1:]
    cfg.write_text("[net]\nack_timeout_s = -1\n")
    bad = CliRunner().invoke(cli, ["fleet", "--config", str(cfg), "--out", str(tmp_path / "run2")])
    assert bad.exit_code == 2 and "net.ack_timeout_s" in bad.output and len(seen) == 1


def test_refuses_a_used_run_directory(tmp_path: Path):
    (tmp_path / "peer-0").mkdir()
    result = CliRunner().invoke(cli, ["fleet", "--out", str(tmp_path)])
    assert result.exit_code == 2
    assert "not empty" in result.output


def _help_of(command: str, flag: str) -> str:
    """The help text of one flag of a command, wrapped lines joined."""
    text = CliRunner().invoke(cli, [command, "--help"], terminal_width=200).output
    blocks: list[str] = []
    for line in text.split("Options:")[1].splitlines():
        if line.strip().startswith("-"):
            blocks.append(line.strip())
        elif blocks:
            blocks[-1] += " " + line.strip()
    return next(block for block in blocks if block.startswith(flag + " "))


def test_help_shows_each_commands_own_default():
    """fleet runs 4 epochs, train dense SGP: their help says so; simulate keeps the spec's defaults."""
    assert "[default: 4]" in _help_of("fleet", "--epochs")
    assert "[default: 10]" in _help_of("simulate", "--epochs")
    assert "[default: sgp]" in _help_of("train", "--algorithm")
    assert "[default: choco]" in _help_of("fleet", "--algorithm")


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    """A Daemon record around a real, idle process (the table reads its liveness and exit code)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield Daemon(0, "fl-x-p0", tmp_path, tmp_path / "peer-0.log", proc)
    proc.kill()
    proc.wait()


def _snapshot(loss: float, round_: int = 12) -> StatusDocument:
    return status_document(round=round_, epoch=0.4, loss=loss, w=1.0, last_round_s=0.25,
                           neighbours={"fl-x-p1": neighbour_json(bytes_sent=2_000, bytes_received=3_000)})


def test_live_table_shows_dashes_until_reported_then_keeps_known_values(daemon: Daemon):
    before = render_table([daemon], 1.0)
    assert "backend -" in before and "?" not in before and "nan" not in before
    assert table_row(daemon).split()[1:] == ["starting", *["-"] * 9]

    daemon.seen.observe(_snapshot(loss=math.nan, round_=0), now=1.0, elapsed_s=1.0)  # built, no step yet
    row = table_row(daemon).split()
    assert row[2] == "0" and row[4] == "-" and "nan" not in table_row(daemon)

    daemon.seen.observe(_snapshot(loss=0.6931), now=2.0, elapsed_s=2.0)
    assert "0.6931" in table_row(daemon) and "backend fp32" in render_table([daemon], 2.0)
    daemon.seen.observe(_snapshot(loss=math.nan, round_=13), now=3.0, elapsed_s=3.0)
    assert "0.6931" in table_row(daemon)  # a later snapshot without a loss does not bring the dash back


def test_bytes_of_a_forgotten_or_returning_neighbour_still_count(daemon: Daemon):
    """A daemon drops a departed neighbour's link counters from its status, and a returning one starts again at 0:
    the fleet's byte totals keep what those links carried (they never go down)."""
    def snap(links: dict[str, int]) -> StatusDocument:
        return replace(_snapshot(loss=0.5), neighbours={
            p: NeighbourStatus.from_json(neighbour_json(bytes_sent=b, bytes_received=2 * b)) for p, b in links.items()})

    totals = []
    for links in ({"a": 100, "b": 50}, {"a": 300}, {"a": 400, "b": 10}, {"a": 450, "b": 30}):
        daemon.seen.observe(snap(links), now=1.0, elapsed_s=1.0)
        totals.append(daemon.seen.bytes_total("bytes_sent"))
    assert totals == [150, 350, 460, 530]  # b forgotten (its 50 kept), then back from 0 (+10, then +20)
    assert daemon.seen.bytes_total("bytes_received") == 2 * 530


def test_the_summary_names_the_weight_a_daemon_sank_to(daemon: Daemon, tmp_path: Path):
    """w_p5: the push-sum weight a daemon's training snapshots stayed at or above in 95% of them (how far the
    daemons drifted apart); None before any training snapshot."""
    daemon.proc.kill()
    daemon.proc.wait()
    result = CheckpointEval(per_peer=[0.9], averaged=0.91, consensus_distance=0.0, consensus_distance_relative=0.0,
                            backend="fp32")
    assert build_summary(RunSpec(), [daemon], "fl-x", tmp_path, 1.0, False, result)["per_peer"][0]["w_p5"] is None
    for i, w in enumerate([1.0] * 18 + [0.004, 2.5]):  # one sample in 20 at 0.004: 5%, left out
        daemon.seen.observe(replace(_snapshot(loss=0.5, round_=i + 1), w=w), now=float(i), elapsed_s=float(i))
    peer = build_summary(RunSpec(), [daemon], "fl-x", tmp_path, 1.0, False, result)["per_peer"][0]
    assert peer["w_p5"] == 1.0
    daemon.seen.observe(replace(_snapshot(loss=0.5, round_=21), w=0.2), now=21.0, elapsed_s=21.0)
    assert daemon.seen.low_w() == 0.2  # 2 samples in 21 under 1.0: more than 5%


def ended_summary(daemon: Daemon, tmp_path: Path, result: CheckpointEval) -> dict:
    """The summary of a one-daemon fleet that was seen once and has ended, its checkpoints evaluated as ``result``."""
    daemon.seen.observe(_snapshot(loss=0.5), now=1.0, elapsed_s=1.0)
    daemon.proc.kill()
    daemon.proc.wait()
    return build_summary(RunSpec(), [daemon], "fl-x", tmp_path, 12.0, False, result)


def test_summary_names_the_absolute_consensus_distance(daemon: Daemon, tmp_path: Path):
    summary = ended_summary(daemon, tmp_path, CheckpointEval(per_peer=[0.9], averaged=0.91, consensus_distance=0.0123,
                                                             consensus_distance_relative=0.0045, backend="fp32"))
    assert summary["consensus_distance"] == 0.0123 and summary["consensus_distance_relative"] == 0.0045
    text = format_summary(summary)
    assert "consensus distance    0.0123  (mean L2 distance of the peers' models to their average; 0.45% of its " \
           "norm)" in text


def test_checkpoint_evaluation_uses_the_absolute_consensus_distance(tmp_path: Path):
    """Two checkpoints z_1, z_2: mean_i ||z_i - z_bar|| = ||z_1 - z_2|| / 2 (docs/method.md#measurements), not
    relative."""
    import torch

    from peer.daemon.paths import CHECKPOINT_NAME
    from peer.data import load_dataset
    from peer.runtime import state
    from peer.runtime.build import build_peer, build_peer_model

    spec = RunSpec(model=ModelSpec(precision="fp32"), data=DataSpec(dataset="synthetic"))
    splits = load_dataset("synthetic")
    built = build_peer_model(spec.model, splits, torch.device("cpu"))
    z = build_peer(spec, "p", (0, 1), splits, torch.device("cpu"), built).flat.z.detach().clone()
    zs = [z, z + 0.01]
    for i, (zi, w) in enumerate(zip(zs, (1.0, 0.5))):
        peer = build_peer(spec, f"peer-{i}", (i, 2), splits, torch.device("cpu"), built)
        peer.engine.state.x.copy_(zi * w)
        peer.engine.state.w = w
        state.save(peer, tmp_path / f"peer-{i}" / CHECKPOINT_NAME, 1, {}, built.fingerprint)
    result = evaluate_checkpoints(spec, [tmp_path / "peer-0", tmp_path / "peer-1", tmp_path / "peer-2"])
    expected = float((zs[0] - zs[1]).norm()) / 2
    assert result.consensus_distance == pytest.approx(expected, rel=1e-4)
    assert result.consensus_distance_relative == pytest.approx(expected / float((z + 0.005).norm()), rel=1e-4)
    assert result.per_peer[2] is None and all(0.0 <= a <= 1.0 for a in result.per_peer[:2])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_daemon_fleet_trains_gossips_and_summarises(tmp_path: Path):
    """2 fp32 daemons, 1 epoch each (about 60 rounds: on an idle machine 20 rounds ended between two status polls,
    leaving no round counted and no curve sampled): exit 0, summary.json with accuracies, bytes exchanged."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-c", "from peer.cli.main import cli; cli()", "fleet", "--peers", "2", "--precision",
           "fp32", "--epochs", "1", "--eval-every", "5", "--refresh", "5", "--history-every", "1", "--out", str(out)]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "averaged model" in proc.stdout and "consensus distance" in proc.stdout
    assert "nan" not in proc.stdout and "backend ?" not in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ok"] and summary["peers"] == 2
    assert summary["precision"]["backend"] == "fp32"
    assert 0.0 <= summary["averaged_model_acc"] <= 1.0 and 0.0 <= summary["mean_peer_acc"] <= 1.0
    assert summary["consensus_distance"] > 0.0 and summary["consensus_distance_relative"] > 0.0
    for peer in summary["per_peer"]:
        assert peer["exit_code"] == 0
        assert 0.0 <= peer["final_test_acc"] <= 1.0
        assert peer["rounds"] > 0
        assert peer["bytes_sent"] > 0 and peer["bytes_received"] > 0
        assert Path(peer["log"]).exists()
    assert summary["averaged_model_acc"] > 0.3  # far above chance (10%) after ~20 rounds
    # the curves: samples of the running fleet (checkpoints every --eval-every rounds), then the final row
    history = summary["history"]
    assert len(history) >= 2 and history[-1]["averaged_model_acc"] == summary["averaged_model_acc"]
    assert all(h["consensus_distance"] >= 0 and h["peers"] >= 1 for h in history)
    assert [h["round"] for h in history] == sorted(h["round"] for h in history)
    assert history[-2]["mb_sent_per_peer"] > 0
    assert (out / "history.csv").read_text().count("\n") == len(history) + 1
    assert (out / "fleet.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and summary["plot"] == str(out / "fleet.png")
    assert "fleet.png" in proc.stdout
    # forked from the zygote (its log), on the allocator a cold start would have chosen
    assert (out / "zygote.log").exists()
    found = library_for("auto")
    assert {p["memory"]["allocator"] for p in summary["per_peer"]} == {found[0] if found else "glibc"}


def test_a_fleet_whose_passes_ran_eagerly_for_want_of_stored_graphs_is_told_how_to_prepare(daemon: Daemon,
                                                                                          tmp_path: Path):
    """A first int8 run on a host (the store being filled behind it, or a small machine whose store was never
    prepared) ends with the command that compiles the passes once; a run that loaded them does not."""
    from peer.lowp.kinds import STORE_FILLING, STORE_NOT_PREPARED

    summary = ended_summary(daemon, tmp_path, CheckpointEval(per_peer=[0.9], averaged=0.91, consensus_distance=0.01,
                                                             consensus_distance_relative=0.001, backend="int8"))
    for kind, hinted in ((STORE_FILLING, True), (STORE_NOT_PREPARED, True), ("compiled ahead of time", False)):
        summary["precision"] = {"backend": "int8/onednn", "reason": f"int8 on cpu, quantizers {kind}; products ..."}
        assert ("`lpdl-peer prepare`" in format_summary(summary)) is hinted, kind
