"""The README fleet, measured: round time, bytes per round, accuracy and daemon memory, side by side in one run.

Runs ``lpdl-peer fleet`` (the README's default config unless flags say otherwise) for each case - Choco with 99%
top-k compression, and dense SGP (--algorithm sgp --compression 0) - and for each checkout given with --checkout
(before/after comparisons: another git worktree of this repository, run with the same interpreter), interleaved
case by case so machine drift hits every contender alike. Figures come from each run's summary.json, which the fleet
fills from the daemons' status snapshots (polled every 0.5 s) and /proc/<pid>/status:

    w p5           the lowest over the daemons of the push-sum weight each stayed at or above in 95% of its
                   training snapshots (1 on average: near 0, a daemon's own steps were washed out as the daemons
                   drifted apart; peer/daemon/pace.py)
    ms/round       median over peers of each peer's median last_round_s (one local step + gossip; rounds that
                   also evaluate or checkpoint are included when sampled)
    B/round        median over peers of bytes sent per round over the second half of training (steady state: the
                   one-off model pull of a joining peer is left out); "all" = total bytes sent / rounds
    peak RSS       VmHWM of the largest daemon (MiB), last read while it was alive
    over torch     peak RSS minus the peak RSS of a bare ``import torch`` in the same interpreter on the same malloc
                   the daemons ran on (their status names it: tcmalloc where installed; MiB): what the daemon
                   itself costs
    t90 device     seconds from the fleet's start until the mean of the daemons' own latest test accuracies first
                   reached 90%, once every daemon has evaluated (each evaluation at the moment the fleet's 0.5 s
                   status poll saw it, not on history.csv's coarser grid; "-": never)
    held           the same, from which on it stayed >= 90% to the end (the last row: the final checkpoints'
                   evaluation; "-": it ended below) - a fleet whose devices reach 90% and then lose it does not count
    CPU s          CPU seconds of the whole fleet run (daemons, the fleet's watcher and its final evaluation):
                   getrusage(RUSAGE_CHILDREN) around the run
    probe record   int8 runs: whether the host's record of the int8 probes' verdicts (peer/lowp/host_record.py) was
                   empty when the run started ("cold": the daemons probed, one per verdict, the others waiting) or
                   held them ("warm": every daemon read them). The bench keeps its own record in OUT/probe-record:
                   with --probe-record fresh (default) the first int8 run is cold and the rest warm; with cold it is
                   emptied before every run. int8aot / int8bg runs are warm only if, besides, no daemon compiled or
                   queued a pass graph (every graph was in the store). An int8bg run's background compile goes on
                   after it (at idle priority): the bench waits for it before the next run, so that it does not
                   share the cores with another contender
    consensus      (--consensus-rounds N) bytes the daemons sent during their consensus phases, as a multiple
                   of the bytes they sent training, and the phase's rounds (docs/method.md#the-consensus-phase)
    memory stages  (checkouts whose daemons report them) RSS added by each start-up stage of the largest daemon:
                   imports (torch + gRPC + zeroconf), dataset, model (+ int8 probe), peer (copy, optimizer,
                   loader), network (server, channels, mDNS), training (after the latest evaluation); gossip state
                   = the algorithm's tensors (Choco's replicas)
    start-up       (checkouts whose daemons report them) seconds each start-up stage took, median over the
                   daemons (imports: from the process's start): the fleet's first round waits for them

Usage: python bench/fleet.py [--peers 4] [--epochs E] [--checkout before=/path/to/old/worktree]
       [--cases choco,sgp,choco-plain]
       [--precisions int8,int8compiled,int8aot,int8bg,fp32] [--skew 0.9] [--consensus-rounds 40]
       [--consensus-tolerance 0.02] [--repeats 2]
       [--probe-record fresh|cold] [--record DIR] [--prepare]

--prepare runs ``lpdl-peer prepare`` (each checkout's, with the fleet's model flags) into the record before the
first run and prints its seconds: the int8 fleets then start on a host prepared at install, none of them cold.

The ratio rows compare int8 with fp32 at the same case (checkout) and choco with sgp at the same precision: the
machine is shared, so only ratios of contenders run in one invocation mean anything.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled
from peer.daemon.allocator import ALLOCATOR_LIBRARIES, find_library  # noqa: E402  (no torch: a light module)
from peer.lowp.aot_queue import try_filler_lock  # noqa: E402  (no torch either)

#: case name -> extra fleet flags
CASES: dict[str, list[str]] = {
    "choco": ["--algorithm", "choco", "--compression", "0.99"],
    "sgp": ["--algorithm", "sgp", "--compression", "0"],
}
#: "<case>-plain": the same case with the robust receive rule off (``gossip.robust = false``, through a config file
#: the bench writes): the rule's cost where no insider attacks, in the README fleet (issue 23)
PLAIN_SUFFIX = "-plain"
#: The int8 contender with compiled quantization passes (a local fleet runs them eager unless told otherwise).
COMPILED = "int8compiled"
#: The int8 contender with the passes compiled ahead of time and loaded from the host's store (peer/lowp/aot_graphs.py)
AOT = "int8aot"
#: The int8 contender the fleet runs by default: the store's graphs, and eager passes for those a background process
#: has not compiled yet (peer/lowp/aot_queue.py). "int8" is the eager passes.
BACKGROUND = "int8bg"
#: The daemon log lines of a pass graph compiled into the store, and of graphs queued for the background compile (a
#: run whose daemons logged either did not find every graph stored).
AOT_COMPILED = "pass graph compiled ahead of time"
AOT_QUEUED = "pass graphs not stored yet run eagerly"
#: --precision each contender runs with, and the environment it adds.
PRECISION_FLAG = {"int8": "int8", COMPILED: "int8", AOT: "int8", BACKGROUND: "int8", "fp32": "fp32"}
PRECISION_ENV = {"int8": {"LPDL_LOWP_EAGER": "1", "LPDL_LOWP_AOT": "0"},
                 COMPILED: {"LPDL_LOWP_EAGER": "0", "LPDL_LOWP_AOT": "0"},
                 AOT: {"LPDL_LOWP_EAGER": "0", "LPDL_LOWP_AOT": "1"},
                 BACKGROUND: {"LPDL_LOWP_EAGER": "0", "LPDL_LOWP_AOT": "background"}}
THIS_CHECKOUT = Path(__file__).resolve().parents[1]
_BARE_TORCH = ("import torch\nfor line in open('/proc/self/status'):\n"
               "    if line.startswith('VmHWM:'): print(int(line.split()[1]) / 1024)")


def case_flags(case: str, robust_off: Path) -> list[str]:
    """The fleet flags of ``case``: a CASES entry, or one with :data:`PLAIN_SUFFIX` (the config file ``robust_off``
    turns the robust receive rule off)."""
    if case.endswith(PLAIN_SUFFIX):
        return CASES[case.removesuffix(PLAIN_SUFFIX)] + ["--config", str(robust_off)]
    return CASES[case]


def checkout_env(checkout: Path) -> dict[str, str]:
    """Environment that makes ``python -c 'import peer'`` load ``checkout``'s code (daemons inherit it)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(checkout), env.get("PYTHONPATH", "")]))
    return env


