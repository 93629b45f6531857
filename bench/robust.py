"""Issue 23: the robust receive rule against insiders, in the simulator
(docs/RESULTS.md#byzantine-robust-gossip-issue-23).

Each run is one :class:`~peer.sim.simulation.Simulation` of 8 peers (MNIST-5k, int8 MNIST CNN, the default recipe
but for the graph, algorithm and skew named) in its own niced subprocess, with 0, 1 or 2 insiders
(peer/sim/attacks.py) at fixed places (peer-003, and peer-006 for the second). It records, for the HONEST peers:
averaged-model and mean per-peer accuracy after the last epoch, the round each insider was quarantined by each of
its out-neighbours (the first such round), and the honest peers wrongly quarantined by any honest peer (must be 0).
"plain" runs are today's recipe without the rule (gossip.robust off), side by side with "clean" (rule on, no
insider): the cost of the rule without an attacker, in accuracy and in wall time per run (same CPU, same load,
interleaved).

    python bench/robust.py run [--jobs 2] [--epochs 3] [--seeds 0] [--only PREFIX ...]   # runs what is missing
    python bench/robust.py table                                                   # the markdown table
    python bench/robust.py receive                                                 # per-message receive cost
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = Path(os.environ.get("LPDL_ROBUST_OUT", "/tmp/lpdl-robust"))
INSIDERS = ("peer-003", "peer-006")
GRAPHS: dict[str, dict[str, Any]] = {"uring": {"topology": "undirected-ring"},
                                     "exp": {"topology": "exponential", "rotating": True},
                                     "ring": {"topology": "ring"}}
ALGOS: dict[str, dict[str, Any]] = {"choco99": {"algorithm": "choco", "compression": 0.99},
                                    "sgp": {"algorithm": "sgp", "compression": 0.0}}
ATTACKS = ("sign_flip", "scale100", "alie", "alie_zmax", "shift", "weight", "huge", "sleeper", "scale10", "noise", "slander")
#: The floor an attacker is measured against: the insiders' devices offline from round 0 (the honest peers gossip
#: among themselves and never see the insiders' data). Under skew a fleet without a device also lacks its classes:
#: no rule can recover what the honest peers' data does not hold.
ABSENT = "absent"
#: The sleeper's own floor: the insider's device honest until the round the sleeper starts attacking, then offline for
#: good (a device that simply leaves then). What the sleeper costs beyond it is the attack's.
LEFT = "left"
#: The gross attacks' own floor: the insiders' devices honest until round 4 - where the receive rule quarantines an
#: insider that sends gross values (rows "sign_flip" ... "noise", "quarantined at round" 3-4) - then offline for good.
#: What such an attack costs beyond it is the attack's and the quarantine's (the schedule kept, its edges skipped).
LEFT_EARLY = "left4"
LEFT_EARLY_ROUND = 4
#: "alie" at the paper's own strength (:func:`~peer.sim.attacks.alie_z_max` for 8 peers and the run's insiders: 0
#: with one, no shift at all; 0.32 with two) beside "alie" at :data:`~peer.sim.attacks.ALIE_Z`.
ALIE_ZMAX = "alie_zmax"


def plan(seeds: list[int], graphs: list[str], algos: list[str], skews: list[float]) -> list[dict[str, Any]]:
    """Every run of the table, in the order they are run: plain and clean of a case side by side, and a case's runs
    for every seed before the next case, so a batch cut short (a time-limited host) leaves whole cases behind."""
    runs = []
    for graph in graphs:
        for algo in algos:
            for skew in skews:
                for seed in seeds:
                    base = {"graph": graph, "algo": algo, "skew": skew, "seed": seed}
                    runs.append({**base, "attack": "plain", "insiders": 0})
                    runs.append({**base, "attack": "clean", "insiders": 0})
                    runs += [{**base, "attack": a, "insiders": n} for n in (1, 2) for a in ATTACKS]
                    runs += [{**base, "attack": ABSENT, "insiders": n} for n in (1, 2)]
                    runs += [{**base, "attack": LEFT, "insiders": n} for n in (1, 2)]
                    runs += [{**base, "attack": LEFT_EARLY, "insiders": n} for n in (1, 2)]
    return runs


def name(run: dict[str, Any]) -> str:
    return f"{run['graph']}-{run['algo']}-s{run['skew']:g}-{run['attack']}{run['insiders']}-seed{run['seed']}"


def one(run: dict[str, Any], epochs: float, device: str = "cpu") -> dict[str, Any]:
    """Run one simulation in this process (its peers' tensors on ``device``); returns its record."""
    import torch

    from peer.config import load_run_spec
    from peer.data import load_dataset
    from peer.sim.attacks import ALIE_Z, Attack, alie_z_max
    from peer.sim.simulation import Simulation

    torch.set_num_threads(1)
    gossip = {**GRAPHS[run["graph"]], **ALGOS[run["algo"]], "robust": run["attack"] != "plain"}
    spec = load_run_spec(flags={"optim": {"epochs": epochs}, "data": {"skew": run["skew"], "seed": run["seed"]},
                                "gossip": gossip})
    insiders = INSIDERS[:run["insiders"]]
    # the round the insiders' devices go offline for good (out of every live set and schedule); None: they stay
    leaves_at = {ABSENT: 0, LEFT: Attack("sleeper").start_round, LEFT_EARLY: LEFT_EARLY_ROUND}.get(run["attack"])
    # a slanderer's false notices name every honest peer (the receivers' quorum rule decides which one they hurt)
    slander = tuple(f"peer-{i:03d}" for i in range(8) if f"peer-{i:03d}" not in insiders) \
        if run["attack"] == "slander" else ()
    kind, z = ("alie", alie_z_max(8, len(insiders))) if run["attack"] == ALIE_ZMAX else (run["attack"], ALIE_Z)
    attacks = {} if leaves_at is not None else {p: Attack(kind, seed=run["seed"], slander=slander, z=z)
                                                for p in insiders}

    def leave(round_index: int) -> None:
        """Called after each round (and before the first, as round -1): the insiders leave before ``leaves_at``."""
        if round_index + 1 == leaves_at:
            for p in insiders:
                sim.transport.offline_until[p] = 2**62

    started = time.perf_counter()
    sim = Simulation(spec, load_dataset("mnist5k"), 8, attacks=attacks, device=device)
    if leaves_at is not None:  # out of the figures from the start
        leave(-1)
        sim.honest = [p for p in sim.ids if p not in insiders]
    rows = sim.run(epochs, on_round=leave)
    wall = time.perf_counter() - started
    quarantined_at: dict[str, int | None] = {}
    wrongly: list[str] = []
    for honest in sim.honest:
        for neighbour, rec in sim.peers[honest].engine.guard.snapshot().items():
            since = rec["quarantined_since"]
            if since is None:
                continue
            if neighbour in attacks:
                prior = quarantined_at.get(neighbour)
                quarantined_at[neighbour] = since if prior is None else min(prior, since)
            else:
                wrongly.append(f"{honest}->{neighbour}")
    last = rows[-1]
    return {**run, "epochs": epochs, "avg_acc": last.avg_model_acc, "peer_acc": last.mean_peer_acc,
            "recoveries": last.recoveries, "quarantined_at": {p: quarantined_at.get(p) for p in attacks},
            "wrongly_quarantined": wrongly, "wall_s": wall, "rounds": sim.round}


def run_missing(runs: list[dict[str, Any]], epochs: float, jobs: int, device: str = "cpu") -> None:
    OUT.mkdir(parents=True, exist_ok=True)

    def go(run: dict[str, Any]) -> None:
        path = OUT / f"{name(run)}.json"
        if path.exists():
            return
        cmd = ["nice", "-n", "10", sys.executable, __file__, "one", json.dumps(run), "--epochs", str(epochs),
               "--device", device]
        path_env = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))
        done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": path_env})
        if done.returncode != 0:
            (OUT / f"{name(run)}.failed").write_text(done.stderr[-4000:])
            print(f"FAILED {name(run)}", flush=True)
            return
        path.write_text(done.stdout.strip().splitlines()[-1])
        print(f"done {name(run)}: {path.read_text()}", flush=True)

    with ThreadPoolExecutor(jobs) as pool:
        list(pool.map(go, runs))


