"""An 8-peer fleet in network namespaces: how fast mDNS finds everyone, whether one slow link holds the others back,
and what a scripted fault schedule does to push-sum mass, consensus, accuracy and recovery times.

Real daemons through the harness of tests/test_netns_faults.py (tests/fault_fleet.py): one namespace per host on
one bridge, ``lpdl-peer start --neighbors auto`` (real zeroconf mDNS), real gRPC with mutual TLS, nft cuts and
isolation, tc tbf caps, SIGKILL and SIGTERM. Hosts h0..h7 start together; h8 joins late. Phases, each a fresh fleet:

    links-sgp, links-choco   (not run by default) discovery and the 1 Mbit/s link alone, fp32: dense 8-bit SGP
             (the cap binds) or Choco 99%
    lr0      lr = 0, dense fp32 push-sum on the rotating exponential graph, every peer from its own initial model:
             discovery; round time of the uncapped peers with every link free, then with h6 capped (1 Mbit/s; dense
             fp32 updates are 1.7 MB, so the cap binds); the fault schedule with the crash taken quiescent (killed
             once its checkpoint holds its state); then sum x / sum w against the initial mass and the consensus
    lr0-hot  the same with h4 killed while gossiping (mass moved after its last checkpoint is lost or counted twice
             by design, docs/design.md#exactly-once-mass-transfer) - how far off the invariant a real crash leaves
             the fleet
    train    lr > 0, the product's recipe (Choco 99%, directed ring, lr 0.05, --precision as given): discovery, round
             time free / capped, the fault schedule (crash while gossiping, the late joiner pulls the model), then
             training to a round target; accuracy of the averaged model and mean per peer of the final checkpoints
    free     the same recipe, h0..h7, no fault, to the same round target: the accuracy side by side
    bandwidth  (not run by default; its own fleet, not h0..h8) the README fleet - ``lpdl-peer fleet``'s 4 daemons,
             MNIST CNN, --precision, --epochs - with every host-to-host packet crossing ONE shared --rate-mbit link
             (tc tbf on the egress of the bridge namespace turned router, tests/netns.py share_link): Choco 99% and
             dense SGP (8-bit), interleaved (--runs pairs, the order alternating), figured by bench/fleet.py's own
             code: time to 90% of the mean device model (first reached, and held to the end; the fleet's history),
             wall, CPU s, bytes, ratios; the shared link's tc byte and drop counters. --skew (the daemons'
             data.skew; default IID) and --consensus-rounds (gossip.consensus_rounds of the --consensus-cases,
             default Choco only: docs/method.md#the-consensus-phase) set the daemons' config; a second table gives
             time to 90% of the averaged model (every set of the peers' latest checkpoints, hard-linked while the
             fleet runs - one per epoch and peer - and evaluated after it), bytes of training and of the
             consensus phase apart, and the load average at each run's end

Every phase reports: discovery of the full neighbour set (from the last daemon answering its control socket = it
serves and has registered on mDNS, and from the last process start), recovery of the cut edge (heal -> its first
Ack), the crashed peer (restart -> serving -> first round -> first applied update -> first Ack), the late joiner,
and daemon peak RSS (status "memory").

Needs root, iproute2 and nftables. Usage:
    python bench/netns_fleet.py [--phases lr0,lr0-hot,train,free,links-sgp,links-choco] [--precision int8]
        [--hold-s 15] [--net default|fast] [--measure-s 30] [--train-rounds 48]
    python bench/netns_fleet.py --phases bandwidth [--rate-mbit 10] [--epochs 4] [--runs 1] [--precision int8]
        [--skew 0.9] [--consensus-rounds 40] [--consensus-cases choco]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the test harness (tests/) and the checkout's own peer package

from bench.fleet import CASES, BareTorch, comparison_table, figures, seconds_to, seconds_to_hold
from peer.config import RunSpec, load_run_spec
from peer.daemon.config import DaemonConfig
from peer.daemon.paths import CHECKPOINT_NAME
from peer.fleet.mass import fleet_totals
from peer.fleet.report import evaluate_checkpoints
from peer.fleet.run import FLEET_DEFAULTS, FleetOptions, random_fleet_name, run_fleet
from peer.fleet.watch import LiveTable
from peer.lowp.host_record import cache_root
from tests.daemon_helpers import checkpoints_distance, stop_all, z_of
from tests.fault_fleet import (
    CAPPED,
    LEAVER,
    FaultFleet,
    Measured,
    run_schedule,
    run_spec,
    run_until,
    write_distinct_baselines,
)
from tests.netns import NetnsTestbed

N_START, N_HOSTS = 8, 9
#: Daemon defaults (what an operator gets) vs the tests' fast reconnects (tests/daemon_helpers.FAST_NET_ENV + 5 s).
NET = {
    "default": {"LPDL_NET_BACKOFF_BASE_S": "0.5", "LPDL_NET_BACKOFF_MAX_S": "30", "LPDL_NET_CONNECT_TIMEOUT_S": "5",
                "LPDL_NET_ACK_TIMEOUT_S": "30", "LPDL_NET_CLOSE_TIMEOUT_S": "5"},
    "fast": {"LPDL_NET_ACK_TIMEOUT_S": "5.0"},
}


def lr0_spec():
    return run_spec(model={"name": "mnist-cnn", "precision": "fp32"}, data={"dataset": "mnist5k", "batch_size": 16},
                    optim={"lr": 0.0}, gossip={"algorithm": "sgp", "compression": 0.0, "bits": 32,
                                               "topology": "exponential", "rotating": True})


def train_spec(precision: str):
    return run_spec(model={"name": "mnist-cnn", "precision": precision}, data={"dataset": "mnist5k"},
                    optim={"epochs": 1000})


def round_times(fleet: FaultFleet, hosts: list[int], seconds: float, m: Measured, cycles: int = 3) -> None:
    """Round times with every link free and with h6 capped at 1 Mbit/s (nothing else happening), interleaved
    free / capped ``cycles`` times (``seconds`` each in all) so that the machine's load drifting over the minute
    hits both alike: the median over the uncapped peers of each one's median, and h6's own median."""
    samples: dict[str, dict[int, list[float]]] = {"free": {}, "capped": {}}
    for _ in range(cycles):
        for phase in ("free", "capped"):
            if phase == "capped":
                fleet.tb.cap(CAPPED, "1mbit")
            for i, ms in fleet.sample_round_ms(hosts, seconds / cycles).items():
                samples[phase].setdefault(i, []).append(ms)
            fleet.tb.uncap(CAPPED)
    for phase, per_host in samples.items():
        m.round_ms[phase] = statistics.median(statistics.median(v) for i, v in per_host.items() if i != CAPPED)
        m.round_ms[f"h{CAPPED} {phase}"] = statistics.median(per_host.get(CAPPED, [float("nan")]))


def phase_links(root: Path, args: argparse.Namespace, algorithm: str) -> dict[str, Any]:
    """Discovery and the 1 Mbit/s link alone (no other fault), fp32: dense 8-bit SGP (updates of ~420 KB, the cap
    binds) or the default Choco 99% (~100 kbit/s per peer)."""
    m = Measured()
    gossip = {"algorithm": "sgp", "compression": 0.0} if algorithm == "sgp" else {}
    spec = run_spec(model={"name": "mnist-cnn", "precision": "fp32"}, data={"dataset": "mnist5k"},
                    optim={"epochs": 1000}, gossip=gossip)
    with NetnsTestbed(n_hosts=N_START, prefix="lpbf", subnet="10.215.4") as tb:
        fleet = FaultFleet(tb, root, spec, env=NET[args.net], node_args=["--eval-every", "1000000"],
                           join_wait_s={i: 0.0 for i in range(N_START)})
        try:
            fleet.start(range(N_START))
            fleet.wait_discovery(list(range(N_START)), 300, m)
            fleet.wait_full_mesh(list(range(N_START)), 180)
            round_times(fleet, list(range(N_START)), args.measure_s, m)
            fleet.record_rss(m)
            stop_all(fleet.daemons, timeout_s=300)
        finally:
            fleet.close()
    return {"measured": m.as_dict()}


def phase_lr0(root: Path, args: argparse.Namespace, quiescent: bool) -> dict[str, Any]:
    m = Measured()
    out: dict[str, Any] = {}
    with NetnsTestbed(n_hosts=N_HOSTS, prefix="lpbf", subnet="10.215.1") as tb:
        fleet = FaultFleet(tb, root, lr0_spec(), env=NET[args.net],
                           node_args=["--checkpoint-every", "1", "--eval-every", "1000000"])
        try:
            initial = write_distinct_baselines(fleet)
            fleet.start(range(N_START))
            fleet.wait_discovery(list(range(N_START)), 300, m)
            fleet.wait_full_mesh(list(range(N_START)), 180)
            round_times(fleet, list(range(N_START)), args.measure_s, m)
            run_schedule(fleet, m, quiescent_crash=quiescent, hold_s=args.hold_s)
            survivors = fleet.running()
            t0 = time.monotonic()
            while time.monotonic() < t0 + 180:  # consensus after the faults: relative distance 1e-6
                states = [fleet.daemons[i].checkpoint() for i in survivors]
                z_bar_norm = float((sum(z_of(s) for s in states) / len(states)).norm())
                if checkpoints_distance(states) < 1e-6 * z_bar_norm:
                    break
                time.sleep(1.0)
            out["to_consensus_s"] = time.monotonic() - t0
            stop_all([fleet.daemons[i] for i in survivors], timeout_s=300)
            final = [d.checkpoint() for d in fleet.daemons]
        finally:
            fleet.close()
    totals = fleet_totals(final)
    x0 = sum(s["engine"]["x"].double() for s in initial)
    held = [final[i] for i in range(N_HOSTS) if i != LEAVER]
    z_star = sum(s["engine"]["x"].double() for s in held) / sum(float(s["engine"]["w"]) for s in held)
    out.update({
        "measured": m.as_dict(),
        "sum_w": totals.w, "sum_w_initial": float(N_HOSTS),
        "sum_x_max_abs_error": (totals.x - x0).abs().max().item(), "sum_x_max_abs_initial": x0.abs().max().item(),
        "sum_x_rel_l2_error": ((totals.x - x0).norm() / x0.norm()).item(),
        "in_flight_at_end": len(totals.unsettled),
        "consensus_max_rel": max((z_of(s) - z_star).norm().item() for s in held) / z_star.norm().item(),
    })
    return out


def phase_train(root: Path, args: argparse.Namespace, faults: bool, target: int | None) -> dict[str, Any]:
    m = Measured()
    n_hosts = N_HOSTS if faults else N_START
    spec = train_spec(args.precision)
    with NetnsTestbed(n_hosts=n_hosts, prefix="lpbf", subnet="10.215.2" if faults else "10.215.3") as tb:
        late = {N_START: (LEAVER, N_START)} if faults else {}
        fleet = FaultFleet(tb, root, spec, env=NET[args.net],
                           node_args=["--checkpoint-every", "10", "--eval-every", "1000000"],
                           shards={i: (i, N_START) for i in range(N_START)} | late,
                           join_wait_s={i: 0.0 for i in range(N_START)} | {N_START: 60.0})
        try:
            fleet.start(range(N_START))
            fleet.wait_discovery(list(range(N_START)), 300, m)
            fleet.wait_full_mesh(list(range(N_START)), 180)
            round_times(fleet, list(range(N_START)), args.measure_s, m)
            if faults:
                run_until(fleet, range(N_START), args.train_rounds, 300)
                run_schedule(fleet, m, quiescent_crash=False, hold_s=args.hold_s)
                originals = [i for i in fleet.running() if i != N_START]
                target = max(d["round"] for d in fleet.statuses(originals).values() if d) + args.train_rounds
            else:
                originals = list(range(N_START))
            assert target is not None
            run_until(fleet, originals, target, 900)
            fleet.record_rss(m)
            hosts = fleet.running()
            # int8 daemons evaluate once more on SIGTERM (new batch shapes: kernel plans) - slow on a loaded machine
            stop_all([fleet.daemons[i] for i in hosts], timeout_s=300)
        finally:
            fleet.close()
    result = evaluate_checkpoints(spec, [fleet.daemons[i].state_dir for i in hosts])
    accs = [a for a in result.per_peer if a is not None]
    return {"measured": m.as_dict(), "target_round": target, "averaged_model_acc": result.averaged,
            "mean_peer_acc": sum(accs) / len(accs), "consensus_distance": result.consensus_distance,
            "backend": result.backend}


class CheckpointSnapshots(threading.Thread):
    """Every set of the fleet's latest checkpoints while it runs, for the averaged model's accuracy over time.

    The fleet checkpoints each daemon right after its own evaluation (once per epoch of its shard) and its history
    reads only the peers' own accuracies; the averaged model is evaluated once, at the end. This thread polls the
    state directories every ``every_s`` seconds and, whenever some peer's ``checkpoint.pt`` is a new file (writes
    are a rename, so a new inode) and every peer has one, hard-links all of them into ``into/<k>/<state dir
    name>/`` - no copy, no evaluation while the fleet runs (the 2-core machine is the fleet's) - with the seconds
    since ``started``. :func:`averaged_history` evaluates them afterwards."""

    def __init__(self, state_dirs: list[Path], into: Path, started: float, every_s: float = 1.0) -> None:
        super().__init__(daemon=True)
        self.state_dirs, self.into, self.started, self.every_s = state_dirs, into, started, every_s
        self.taken: list[tuple[float, Path]] = []
        self._inodes: list[int] = []
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.wait(self.every_s):
            self.poll()

    def stop(self) -> None:
        self._halt.set()
        self.join()

    def poll(self) -> None:
        """Take a snapshot if every peer has a checkpoint and one of them is new since the last snapshot."""
        try:
            inodes = [(d / CHECKPOINT_NAME).stat().st_ino for d in self.state_dirs]
        except FileNotFoundError:  # none yet, or a write is swapping the files: the next poll
            return
        if inodes == self._inodes:
            return
        elapsed = time.monotonic() - self.started
        snap = self.into / f"{len(self.taken):03d}"
        try:
            for d in self.state_dirs:
                (snap / d.name).mkdir(parents=True)
                os.link(d / CHECKPOINT_NAME, snap / d.name / CHECKPOINT_NAME)
        except FileNotFoundError:
            shutil.rmtree(snap)
            return
        self._inodes = inodes
        self.taken.append((elapsed, snap))


def averaged_history(spec: RunSpec, snapshots: CheckpointSnapshots, summary: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows (``elapsed_s``, ``averaged_model_acc`` in [0, 1]) of each snapshot's averaged model (the fleet's own
    evaluation, peer/fleet/report.py), then the final checkpoints' (the summary's, at its wall time); the snapshots
    are removed once evaluated."""
    rows = []
    for elapsed, snap in snapshots.taken:
        result = evaluate_checkpoints(spec, [snap / d.name for d in snapshots.state_dirs])
        rows.append({"elapsed_s": elapsed, "averaged_model_acc": result.averaged})
    shutil.rmtree(snapshots.into, ignore_errors=True)
    return rows + [{"elapsed_s": summary["wall_s"], "averaged_model_acc": summary["averaged_model_acc"]}]


def fleet_spec(case: str, args: argparse.Namespace) -> RunSpec:
    """The README fleet's spec for ``case`` with the bench's --precision, --epochs, --skew and consensus phase."""
    algorithm, compression = CASES[case][1], float(CASES[case][3])
    gossip: dict[str, Any] = {"algorithm": algorithm, "compression": compression}
    if case in args.consensus_cases.split(","):
        gossip["consensus_rounds"] = args.consensus_rounds
    flags: dict[str, Any] = {"gossip": gossip, "model": {"precision": args.precision},
                             "optim": {"epochs": args.epochs}}
    if args.skew is not None:
        flags["data"] = {"skew": args.skew}
    return load_run_spec(flags=flags, environ={}, defaults=FLEET_DEFAULTS)


def readme_fleet_in_namespaces(run_dir: Path, case: str, args: argparse.Namespace) -> dict[str, Any]:
    """One README fleet (``lpdl-peer fleet``'s run: 4 daemons, shard i/4, mDNS, mutual TLS, history every 2 s),
    daemon i in namespace host i, every packet between hosts through the one shared --rate-mbit link; the
    summary.json with ``cpu_s`` = CPU seconds of the daemons and of this process's watcher and final evaluation,
    ``averaged_history`` (:func:`averaged_history`) and ``load_average`` (1, 5, 15 min) at the fleet's end."""
    spec = fleet_spec(case, args)
    opts = FleetOptions(run_dir=run_dir, name=random_fleet_name(), n_peers=args.peers, refresh_s=30.0,
                        history_every_s=2.0, plot=False)
    run_dir.mkdir(parents=True)
    with NetnsTestbed(n_hosts=args.peers, prefix="lpbw", subnet="10.215.5") as tb:
        router = tb.share_link(f"{args.rate_mbit:g}mbit")

        def in_namespace(config: DaemonConfig, index: int) -> tuple[DaemonConfig, list[str]]:
            node = dataclasses.replace(config.node, listen=f"{tb.ip(index)}:0", mdns_ip=(tb.ip(index),))
            return dataclasses.replace(config, node=node), tb.argv(index, [])

        print(f"  {case}: {args.peers} daemons in {tb.tag}-h*, one {args.rate_mbit:g} Mbit/s link (tbf on br0 of "
              f"{tb.bridge_ns}, router {router}); skew {spec.data.skew:g}, consensus rounds "
              f"{spec.gossip.consensus_rounds}; run directory {run_dir}", flush=True)
        record = cache_root()
        warm = record is not None and any(record.glob("probes/*/*.json"))
        before = [resource.getrusage(who) for who in (resource.RUSAGE_CHILDREN, resource.RUSAGE_SELF)]
        snapshots = CheckpointSnapshots([run_dir / f"peer-{i}" for i in range(args.peers)],
                                        run_dir / "averaged-snapshots", time.monotonic())
        snapshots.start()
        try:
            with (run_dir / "fleet.out").open("w") as out:
                summary = run_fleet(spec, opts, LiveTable(out), place=in_namespace)
        finally:
            snapshots.stop()
        after = [resource.getrusage(who) for who in (resource.RUSAGE_CHILDREN, resource.RUSAGE_SELF)]
        summary["load_average"] = os.getloadavg()
        shaped = _sh_out(["tc", "-s", "-n", tb.bridge_ns, "qdisc", "show", "dev", "br0"])
    if not summary["ok"]:
        sys.exit(f"the {case} fleet failed: see {run_dir}/peer-<i>.log")
    summary["cpu_s"] = sum((a.ru_utime + a.ru_stime) - (b.ru_utime + b.ru_stime) for a, b in zip(after, before))
    summary["shaper"] = shaped
    summary["probe_record"] = "warm" if warm else "cold"  # the host's int8 probe record (bench/fleet.py)
    summary["averaged_history"] = averaged_history(spec, snapshots, summary)
    return summary


def averaged_figures(summary: dict[str, Any]) -> dict[str, Any]:
    """The bandwidth phase's figures beyond bench/fleet.py's: time to 90% of the averaged model (first reached,
    held to the end; s), the best sample of it and of the mean device model, MB sent training and in the
    consensus phase (all peers), the phase's most rounds, and the load average at the fleet's end."""
    rows = summary["averaged_history"]
    phases = [p.get("consensus") or {} for p in summary["per_peer"]]
    consensus_b = sum(c.get("bytes_sent", 0) for c in phases)
    return {
        "t90_averaged_s": seconds_to(rows, "averaged_model_acc", 0.9),
        "t90_averaged_held_s": seconds_to_hold(rows, "averaged_model_acc", 0.9),
        "averaged_max": max((r["averaged_model_acc"] for r in rows if r["averaged_model_acc"] is not None),
                            default=None),
        "averaged_history": rows,
        "device_max": max((h["mean_peer_acc"] for h in summary["history"] if h["mean_peer_acc"] is not None),
                          default=None),
        "training_mb": (sum(p["bytes_sent"] for p in summary["per_peer"]) - consensus_b) / 1e6,
        "consensus_mb": consensus_b / 1e6,
        "consensus_rounds": max((c.get("rounds", 0) for c in phases), default=0),
        "load_average": summary["load_average"],
    }


def averaged_table(rows: list[tuple[str, str, dict[str, Any]]]) -> str:
    """Markdown: per run and case, time to 90% of the averaged model and of the mean device model (first, held),
    the final accuracies, training / consensus MB and wall ("- (max X%)": never reached, the best sample); then
    choco / sgp of the same run."""
    def opt(x: float | None) -> str:
        return "-" if x is None else f"{x:.1f}"

    def ratio(a: float | None, b: float | None) -> str:
        return "-" if a is None or b is None or not b else f"{a / b:.2f}x"

    def first(t: float | None, best: float | None) -> str:
        return opt(t) if t is not None or best is None else f"- (max {best * 100:.1f}%)"

    lines = ["| run | case | t90 averaged s | held from s | t90 device s | held from s | final mean device | final "
             "averaged | MB training | MB consensus (rounds) | wall s | load avg at end |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for run, case, f in rows:
        a = f["averaged"]
        lines.append(f"| {run} | {case} | {first(a['t90_averaged_s'], a['averaged_max'])} | "
                     f"{opt(a['t90_averaged_held_s'])} | {first(f['t90_device_s'], a['device_max'])} | "
                     f"{opt(f['t90_device_held_s'])} | {f['mean_peer_acc'] * 100:.2f}% | "
                     f"{f['averaged_model_acc'] * 100:.2f}% | {a['training_mb']:.1f} | {a['consensus_mb']:.1f} "
                     f"({a['consensus_rounds']}) | {f['wall_s']:.1f} | "
                     f"{' '.join(f'{x:.1f}' for x in a['load_average'])} |")
    by = {(run, case.split("-")[0]): f for run, case, f in rows}
    for run, algorithm in by:
        if algorithm != "choco" or (run, "sgp") not in by:
            continue
        c, g = by[run, "choco"], by[run, "sgp"]
        ca, ga = c["averaged"], g["averaged"]
        lines.append(f"| {run}: choco / sgp | | {ratio(ca['t90_averaged_s'], ga['t90_averaged_s'])} | "
                     f"{ratio(ca['t90_averaged_held_s'], ga['t90_averaged_held_s'])} | "
                     f"{ratio(c['t90_device_s'], g['t90_device_s'])} | "
                     f"{ratio(c['t90_device_held_s'], g['t90_device_held_s'])} | | | "
                     f"{ratio(ca['training_mb'], ga['training_mb'])} | "
                     f"all bytes {ratio(c['bytes_sent_mb'], g['bytes_sent_mb'])} | "
                     f"{ratio(c['wall_s'], g['wall_s'])} | |")
    return "\n".join(lines)


def _sh_out(argv: list[str]) -> str:
    return subprocess.run(argv, check=False, capture_output=True, text=True).stdout


def phase_bandwidth(root: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The README fleet's two cases under one shared link, interleaved run by run (the order alternating), and
    bench/fleet.py's comparison table of them: time to 90% of the mean device model, wall, CPU, bytes, ratios."""
    bare = BareTorch()
    bare.peak_mib("glibc")
    rows: list[tuple[str, str, dict[str, Any]]] = []
    shapers: dict[str, str] = {}
    for run in range(1, args.runs + 1):
        order = ["choco", "sgp"] if run % 2 else ["sgp", "choco"]
        for case in order:
            summary = readme_fleet_in_namespaces(root / f"run{run}" / case, case, args)
            rows.append((f"run{run}", f"{case}-{args.precision}",
                         figures(summary, bare) | {"averaged": averaged_figures(summary)}))
            shapers[f"run{run} {case}"] = summary["shaper"]
    return {"rows": rows, "shaper": shapers, "load_average": os.getloadavg()}


def show_bandwidth(r: dict[str, Any], args: argparse.Namespace) -> None:
    print(f"\n== bandwidth: the README fleet, every host-to-host packet through one {args.rate_mbit:g} Mbit/s link "
          f"(load average at the end {r['load_average']})")
    print(comparison_table(r["rows"]))
    print(f"\nskew {args.skew if args.skew is not None else 'default (IID)'}, consensus phase: at most "
          f"{args.consensus_rounds} rounds for {args.consensus_cases if args.consensus_rounds else 'no case'}; time to "
          f"90% of the averaged model from the peers' checkpoints (one per epoch and peer) and the final evaluation")
    print(averaged_table(r["rows"]))
    for name, text in r["shaper"].items():
        sent = next((line.strip() for line in text.splitlines() if line.strip().startswith("Sent")), "?")
        print(f"shared link, {name}: {sent}")


def show(name: str, r: dict[str, Any]) -> None:
    m = r["measured"]
    rss = list(m["rss_peak_mib"].values())

    def s(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f} s"

    print(f"\n== {name}")
    print(f"discovery of all {N_START - 1} others: {s(m['discovery_after_last_serving_s'])} after the last daemon "
          f"served, {s(m['discovery_after_last_start_s'])} after the last process start")
    rt = m["round_ms"]
    if rt:
        print(f"round time of the uncapped peers (median of medians): {rt['free']:.0f} ms free, {rt['capped']:.0f} "
              f"ms with h{CAPPED} at 1 Mbit/s ({rt['capped'] / rt['free']:.2f}x); h{CAPPED} itself "
              f"{rt[f'h{CAPPED} free']:.0f} -> {rt[f'h{CAPPED} capped']:.0f} ms")
    if m["cut_recovery_s"] is not None or m["crash_restart_to_serving_s"] is not None:
        print(f"cut edge: noticed {s(m['cut_noticed_s'])} after the cut, first Ack {s(m['cut_recovery_s'])} after "
              f"the heal")
        print(f"SIGKILL at round {m['crash_round_at_kill']}, restored round {m['crash_restored_round']}: restart -> "
              f"serving {s(m['crash_restart_to_serving_s'])}, first round {s(m['crash_restart_to_round_s'])}, first "
              f"applied update {s(m['crash_restart_to_applied_s'])}, first Ack {s(m['crash_restart_to_acked_s'])}")
        print(f"late joiner: serving {s(m['join_start_to_serving_s'])}, seen by all "
              f"{s(m['join_start_to_seen_by_all_s'])} after its start")
    if rss:
        print(f"daemon peak RSS: median {statistics.median(rss):.0f} MiB, max {max(rss):.0f} MiB ({len(rss)} daemons)")
    if "to_consensus_s" in r:
        print(f"relative consensus distance < 1e-6 {r['to_consensus_s']:.1f} s after the full mesh was back "
              f"(checkpoints polled every 1 s)")
    if "sum_w" in r:
        print(f"conservation: sum w {r['sum_w']:.12f} (initial {r['sum_w_initial']:g}), sum x max |error| "
              f"{r['sum_x_max_abs_error']:.3g} (max |initial| {r['sum_x_max_abs_initial']:.3g}), relative L2 "
              f"{r['sum_x_rel_l2_error']:.3g}; consensus max ||z_i - z*|| / ||z*|| {r['consensus_max_rel']:.3g}")
    if "averaged_model_acc" in r:
        print(f"after round {r['target_round']}: averaged model {r['averaged_model_acc'] * 100:.2f}%, mean per peer "
              f"{r['mean_peer_acc'] * 100:.2f}%, consensus distance {r['consensus_distance']:.4g} ({r['backend']})")
    for note in m["notes"]:
        print(f"note: {note}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phases", default="lr0,lr0-hot,train,free")
    parser.add_argument("--precision", default="int8", help="precision of the train / free phases")
    parser.add_argument("--hold-s", type=float, default=15.0, help="seconds the cut and the isolation last")
    parser.add_argument("--net", choices=sorted(NET), default="default",
                        help="daemon transport timeouts: the daemon's defaults, or the tests' fast ones")
    parser.add_argument("--measure-s", type=float, default=30.0,
                        help="seconds of round-time samples, each of free and capped (interleaved in 3 parts)")
    parser.add_argument("--train-rounds", type=int, default=48,
                        help="rounds trained before the faults and after them (16 = one epoch of a peer's shard)")
    parser.add_argument("--rate-mbit", type=float, default=10.0, help="bandwidth phase: the shared link's rate")
    parser.add_argument("--epochs", type=float, default=FLEET_DEFAULTS["optim"]["epochs"],
                        help="bandwidth phase: epochs of each peer's shard")
    parser.add_argument("--peers", type=int, default=4, help="bandwidth phase: daemons")
    parser.add_argument("--runs", type=int, default=1, help="bandwidth phase: Choco / SGP pairs run")
    parser.add_argument("--skew", type=float, default=None,
                        help="bandwidth phase: the daemons' data.skew, non-IID degree in [0, 1] [the fleet's default]")
    parser.add_argument("--consensus-rounds", type=int, default=0,
                        help="bandwidth phase: gossip.consensus_rounds, the final consensus phase's most rounds "
                        "(0: none), for the --consensus-cases")
    parser.add_argument("--consensus-cases", default="choco",
                        help="bandwidth phase: comma-separated cases the consensus phase runs for (dense SGP mixes "
                        "its whole model every round; pass choco,sgp to give it the phase too)")
    parser.add_argument("--json", default=None, help="also write every figure to this file")
    args = parser.parse_args()
    unknown = set(args.consensus_cases.split(",")) - set(CASES)
    if unknown:
        sys.exit(f"--consensus-cases: unknown case(s) {sorted(unknown)}; expected a subset of {','.join(CASES)}")
    if os.geteuid() != 0:
        sys.exit("bench/netns_fleet.py needs root (network namespaces)")
    root = Path(tempfile.mkdtemp(prefix="lpdl-netns-bench-"))
    phases = args.phases.split(",")
    print(f"{len(phases)} phase(s), net settings {args.net}, hold {args.hold_s:g} s; logs and state under {root}")
    results: dict[str, Any] = {}
    for name in phases:
        started = time.monotonic()
        if name == "bandwidth":
            results[name] = phase_bandwidth(root / name, args)
            show_bandwidth(results[name], args)
            continue
        if name in ("links-sgp", "links-choco"):
            results[name] = phase_links(root / name, args, name.split("-")[1])
        elif name in ("lr0", "lr0-hot"):
            results[name] = phase_lr0(root / name, args, quiescent=name == "lr0")
        elif name == "train":
            results[name] = phase_train(root / name, args, faults=True, target=None)
        elif name == "free":
            target = results.get("train", {}).get("target_round") or 3 * args.train_rounds
            results[name] = phase_train(root / name, args, faults=False, target=target)
        else:
            sys.exit(f"unknown phase {name!r}")
        results[name]["wall_s"] = time.monotonic() - started
        show(f"{name} ({results[name]['wall_s']:.0f} s)", results[name])
    if "train" in results and "free" in results:
        t, f = results["train"], results["free"]
        print(f"\naccuracy with faults vs without, round {t['target_round']}: averaged model "
              f"{t['averaged_model_acc'] * 100:.2f}% vs {f['averaged_model_acc'] * 100:.2f}% "
              f"({(t['averaged_model_acc'] - f['averaged_model_acc']) * 100:+.2f} points), mean per peer "
              f"{t['mean_peer_acc'] * 100:.2f}% vs {f['mean_peer_acc'] * 100:.2f}%")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()