class BareTorch:
    """Peak RSS of a process that only imports torch (MiB), the floor every daemon stands on - measured once per
    malloc, under the one the daemons ran on (the same import peaks ~7 MiB higher on tcmalloc than on glibc)."""

    def __init__(self) -> None:
        self.peaks: dict[str, float] = {}

    def peak_mib(self, allocator: str = "glibc") -> float:
        if allocator not in self.peaks:
            env = dict(os.environ)
            library = find_library(ALLOCATOR_LIBRARIES[allocator]) if allocator in ALLOCATOR_LIBRARIES else None
            if library:
                env["LD_PRELOAD"] = library
            out = subprocess.run([sys.executable, "-c", _BARE_TORCH], check=True, capture_output=True, text=True,
                                 env=env)
            self.peaks[allocator] = float(out.stdout.strip() or "nan")
        return self.peaks[allocator]

    def describe(self) -> str:
        return ", ".join(f"{name} {mib:.0f} MiB" for name, mib in self.peaks.items())


def wait_for_background_compile(record: Path, timeout_s: float = 1800.0) -> float:
    """Seconds spent waiting until no background compile of pass graphs works on a store under ``record``
    (peer/lowp/aot_queue.py: its filler holds the store's lock while it works): it must not share the cores with
    the next contender's run."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        busy = False
        for store in record.glob("aot-graphs/*"):
            fd = try_filler_lock(store)
            if fd is None:
                busy = True
            else:
                os.close(fd)
        if not busy:
            return time.monotonic() - started
        time.sleep(1.0)
    print(f"background compile still busy after {timeout_s:.0f} s: going on", file=sys.stderr)
    return time.monotonic() - started


def prepare_record(checkout: Path, record: Path, flags: list[str]) -> float:
    """Seconds ``lpdl-peer prepare`` of ``checkout`` took to compile the int8 pass graphs of a fleet run with
    ``flags`` into ``record`` (raises if it failed)."""
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", "from peer.cli.main import cli; cli()", "prepare", *flags],
                          cwd=checkout, capture_output=True, text=True,
                          env={**checkout_env(checkout), "LPDL_CACHE_DIR": str(record), **PRECISION_ENV[BACKGROUND]})
    if done.returncode != 0:
        raise RuntimeError(f"lpdl-peer prepare of {checkout} failed: {done.stderr[-2000:]}")
    print(done.stdout.strip(), flush=True)
    return time.monotonic() - started


def run_fleet(checkout: Path, out: Path, peers: int, extra: list[str], record: Path,
              env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run one fleet of ``checkout``'s code to completion and return its summary.json (raises if it failed), with
    the run's CPU seconds added (``cpu_s``: every process the fleet started, reaped by the time it returns) and
    whether the int8 probe record ``record`` held verdicts when it started (``probe_record``: cold / warm; for
    ahead-of-time passes, also no daemon compiled a pass graph).
    ``env``: variables the fleet's daemons get besides the checkout's (a precision contender's)."""
    cmd = [sys.executable, "-c", "from peer.cli.main import cli; cli()", "fleet", "--peers", str(peers),
           "--out", str(out), "--refresh", "30", "--history-every", "2", *extra]
    warm = any(record.glob("probes/*/*.json"))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=checkout,
                   env={**checkout_env(checkout), "LPDL_CACHE_DIR": str(record), **(env or {})})
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
    summary["cpu_s"] = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    if (env or {}).get("LPDL_LOWP_AOT") in ("1", "background"):  # and every daemon found every graph stored
        warm = warm and not any(line in log.read_text() for log in out.glob("peer-*.log")
                                for line in (AOT_COMPILED, AOT_QUEUED))
    summary["probe_record"] = "warm" if warm else "cold"
    if (env or {}).get("LPDL_LOWP_AOT") == "background":
        summary["background_compile_s"] = wait_for_background_compile(record)
    return summary


