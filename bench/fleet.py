"""The README fleet, measured: round time, bytes per round and daemon memory, Choco 99% vs dense SGP, in one run.

Runs ``lpdl-peer fleet`` (the README's default config unless flags say otherwise) twice, one after the other on the
same machine: Choco with 99% top-k compression, then dense SGP (--algorithm sgp --compression 0). Figures come
from each run's summary.json, which the fleet fills from the daemons' status snapshots (polled every 0.5 s) and
/proc/<pid>/status:

    ms/round       median over peers of each peer's median last_round_s (one local step + gossip; rounds that
                   also evaluate or checkpoint are included when sampled)
    B/round        median over peers of bytes sent per round over the second half of training (steady state: the
                   one-off model pull of a joining peer is left out); "all" = total bytes sent / rounds
    peak RSS       VmHWM of the largest daemon (MiB), last read while it was alive

Usage: python bench/fleet.py [--peers 4] [--epochs E] [--out runs/bench-fleet]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

#: (label, extra fleet flags)
CASES: list[tuple[str, list[str]]] = [
    ("choco c=0.99", ["--algorithm", "choco", "--compression", "0.99"]),
    ("sgp dense", ["--algorithm", "sgp", "--compression", "0"]),
]


def run_fleet(out: Path, peers: int, extra: list[str]) -> dict[str, Any]:
    """Run one fleet to completion and return its summary.json (raises if the fleet failed)."""
    cmd = [sys.executable, "-c", "from peer.cli.main import cli; cli()", "fleet", "--peers", str(peers),
           "--out", str(out), "--refresh", "30", *extra]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads((out / "summary.json").read_text())


def _median(values: list[float | None]) -> float:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else float("nan")


def figures(summary: dict[str, Any]) -> dict[str, float]:
    """The bench figures of one fleet summary (units in the keys)."""
    peers = summary["per_peer"]
    return {
        "ms_per_round": _median([p["median_round_s"] for p in peers]) * 1000,
        "steady_bytes_per_round": _median([p["steady_bytes_sent_per_round"] for p in peers]),
        "all_bytes_per_round": _median([p["bytes_sent_per_round"] for p in peers]),
        "peak_rss_mib": max(p["peak_rss_mb"] or 0.0 for p in peers),
        "rounds": _median([p["rounds"] for p in peers]),
        "mean_peer_acc": summary["mean_peer_acc"],
        "averaged_model_acc": summary["averaged_model_acc"],
        "wall_s": summary["wall_s"],
    }


def table(rows: list[tuple[str, dict[str, float]]], backend: str) -> str:
    """Markdown table, one row per case plus the Choco/SGP ratio row."""
    lines = [f"precision backend: {backend}", "",
             ("| case | ms/round | B/round steady | B/round all | peak RSS MiB | rounds | mean peer acc | "
              "averaged-model acc | wall s |"),
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for label, f in rows:
        lines.append(f"| {label} | {f['ms_per_round']:.0f} | {f['steady_bytes_per_round']:,.0f} | "
                     f"{f['all_bytes_per_round']:,.0f} | {f['peak_rss_mib']:.0f} | {f['rounds']:.0f} | "
                     f"{f['mean_peer_acc'] * 100:.2f}% | {f['averaged_model_acc'] * 100:.2f}% | {f['wall_s']:.0f} |")
    (_, c), (_, s) = rows
    lines.append(f"| choco / sgp | {c['ms_per_round'] / s['ms_per_round']:.2f}x | "
                 f"{c['steady_bytes_per_round'] / s['steady_bytes_per_round']:.4f}x | "
                 f"{c['all_bytes_per_round'] / s['all_bytes_per_round']:.4f}x | "
                 f"{c['peak_rss_mib'] / s['peak_rss_mib']:.2f}x | | | | |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--epochs", type=float, default=None, help="epochs per peer [the fleet's default]")
    parser.add_argument("--out", type=Path, default=Path("runs") / time.strftime("bench-fleet-%Y%m%d-%H%M%S"))
    args = parser.parse_args()
    extra = ["--epochs", str(args.epochs)] if args.epochs else []
    rows = []
    backend = "?"
    for label, flags in CASES:
        out = args.out / label.split()[0]
        print(f"running {label} fleet in {out} ...", flush=True)
        summary = run_fleet(out, args.peers, flags + extra)
        backend = summary["precision"].get("backend", "?")
        rows.append((label, figures(summary)))
    print(table(rows, backend))


if __name__ == "__main__":
    main()