def table() -> str:
    """docs/RESULTS.md's table from the records under OUT: per case, the seeds run, the honest peers' accuracies
    (averaged model / mean per peer, %, means over the seeds), the gap of that mean to the clean runs' and the worst
    seed's gap to its own clean run, the rounds an insider was first quarantined and how many honest peers were
    wrongly quarantined (summed over the seeds)."""
    records = [json.loads(p.read_text()) for p in sorted(OUT.glob("*.json"))]
    cases: dict[tuple[str, str, float], dict[tuple[str, int], list[dict[str, Any]]]] = {}
    for r in records:
        cases.setdefault((r["graph"], r["algo"], r["skew"]), {}).setdefault((r["attack"], r["insiders"]), []).append(r)
    lines = ["| graph | gossip | skew | attack | insiders | seeds | honest avg-model % | honest per-peer % "
             "| vs clean (avg) | worst seed vs its clean | vs absent (avg) | quarantined at round "
             "| wrongly quarantined | wall s |",
             "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
    for (graph, algo, skew), by_attack in sorted(cases.items()):
        clean = by_attack.get(("clean", 0), [])
        clean_avg = _mean([r["avg_acc"] for r in clean]) if clean else None
        order = ([("plain", 0), ("clean", 0), (ABSENT, 1)] + [(a, 1) for a in ATTACKS] + [(LEFT, 1), (LEFT_EARLY, 1)]
                 + [(ABSENT, 2)] + [(a, 2) for a in ATTACKS] + [(LEFT, 2), (LEFT_EARLY, 2)])
        floors = {n: _mean([r["avg_acc"] for r in by_attack[ABSENT, n]]) for n in (1, 2) if (ABSENT, n) in by_attack}
        for key in order:
            rs = by_attack.get(key)
            if not rs:
                continue
            avg = _mean([r["avg_acc"] for r in rs])
            gap = "" if clean_avg is None or key == ("clean", 0) else f"{100 * (avg - clean_avg):+.1f}"
            clean_of = {r["seed"]: r["avg_acc"] for r in clean}
            per_seed = [r["avg_acc"] - clean_of[r["seed"]] for r in rs if r["seed"] in clean_of]
            worst = "" if not per_seed or key == ("clean", 0) else f"{100 * min(per_seed):+.1f}"
            floor = floors.get(key[1]) if key[0] not in (ABSENT, LEFT, LEFT_EARLY) else None
            vs_floor = "" if floor is None else f"{100 * (avg - floor):+.1f}"
            when = sorted({"never" if v is None else str(v) for r in rs for v in r["quarantined_at"].values()}) or ["-"]
            lines.append(f"| {graph} | {algo} | {skew:g} | {key[0]} | {key[1]} | {len(rs)} | {100 * avg:.1f} | "
                         f"{100 * _mean([r['peer_acc'] for r in rs]):.1f} | {gap} | {worst} | {vs_floor} | "
                         f"{', '.join(when)} | "
                         f"{sum(len(r['wrongly_quarantined']) for r in rs)} | {_mean([r['wall_s'] for r in rs]):.0f} |")
    return "\n".join(lines)


def receive_cost(repeats: int = 200) -> str:
    """What the rule costs per received message, the rule on and off side by side in one process (interleaved):
    int8 Choco 99% and dense int8 SGP messages of the MNIST CNN between two engines started from one model. "late":
    the rule at a round from which Choco senders are also judged by their heading (``heading_after``)."""
    import torch

    from peer.compress.codec import CodecConfig
    from peer.compress.layout import Layout
    from peer.gossip.engine import GossipEngine
    from peer.gossip.robust import RobustConfig
    from peer.models.registry import build_model

    torch.set_num_threads(1)
    model = build_model("mnist-cnn", num_classes=10, in_channels=1)
    layout = Layout.from_named_shapes([(n, tuple(p.shape)) for n, p in model.named_parameters()])
    z0 = torch.cat([p.detach().flatten() for p in model.parameters()]).float()
    lines = [f"mnist-cnn, {layout.numel} parameters, {repeats} messages each, one thread"]
    for algorithm, compression, gamma in (("choco", 0.99, 0.05), ("sgp", 0.0, 1.0)):
        timing = {"plain": 0.0, "rule": 0.0, "late": 0.0}
        for _ in range(repeats):
            for contender in timing:
                sender, receiver = (GossipEngine(p, layout, z0 + 1e-3 * torch.randn(layout.numel), algorithm,
                                                 CodecConfig(compression=compression, bits=8), gamma=gamma,
                                                 replica_init=z0, robust=RobustConfig(enabled=contender != "plain"))
                                    for p in ("a", "b"))
                receiver.guard.record_own_move(1.0)
                receiver.guard.record_own_move(1.0)
                if contender == "late":
                    receiver.guard.round = receiver.guard.config.heading_after
                message = sender.send_round(["b"], 0)[0]
                started = time.perf_counter()
                receiver.receive("a", message.seq, message.weight, message.scale, message.payload)
                timing[contender] += time.perf_counter() - started
        plain = timing["plain"]
        lines.append(f"{algorithm} c={compression:g}: receive {1e3 * plain / repeats:.3f} ms plain, "
                     f"{1e3 * timing['rule'] / repeats:.3f} ms with the rule ({timing['rule'] / plain:.2f}x), "
                     f"{1e3 * timing['late'] / repeats:.3f} ms late ({timing['late'] / plain:.2f}x)")
    return "\n".join(lines)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--jobs", type=int, default=2)
    r.add_argument("--epochs", type=float, default=3.0)
    r.add_argument("--seeds", type=int, nargs="+", default=[0])
    r.add_argument("--graphs", nargs="+", default=["uring", "exp"], choices=sorted(GRAPHS))
    r.add_argument("--algos", nargs="+", default=["choco99", "sgp"], choices=sorted(ALGOS))
    r.add_argument("--skews", type=float, nargs="+", default=[0.0, 0.8])
    r.add_argument("--only", nargs="+", default=[""],
                   help="run only the runs whose name starts with one of these (e.g. exp-sgp-s0.8-scale1001-seed)")
    r.add_argument("--device", default="cpu", help="torch device of the simulated peers (cpu, cuda)")
    o = sub.add_parser("one")
    o.add_argument("run")
    o.add_argument("--epochs", type=float, default=3.0)
    o.add_argument("--device", default="cpu")
    sub.add_parser("table")
    sub.add_parser("receive")
    args = parser.parse_args()
    if args.cmd == "one":
        print(json.dumps(one(json.loads(args.run), args.epochs, args.device)))
    elif args.cmd == "run":
        runs = [r for r in plan(args.seeds, args.graphs, args.algos, args.skews)
                if name(r).startswith(tuple(args.only))]
        run_missing(runs, args.epochs, args.jobs, args.device)
    elif args.cmd == "receive":
        print(receive_cost())
    else:
        print(table())


if __name__ == "__main__":
    main()
