"""One whole fleet run: launch N daemons on loopback, watch them, stop them, evaluate and summarise.

Each daemon is a separate ``lpdl-peer start`` process (its own gRPC server, mDNS on 127.0.0.1, state directory and
log file) training on shard i/N of the dataset, forked from one process that imported torch once (a zygote,
peer/fleet/zygote.py: N cold starts at once would each import it). The run ends when every daemon has exited, or
on Ctrl-C / SIGTERM (SIGTERM to every daemon, SIGKILL after ``stop_timeout_s``); then every final checkpoint is
evaluated and ``summary.json`` written into the run directory, with the curves sampled on the way (``history.csv``,
and ``fleet.png`` with the plot extra), and the averaged model exported into ``export/`` (``lpdl-peer export``'s
files and card, in the formats whose packages are installed).
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from peer.config import RunSpec
from peer.daemon.config import DaemonConfig, NodeSpec
from peer.fleet.history import DEFAULT_EVERY_S, History, plot_history
from peer.fleet.launch import FLEET_ENV_DEFAULTS, daemon_command, launch, stop_all, write_daemon_config
from peer.fleet.report import build_summary, evaluate_checkpoints, write_summary
from peer.fleet.watch import LiveTable, watch
from peer.net.config import NetConfig
from peer.plots import PlotUnavailable

#: Epochs of each peer's shard when nothing else says (measured on 2 shared cores, see bench/RESULTS-fleet.md).
DEFAULT_EPOCHS = 4.0
#: Unacknowledged messages per edge before a fleet daemon's round waits for that neighbour (node.max_unacked,
#: peer/daemon/pace.py): N daemons sharing a host's cores drift apart without it. 1, not 4: at 4 the README
#: fleet's rounds still drifted 21 apart around the ring (median, mid-run) and push-sum weights sank to 0.004; at 1,
#: 9 apart and 0.21, int8 dense SGP ended at fp32's accuracy, and int8 reached 90% in 0.77-0.85x fp32's time in
#: 8 pairs of 8 (4: 4 of 8; bench/RESULTS-fleet.md, 2026-12-06).
FLEET_MAX_UNACKED = 1
#: The fleet's own RunSpec defaults (below config file, environment and flags).
FLEET_DEFAULTS = {"optim": {"epochs": DEFAULT_EPOCHS}}
#: The fleet's own [node] defaults (below config file, environment and flags).
FLEET_NODE_DEFAULTS = {"node": {"max_unacked": FLEET_MAX_UNACKED}}
#: Where the averaged model is exported in the run directory.
EXPORT_DIR_NAME = "export"
#: Rounds between a daemon's own test evaluations: one epoch of a peer of the default fleet (1,000 of mnist5k's 4,000
#: training images per peer, 31 steps of 32; one round = one local step with the default --local-steps 1).
DEFAULT_EVAL_EVERY = 31


@dataclass(frozen=True)
class FleetOptions:
    """How to run the fleet (the RunSpec says what each daemon trains).

    Attributes:
        run_dir: state directories, logs and summary.json go here.
        name: fleet name (mDNS); daemons are ``<name>-p<i>``.
        n_peers: number of daemons.
        base_port: daemon i listens on 127.0.0.1:base_port+i; 0 = ephemeral ports.
        threads: torch threads per daemon.
        eval_every: rounds between each daemon's own test evaluations.
        exit_when_done: daemons exit after the spec's epochs; otherwise they run until interrupted.
        node: the [node] settings every daemon starts from (the config file's); the fleet sets the address,
            discovery, fleet name, peer id, shard, state directory, threads and the evaluation cadence itself.
        net: every daemon's transport settings (the config file's [net] table).
        refresh_s: seconds between redraws of the live table.
        poll_s: seconds between status polls of every daemon.
        poll_timeout_s: seconds one status poll waits for a daemon's answer (a busy daemon is skipped that time).
        stop_timeout_s: seconds a daemon gets to stop after SIGTERM before SIGKILL.
        plot: write fleet.png (accuracy and consensus distance over rounds and MB sent; needs matplotlib).
        history_every_s: seconds between two samples of the fleet's curves at least.
        zygote: fork the daemons from one process that imported torch once (peer/fleet/zygote.py); False: start
            each as its own ``lpdl-peer start`` command (N imports at once).
    """

    run_dir: Path
    name: str
    n_peers: int = 4
    base_port: int = 0
    threads: int = 1
    eval_every: int = DEFAULT_EVAL_EVERY
    exit_when_done: bool = True
    node: NodeSpec = field(default_factory=lambda: NodeSpec(max_unacked=FLEET_MAX_UNACKED))
    net: NetConfig = field(default_factory=NetConfig)
    refresh_s: float = 2.0
    poll_s: float = 0.5
    poll_timeout_s: float = 2.0
    stop_timeout_s: float = 30.0
    plot: bool = True
    history_every_s: float = DEFAULT_EVERY_S
    zygote: bool = True


def random_fleet_name() -> str:
    """A fleet name unique per run, so two fleets on one LAN never mix."""
    return f"fleet-{secrets.token_hex(3)}"


def daemon_config(spec: RunSpec, opts: FleetOptions, index: int) -> DaemonConfig:
    """Daemon ``index``'s whole config: exactly ``spec``, loopback gRPC and mDNS, its shard, state directory and
    peer id; no join wait (all daemons start from scratch together) and a checkpoint right after each evaluation,
    which the fleet's history reads."""
    node = dataclasses.replace(
        opts.node, listen=f"127.0.0.1:{opts.base_port + index if opts.base_port else 0}", neighbors=("auto",),
        mdns_ip=("127.0.0.1",), fleet=opts.name, peer_id=f"{opts.name}-p{index}", shard=f"{index}/{opts.n_peers}",
        state_dir=str(opts.run_dir / f"peer-{index}"), threads=opts.threads, eval_every=opts.eval_every,
        checkpoint_every=opts.eval_every, join_wait_s=0.0, exit_when_done=opts.exit_when_done)
    return DaemonConfig(spec, node, opts.net)


