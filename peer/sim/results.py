"""The result files of a simulation run: results.csv, results.json and (with matplotlib) results.png, the
four panels of peer/plots.py.

Written by ``lpdl-peer simulate`` and bench/reproduce_paper.py, read back by the bench's table phase. torch-free:
it reads only the simulation's rows and a few of its attributes.
"""

from __future__ import annotations

import csv
import json
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from peer.config import RunSpec
from peer.plots import PlotUnavailable, Series, write_learning_curves

if TYPE_CHECKING:
    from peer.sim.simulation import EpochRow, Simulation


def write_results(out: Path, spec: RunSpec, sim: Simulation, rows: list[EpochRow], gap: float,
                  plot: bool) -> str | None:
    """Write the per-epoch rows (CSV and JSON, with spec, chaos, spectral gap and precision) and optionally the
    plot; returns a one-line note when the plot was asked for but could not be drawn (matplotlib missing)."""
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
    if not plot:
        return None
    try:
        plot_results(rows, out / "results.png", title=f"{sim.n_peers} simulated peers, {spec.model.name}, "
                                                      f"{spec.gossip.algorithm} c={spec.gossip.compression}")
    except PlotUnavailable as exc:
        return str(exc)
    return None


def curves(rows: list[EpochRow]) -> tuple[list[Series], list[Series]]:
    """(accuracy, consensus) series of the rows: averaged-model and mean per-peer accuracy, consensus distance."""
    rounds = [r.round for r in rows]
    mbytes = [r.bytes_per_peer / 1e6 for r in rows]
    return ([Series("averaged model", rounds, mbytes, [r.avg_model_acc for r in rows]),
             Series("mean per peer", rounds, mbytes, [r.mean_peer_acc for r in rows])],
            [Series("consensus distance", rounds, mbytes, [r.consensus_distance for r in rows])])


def plot_results(rows: list[EpochRow], path: Path, title: str = "simulation") -> Path:
    """Accuracy and consensus distance over rounds and over MB sent per peer (peer/plots.py, four panels).

    Raises:
        PlotUnavailable: matplotlib is not installed.
    """
    accuracy, consensus = curves(rows)
    return write_learning_curves(path, accuracy, consensus, title)