def device_curve(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """The mean of the daemons' own latest test accuracies after each evaluation any daemon reported (from the
    first moment every daemon had one), then the history's last row (the final checkpoints' evaluation): rows of
    ``{elapsed_s, mean_peer_acc}``."""
    peers = summary["per_peer"]
    events = sorted((e["elapsed_s"], i, e["test_acc"]) for i, p in enumerate(peers) for e in p.get("evals") or [])
    latest: dict[int, float] = {}
    curve = []
    for elapsed, i, acc in events:
        latest[i] = acc
        if len(latest) == len(peers):
            curve.append({"elapsed_s": elapsed, "mean_peer_acc": sum(latest.values()) / len(latest)})
    history = summary.get("history") or []
    return curve + history[-1:]


def seconds_to(history: list[dict[str, Any]], key: str, level: float) -> float | None:
    """Elapsed seconds of the first history row whose ``key`` reached ``level`` (None: never)."""
    return next((h["elapsed_s"] for h in history if h.get(key) is not None and h[key] >= level), None)


def seconds_to_hold(history: list[dict[str, Any]], key: str, level: float) -> float | None:
    """Elapsed seconds of the first history row from which on every row's ``key`` is at least ``level`` (None: the
    last row is below it, or no row has it)."""
    rows = [h for h in history if h.get(key) is not None]
    held = None
    for h in rows:
        if h[key] < level:
            held = None
        elif held is None:
            held = h["elapsed_s"]
    return held


def consensus_share(summary: dict[str, Any]) -> tuple[float | None, int]:
    """(bytes sent in consensus phases / bytes sent training, the phase's most rounds); (None, 0) without one."""
    phases = [p.get("consensus") or {} for p in summary["per_peer"]]
    extra = sum(c.get("bytes_sent", 0) for c in phases)
    total = sum(p["bytes_sent"] for p in summary["per_peer"])
    if not extra or total <= extra:
        return None, 0
    return extra / (total - extra), max(c.get("rounds", 0) for c in phases)


def _median(values: list[float | None]) -> float:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else float("nan")


def startup_seconds(peers: list[dict[str, Any]]) -> dict[str, float]:
    """Median over the daemons of the seconds each start-up stage took (the training stage left out: it is the
    first rounds, not the start); empty where the daemons do not report them."""
    per_stage: dict[str, list[float]] = {}
    for p in peers:
        for stage, seconds in ((p.get("memory") or {}).get("seconds") or {}).items():
            if stage != "training":
                per_stage.setdefault(stage, []).append(seconds)
    return {stage: statistics.median(values) for stage, values in per_stage.items()}


def figures(summary: dict[str, Any], bare: BareTorch) -> dict[str, Any]:
    """The bench figures of one fleet summary (units in the keys)."""
    peers = summary["per_peer"]
    largest = max(peers, key=lambda p: p["peak_rss_mb"] or 0.0)
    peak = largest["peak_rss_mb"] or float("nan")
    torch_mib = bare.peak_mib((largest.get("memory") or {}).get("allocator", "glibc"))
    share, phase_rounds = consensus_share(summary)
    curve = device_curve(summary)
    return {
        "t90_device_s": seconds_to(curve, "mean_peer_acc", 0.9),
        "t90_device_held_s": seconds_to_hold(curve, "mean_peer_acc", 0.9),
        "cpu_s": summary.get("cpu_s", float("nan")),
        "bytes_sent_mb": sum(p["bytes_sent"] for p in peers) / 1e6,
        "consensus_share": share,
        "consensus_rounds": phase_rounds,
        "ms_per_round": _median([p["median_round_s"] for p in peers]) * 1000,
        "steady_bytes_per_round": _median([p["steady_bytes_sent_per_round"] for p in peers]),
        "all_bytes_per_round": _median([p["bytes_sent_per_round"] for p in peers]),
        "peak_rss_mib": peak,
        "over_torch_mib": peak - torch_mib,
        "rounds": _median([p["rounds"] for p in peers]),
        "w_p5": min((p["w_p5"] for p in peers if p.get("w_p5") is not None), default=float("nan")),
        "mean_peer_acc": summary["mean_peer_acc"],
        "averaged_model_acc": summary["averaged_model_acc"],
        "wall_s": summary["wall_s"],
        "backend": summary["precision"].get("backend", "?"),
        "memory": largest.get("memory"),
        "startup_s": startup_seconds(peers),
        "probe_record": summary["probe_record"] if summary["precision"].get("requested") == "int8" else "-",
    }


def results_table(rows: list[tuple[str, str, dict[str, Any]]]) -> str:
    """Markdown table, one row per (checkout, case), then each checkout's ratio to the first at the same case."""
    lines = [("| checkout | case | backend | ms/round | B/round steady | B/round all | peak RSS MiB | over torch MiB | "
              "rounds | w p5 | mean peer acc | averaged-model acc | wall s |"),
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for checkout, case, f in rows:
        lines.append(f"| {checkout} | {case} | {f['backend']} | {f['ms_per_round']:.0f} | "
                     f"{f['steady_bytes_per_round']:,.0f} | {f['all_bytes_per_round']:,.0f} | "
                     f"{f['peak_rss_mib']:.0f} | "
                     f"{f['over_torch_mib']:.0f} | {f['rounds']:.0f} | {f['w_p5']:.3f} | "
                     f"{f['mean_peer_acc'] * 100:.2f}% | "
                     f"{f['averaged_model_acc'] * 100:.2f}% | {f['wall_s']:.0f} |")
    lines += ["", comparison_table(rows)]
    first = rows[0][0]
    base = {case: f for checkout, case, f in rows if checkout == first}
    for checkout, case, f in rows:
        if checkout == first or case not in base:
            continue
        b = base[case]
        lines.append(f"| {checkout} / {first} | {case} | | {f['ms_per_round'] / b['ms_per_round']:.2f}x | "
                     f"{f['steady_bytes_per_round'] / b['steady_bytes_per_round']:.3f}x | "
                     f"{f['all_bytes_per_round'] / b['all_bytes_per_round']:.3f}x | "
                     f"{f['peak_rss_mib'] / b['peak_rss_mib']:.2f}x | "
                     f"{f['over_torch_mib'] / b['over_torch_mib']:.2f}x | | | | | |")
    return "\n".join(lines)


def _opt(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None or not b else f"{a / b:.2f}x"


def comparison_table(rows: list[tuple[str, str, dict[str, Any]]]) -> str:
    """The side-by-side figures of every run (time to 90% of the mean device model - first reached, and held to the
    end -, wall, CPU, bytes, peak RSS, consensus bytes), then int8 / fp32 at the same algorithm, choco / sgp at
    the same precision, and each case with the robust rule on / off (:data:`PLAIN_SUFFIX`) where both ran."""
    lines = ["| checkout | case | probe record | t90 device s | held from s | wall s | CPU s | MB sent (all peers) "
             "| peak RSS MiB | mean device acc | averaged acc | consensus bytes / training bytes (rounds) |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for checkout, case, f in rows:
        share = "-" if f["consensus_share"] is None else f"{f['consensus_share']:.2f}x ({f['consensus_rounds']})"
        lines.append(f"| {checkout} | {case} | {f['probe_record']} | {_opt(f['t90_device_s'], '.1f')} | "
                     f"{_opt(f['t90_device_held_s'], '.1f')} | {f['wall_s']:.1f} | "
                     f"{f['cpu_s']:.0f} | {f['bytes_sent_mb']:.1f} | {f['peak_rss_mib']:.0f} | "
                     f"{f['mean_peer_acc'] * 100:.2f}% | {f['averaged_model_acc'] * 100:.2f}% | {share} |")
    by = {(checkout, case): f for checkout, case, f in rows}
    pairs = [(f"{c}: {case} / {other}", by[c, case], by.get((c, other))) for c, case in by
             if case.endswith(("-int8", f"-{COMPILED}", f"-{AOT}", f"-{BACKGROUND}"))
             for other in [case.replace(case.rsplit("-", 1)[1], "fp32")]]
    pairs += [(f"{c}: {case} / {other}", by[c, case], by.get((c, other))) for c, case in by
              if case.endswith((f"-{COMPILED}", f"-{AOT}", f"-{BACKGROUND}"))
              for other in [case.replace(case.rsplit("-", 1)[1], "int8")]]
    pairs += [(f"{c}: {case} / {other}", by[c, case], by.get((c, other))) for c, case in by if case.startswith("choco")
              for other in [case.replace("choco", "sgp")]]
    pairs += [(f"{c}: {case} / {other}", by[c, case], by.get((c, other))) for c, case in by if PLAIN_SUFFIX not in case
              for other in [case.replace("-", f"{PLAIN_SUFFIX}-", 1)]]  # the robust rule's cost: on / off
    for label, a, b in pairs:
        if b is None:
            continue
        lines.append(f"| {label} | | {a['probe_record']} | {_ratio(a['t90_device_s'], b['t90_device_s'])} | "
                     f"{_ratio(a['t90_device_held_s'], b['t90_device_held_s'])} | "
                     f"{_ratio(a['wall_s'], b['wall_s'])} | {_ratio(a['cpu_s'], b['cpu_s'])} | "
                     f"{_ratio(a['bytes_sent_mb'], b['bytes_sent_mb'])} | "
                     f"{_ratio(a['peak_rss_mib'], b['peak_rss_mib'])} | | | |")
    return "\n".join(lines)


def memory_table(rows: list[tuple[str, str, dict[str, Any]]], bare: BareTorch) -> str:
    """RSS added per start-up stage of each run's largest daemon (MiB), where the daemons report it."""
    reported = [(c, case, f["memory"]) for c, case, f in rows if f.get("memory")]
    if not reported:
        return "(no daemon reported memory stages)"
    stages = list(reported[0][2]["added"])
    lines = [f"bare `import torch` peak: {bare.describe()}", "",
             "| checkout | case | malloc | " + " | ".join(stages) + " | gossip state | RSS at end | peak |",
             "|---|---|---|" + "---:|" * (len(stages) + 3)]
    for checkout, case, m in reported:
        added = " | ".join(f"{m['added'].get(s, float('nan')):+.0f}" for s in stages)
        lines.append(f"| {checkout} | {case} | {m.get('allocator', '?')} | {added} | "
                     f"{m.get('gossip_state_mib', float('nan')):.1f} | {m['rss_mib']:.0f} | {m['peak_mib']:.0f} |")
    return "\n".join(lines)


def startup_table(rows: list[tuple[str, str, dict[str, Any]]]) -> str:
    """Seconds each start-up stage took, median over each run's daemons, where the daemons report it."""
    reported = [(c, case, f["startup_s"]) for c, case, f in rows if f.get("startup_s")]
    if not reported:
        return "(no daemon reported start-up seconds)"
    stages = list(reported[0][2])
    lines = ["| checkout | case | " + " | ".join(stages) + " | sum |", "|---|---|" + "---:|" * (len(stages) + 1)]
    for checkout, case, seconds in reported:
        lines.append(f"| {checkout} | {case} | " + " | ".join(f"{seconds.get(s, float('nan')):.2f}" for s in stages)
                     + f" | {sum(seconds.values()):.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--epochs", type=float, default=None, help="epochs per peer [the fleet's default]")
    parser.add_argument("--cases", default="choco,sgp", help=f"comma-separated subset of {','.join(CASES)}, each "
                        f"also as <case>{PLAIN_SUFFIX} (the robust receive rule off)")
    parser.add_argument("--precisions", default="int8", help=f"comma-separated subset of int8,{COMPILED},{AOT},"
                        f"{BACKGROUND},fp32: int8 runs the passes eager (LPDL_LOWP_EAGER=1), {COMPILED} compiled "
                        f"just in time (LPDL_LOWP_EAGER=0), {AOT} compiled ahead of time (LPDL_LOWP_AOT=1), "
                        f"{BACKGROUND} from the store filled in the background (LPDL_LOWP_AOT=background, the "
                        "fleet's default); each case runs at each (int8,fp32 compares them side by side)")
    parser.add_argument("--skew", type=float, default=None, help="non-IID skew [the fleet's default]")
    parser.add_argument("--eval-every", type=int, default=None,
                        help="rounds between each daemon's own test evaluations [the fleet's default: an epoch]; "
                             "fewer reads the time to 90%% at a finer grain (each evaluation costs both precisions "
                             "alike)")
    parser.add_argument("--consensus-rounds", type=int, default=0,
                        help="run the final consensus phase, at most this many rounds (0: none)")
    parser.add_argument("--consensus-tolerance", type=float, default=None,
                        help="relative distance that ends the phase [the fleet's default]")
    parser.add_argument("--checkout", action="append", default=[], metavar="LABEL=DIR",
                        help="also run another checkout's code (repeatable); this checkout runs as 'this' first")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of every contender, interleaved (rows labelled checkout#run)")
    parser.add_argument("--probe-record", choices=("fresh", "cold"), default="fresh",
                        help="fresh: one new int8 probe record for the bench (the first int8 run cold, the rest "
                        "warm); cold: emptied before every run")
    parser.add_argument("--record", type=Path, default=None,
                        help="probe record and graph store to use and keep (e.g. one a first bench filled: warm "
                        "for every run) instead of a fresh one in the output directory; not emptied")
    parser.add_argument("--prepare", action="store_true",
                        help="compile the int8 pass graphs into the record first (lpdl-peer prepare), as at install")
    parser.add_argument("--out", type=Path, default=Path("runs") / time.strftime("bench-fleet-%Y%m%d-%H%M%S"))
    args = parser.parse_args()
    checkouts = [("this", THIS_CHECKOUT)] + [(c.split("=", 1)[0], Path(c.split("=", 1)[1]).resolve())
                                            for c in args.checkout]
    extra = ["--epochs", str(args.epochs)] if args.epochs else []
    extra += ["--skew", str(args.skew)] if args.skew is not None else []
    extra += ["--eval-every", str(args.eval_every)] if args.eval_every else []
    extra += ["--consensus-rounds", str(args.consensus_rounds)] if args.consensus_rounds else []
    extra += ["--consensus-tolerance", str(args.consensus_tolerance)] if args.consensus_tolerance else []
    bare = BareTorch()
    bare.peak_mib("glibc")
    out = args.out.resolve()
    record = args.record.resolve() if args.record else out / "probe-record"
    if args.record is None:
        shutil.rmtree(record, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    robust_off = out / "robust-off.toml"
    robust_off.write_text("[gossip]\nrobust = false\n")
    if args.prepare:
        for checkout_label, checkout in checkouts:
            if not (checkout / "peer" / "cli" / "prepare.py").exists():
                print(f"{checkout_label} ({checkout}) has no prepare command: its int8 fleets fill the store as they "
                      "run", flush=True)
                continue
            # the fleet's training flags, less its own --eval-every and that flag's value (prepare has no such flag)
            run_flags = [f for i, f in enumerate(extra) if "--eval-every" not in extra[max(i - 1, 0):i + 1]]
            seconds = prepare_record(checkout, record, ["--precision", "int8"] + run_flags)
            print(f"prepared {checkout_label} ({checkout}) into {record} in {seconds:.0f} s", flush=True)
    rows = []
    for run in range(1, args.repeats + 1):
        for case in args.cases.split(","):
            for precision in args.precisions.split(","):
                name = f"{case}-{precision}"
                for checkout_label, checkout in checkouts:
                    label = checkout_label if args.repeats == 1 else f"{checkout_label}#{run}"
                    if args.probe_record == "cold" and args.record is None:
                        shutil.rmtree(record, ignore_errors=True)
                    print(f"running {name} fleet of {label} ({checkout}) in {out / label / name} ...", flush=True)
                    flags = case_flags(case, robust_off) + ["--precision", PRECISION_FLAG[precision]] + extra
                    rows.append((label, name, figures(run_fleet(checkout, out / label / name, args.peers, flags,
                                                                record, PRECISION_ENV.get(precision)), bare)))
    print(f"load average before the last run ended: {os.getloadavg()}", flush=True)
    print(results_table(rows))
    print()
    print(memory_table(rows, bare))
    print()
    print(startup_table(rows))


if __name__ == "__main__":
    main()
