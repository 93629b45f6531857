"""The README fleet, measured: round time, bytes per round, accuracy and daemon memory, side by side in one run.

Runs ``lpdl-peer fleet`` (the README's default config unless flags say otherwise) for each case - Choco with 99%
top-k compression, and dense SGP (--algorithm sgp --compression 0) - and for each checkout given with --checkout
(before/after comparisons: another git worktree of this repository, run with the same interpreter), interleaved
case by case so machine drift hits every contender alike. Figures come from each run's summary.json, which the fleet
fills from the daemons' status snapshots (polled every 0.5 s) and /proc/<pid>/status:

    ms/round       median over peers of each peer's median last_round_s (one local step + gossip; rounds that
                   also evaluate or checkpoint are included when sampled)
    B/round        median over peers of bytes sent per round over the second half of training (steady state: the
                   one-off model pull of a joining peer is left out); "all" = total bytes sent / rounds
    peak RSS       VmHWM of the largest daemon (MiB), last read while it was alive
    over torch     peak RSS minus the peak RSS of a bare ``import torch`` in the same interpreter on the same malloc
                   the daemons ran on (their status names it: tcmalloc where installed; MiB): what the daemon
                   itself costs
    memory stages  (checkouts whose daemons report them) RSS added by each start-up stage of the largest daemon:
                   imports (torch + gRPC + zeroconf), dataset, model (+ int8 probe), peer (copy, optimizer,
                   loader), network (server, channels, mDNS), training (after the latest evaluation); gossip state
                   = the algorithm's tensors (Choco's replicas)

Usage: python bench/fleet.py [--peers 4] [--epochs E] [--checkout before=/path/to/old/worktree] [--cases choco,sgp]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled
from peer.daemon.allocator import ALLOCATOR_LIBRARIES, find_library  # noqa: E402  (no torch: a light module)

#: case name -> extra fleet flags
CASES: dict[str, list[str]] = {
    "choco": ["--algorithm", "choco", "--compression", "0.99"],
    "sgp": ["--algorithm", "sgp", "--compression", "0"],
}
THIS_CHECKOUT = Path(__file__).resolve().parents[1]
_BARE_TORCH = ("import torch\nfor line in open('/proc/self/status'):\n"
               "    if line.startswith('VmHWM:'): print(int(line.split()[1]) / 1024)")


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


def run_fleet(checkout: Path, out: Path, peers: int, extra: list[str]) -> dict[str, Any]:
    """Run one fleet of ``checkout``'s code to completion and return its summary.json (raises if it failed)."""
    cmd = [sys.executable, "-c", "from peer.cli.main import cli; cli()", "fleet", "--peers", str(peers),
           "--out", str(out), "--refresh", "30", *extra]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=checkout, env=checkout_env(checkout))
    return json.loads((out / "summary.json").read_text())


def _median(values: list[float | None]) -> float:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else float("nan")


def figures(summary: dict[str, Any], bare: BareTorch) -> dict[str, Any]:
    """The bench figures of one fleet summary (units in the keys)."""
    peers = summary["per_peer"]
    largest = max(peers, key=lambda p: p["peak_rss_mb"] or 0.0)
    peak = largest["peak_rss_mb"] or float("nan")
    torch_mib = bare.peak_mib((largest.get("memory") or {}).get("allocator", "glibc"))
    return {
        "ms_per_round": _median([p["median_round_s"] for p in peers]) * 1000,
        "steady_bytes_per_round": _median([p["steady_bytes_sent_per_round"] for p in peers]),
        "all_bytes_per_round": _median([p["bytes_sent_per_round"] for p in peers]),
        "peak_rss_mib": peak,
        "over_torch_mib": peak - torch_mib,
        "rounds": _median([p["rounds"] for p in peers]),
        "mean_peer_acc": summary["mean_peer_acc"],
        "averaged_model_acc": summary["averaged_model_acc"],
        "wall_s": summary["wall_s"],
        "backend": summary["precision"].get("backend", "?"),
        "memory": largest.get("memory"),
    }


def results_table(rows: list[tuple[str, str, dict[str, Any]]]) -> str:
    """Markdown table, one row per (checkout, case), then each checkout's ratio to the first at the same case."""
    lines = [("| checkout | case | backend | ms/round | B/round steady | B/round all | peak RSS MiB | over torch MiB | "
              "rounds | mean peer acc | averaged-model acc | wall s |"),
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for checkout, case, f in rows:
        lines.append(f"| {checkout} | {case} | {f['backend']} | {f['ms_per_round']:.0f} | "
                     f"{f['steady_bytes_per_round']:,.0f} | {f['all_bytes_per_round']:,.0f} | "
                     f"{f['peak_rss_mib']:.0f} | "
                     f"{f['over_torch_mib']:.0f} | {f['rounds']:.0f} | {f['mean_peer_acc'] * 100:.2f}% | "
                     f"{f['averaged_model_acc'] * 100:.2f}% | {f['wall_s']:.0f} |")
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
                     f"{f['over_torch_mib'] / b['over_torch_mib']:.2f}x | | | | |")
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--epochs", type=float, default=None, help="epochs per peer [the fleet's default]")
    parser.add_argument("--cases", default="choco,sgp", help=f"comma-separated subset of {','.join(CASES)}")
    parser.add_argument("--checkout", action="append", default=[], metavar="LABEL=DIR",
                        help="also run another checkout's code (repeatable); this checkout runs as 'this' first")
    parser.add_argument("--out", type=Path, default=Path("runs") / time.strftime("bench-fleet-%Y%m%d-%H%M%S"))
    args = parser.parse_args()
    checkouts = [("this", THIS_CHECKOUT)] + [(c.split("=", 1)[0], Path(c.split("=", 1)[1]).resolve())
                                            for c in args.checkout]
    extra = ["--epochs", str(args.epochs)] if args.epochs else []
    bare = BareTorch()
    bare.peak_mib("glibc")
    out = args.out.resolve()
    rows = []
    for case in args.cases.split(","):
        for label, checkout in checkouts:
            print(f"running {case} fleet of {label} ({checkout}) in {out / label / case} ...", flush=True)
            rows.append((label, case, figures(run_fleet(checkout, out / label / case, args.peers,
                                                        CASES[case] + extra), bare)))
    print(results_table(rows))
    print()
    print(memory_table(rows, bare))


if __name__ == "__main__":
    main()