#: Where daemon i runs instead of loopback: its config with the addresses rewritten, and an argv prefix that starts
#: it there (a benchmark's network namespaces: ``ip netns exec NS``, bench/netns_fleet.py). The fleet itself still
#: reaches it by its control socket and state directory, which are files.
Placement = Callable[[DaemonConfig, int], tuple[DaemonConfig, list[str]]]


def commands(spec: RunSpec, opts: FleetOptions, place: Placement | None = None) -> list[list[str]]:
    """argv of every daemon of the fleet, each running the config file written for it into the run directory."""
    argvs = []
    for i in range(opts.n_peers):
        config, prefix = (place or _on_loopback)(daemon_config(spec, opts, i), i)
        argvs.append(prefix + daemon_command(write_daemon_config(config, opts.run_dir, i)))
    return argvs


def _on_loopback(config: DaemonConfig, index: int) -> tuple[DaemonConfig, list[str]]:
    return config, []


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def run_fleet(spec: RunSpec, opts: FleetOptions, table: LiveTable | None = None,
              place: Placement | None = None) -> dict[str, Any]:
    """Run the fleet to the end (or to Ctrl-C / SIGTERM) and return the summary written to summary.json.

    The live table and notes go to ``table`` (stdout by default); ``place`` puts the daemons elsewhere than
    loopback (see :data:`Placement`). The caller checks ``summary["ok"]`` and ``summary["interrupted"]``.
    """
    table = table or LiveTable()
    for name, value in FLEET_ENV_DEFAULTS.items():  # the final evaluation in this process too
        os.environ.setdefault(name, value)
    opts.run_dir.mkdir(parents=True, exist_ok=True)
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    started = time.monotonic()
    history = History(opts.history_every_s)
    history.load_in_background()  # beside the zygote's imports, not in the way of the first status polls
    daemons, zygote = launch(commands(spec, opts, place), opts.run_dir, opts.name,
                             allocator=opts.node.allocator if opts.zygote and place is None else None)
    interrupted = False
    try:
        watch(daemons, started, opts.refresh_s, opts.poll_s, opts.poll_timeout_s, table, history)
    except KeyboardInterrupt:
        interrupted = True
        table.note("\ninterrupted: stopping the daemons (SIGTERM)")
    finally:
        for d in stop_all(daemons, opts.stop_timeout_s):
            table.note(f"{d.peer_id} did not stop within {opts.stop_timeout_s:g}s: killed (SIGKILL)")
        if zygote is not None:
            zygote.close()
        signal.signal(signal.SIGTERM, previous)
    wall_s = time.monotonic() - started
    result = evaluate_checkpoints(spec, [d.state_dir for d in daemons])
    summary = build_summary(spec, daemons, opts.name, opts.run_dir, wall_s, interrupted, result)
    history.add_final(summary)
    summary["history"] = history.rows()
    summary["history_csv"] = str(history.write_csv(opts.run_dir / "history.csv"))
    summary["plot"] = None
    if opts.plot:
        g = spec.gossip
        try:
            summary["plot"] = str(plot_history(history.samples, opts.run_dir / "fleet.png",
                                               f"fleet {opts.name}: {opts.n_peers} daemons, {spec.model.name} "
                                               f"{spec.model.precision}, {g.algorithm} c={g.compression}"))
        except PlotUnavailable as exc:
            table.note(str(exc))
    summary["export"] = export_averaged(opts.run_dir, summary["averaged_model_acc"])
    write_summary(summary, opts.run_dir)
    return summary


def export_averaged(run_dir: Path, accuracy: float | None) -> dict[str, Any]:
    """The peers' averaged model exported into ``run_dir/export`` (peer.export, formats whose packages are
    installed): the directory, seconds and each file's bytes, or ``error``: one line. Never raises: the fleet's
    results are written whatever the export does."""
    from peer.export import available_formats, export_model

    try:
        result = export_model(run_dir, run_dir / EXPORT_DIR_NAME, formats=available_formats(), test_acc=accuracy)
    except Exception as exc:  # noqa: BLE001 - an export failure is a line of the summary, not a failed fleet
        return {"error": (str(exc).splitlines() or [type(exc).__name__])[0]}
    return {"dir": str(result.out_dir), "export_s": result.card["export_s"],
            "bytes": {fmt: entry["bytes"] for fmt, entry in result.card["files"].items()},
            "loads_into_source": result.card["state_dict"]["loads_into_source"]}
