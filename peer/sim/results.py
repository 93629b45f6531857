"""The result files of a simulation run: results.csv, results.json and (with matplotlib) results.png.

Written by ``lpdl-peer simulate`` and bench/reproduce_paper.py, read back by the bench's table phase. torch-free:
it reads only the simulation's rows and a few of its attributes.
"""

from __future__ import annotations

import csv
import json
import logging
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from peer.config import RunSpec

if TYPE_CHECKING:
    from peer.sim.simulation import EpochRow, Simulation

log = logging.getLogger(__name__)


def write_results(out: Path, spec: RunSpec, sim: Simulation, rows: list[EpochRow], gap: float, plot: bool) -> None:
    """Write the per-epoch rows (CSV and JSON, with spec, chaos, spectral gap and precision) and optionally a plot."""
    out.mkdir(parents=True, exist_ok=True)
    with (out / "results.csv").open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0].as_dict()))
        writer.writeheader()
        writer.writerows(r.as_dict() for r in rows)
    (out / "results.json").write_text(json.dumps({
        "spec": asdict(spec), "peers": sim.n_peers, "chaos": asdict(sim.chaos), "spectral_gap": gap,
        "precision": {"backend": sim.precision.backend, "reason": sim.precision.reason},
        "recoveries": [e.as_dict() for e in sim.recoveries],
        "rows": [r.as_dict() for r in rows]}, indent=2))
    if plot:
        plot_results(rows, out / "results.png")


def plot_results(rows: list[EpochRow], path: Path) -> None:
    """Accuracy vs epoch and accuracy vs bytes per peer, side by side."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib not installed (the demo extra): no plot written")
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    epochs = [r.epoch for r in rows]
    mbytes = [r.bytes_per_peer / 1e6 for r in rows]
    for ax, xs, label in ((a, epochs, "epoch"), (b, mbytes, "MB sent per peer")):
        ax.plot(xs, [r.avg_model_acc * 100 for r in rows], marker="o", label="averaged model")
        ax.plot(xs, [r.mean_peer_acc * 100 for r in rows], marker=".", label="mean per peer")
        ax.set_xlabel(label)
        ax.set_ylabel("test accuracy %")
        ax.grid(alpha=0.3)
    a.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
