"""``lpdl-peer simulate``: n peers in one process on an in-memory transport (same gossip code as the daemon)."""

from __future__ import annotations

import csv
import json
import logging
from dataclasses import asdict
from pathlib import Path

import click
import torch
from tqdm import tqdm

from peer.cli.options import pop_run_spec, run_spec_options
from peer.data import load_dataset
from peer.gossip.topology import Topology, spectral_gap
from peer.sim.simulation import ChaosSpec, EpochRow, Simulation, SimulationDiverged

log = logging.getLogger(__name__)

HEADER = f"{'epoch':>6} {'avg-model acc':>13} {'mean peer acc':>13} {'loss':>7} {'MB/peer':>9} {'consensus':>10} {'wall s':>7}"


def format_row(row: EpochRow) -> str:
    return (f"{row.epoch:6.2f} {row.avg_model_acc * 100:12.2f}% {row.mean_peer_acc * 100:12.2f}% {row.train_loss:7.4f} "
            f"{row.bytes_per_peer / 1e6:9.3f} {row.consensus_distance:10.4f} {row.wall_s:7.1f}")


@click.command("simulate")
@run_spec_options
@click.option("--peers", "n_peers", type=int, default=8, help="Number of simulated peers.")
@click.option("--drop", type=float, default=0.0, help="Probability a message or ack is lost.")
@click.option("--delay", type=int, default=0, help="Rounds between send and delivery.")
@click.option("--churn", type=float, default=0.0, help="Probability per round that a peer goes offline.")
@click.option("--device", default="cpu", help="torch device (cpu, cuda).")
@click.option("--threads", type=int, default=None, help="torch intra-op threads.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="runs/simulate",
              help="Directory for results.csv, results.json and results.png.")
@click.option("--plot/--no-plot", default=True, help="Write results.png (needs matplotlib).")
def simulate(n_peers: int, drop: float, delay: int, churn: float, device: str, threads: int | None, out_dir: str,
             plot: bool, **kwargs: object) -> None:
    """Simulate a fleet and print accuracy, bytes and consensus distance per epoch."""
    spec = pop_run_spec(kwargs)
    if threads:
        torch.set_num_threads(threads)
    try:
        chaos = ChaosSpec(drop=drop, delay=delay, churn=churn)
        splits = load_dataset(spec.data.dataset, spec.data.root)
        sim = Simulation(spec, splits, n_peers, chaos=chaos, device=device)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    g = spec.gossip
    gap = spectral_gap(Topology(g.topology, g.rotating, g.k, spec.data.seed), n_peers)
    click.echo(f"{n_peers} peers, {spec.model.name} {sim.precision.backend}, {g.algorithm} c={g.compression} "
               f"{g.bits}-bit, {g.topology}{' rotating' if g.rotating else ''} (spectral gap {gap:.4f}), "
               f"skew {spec.data.skew}")
    try:
        run_with_progress(sim, spec.optim.epochs)
    except SimulationDiverged as exc:
        if sim.rows:
            write_results(Path(out_dir), spec, sim, sim.rows, gap, plot)
        raise click.ClickException(f"{exc} (rows so far in {out_dir})" if sim.rows else str(exc)) from None
    write_results(Path(out_dir), spec, sim, sim.rows, gap, plot)
    click.echo(f"results in {out_dir}")


def run_with_progress(sim: Simulation, epochs: float) -> list[EpochRow]:
    total = max(1, round(epochs * sim.rounds_per_epoch))
    tqdm.write(HEADER)
    with tqdm(total=total, desc="rounds", unit="round", dynamic_ncols=True, leave=False, disable=None) as bar:
        return sim.run(epochs, on_row=lambda row: tqdm.write(format_row(row)), on_round=lambda _: bar.update(1))


def write_results(out: Path, spec, sim: Simulation, rows: list[EpochRow], gap: float, plot: bool) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with (out / "results.csv").open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0].as_dict()))
        writer.writeheader()
        writer.writerows(r.as_dict() for r in rows)
    (out / "results.json").write_text(json.dumps({
        "spec": asdict(spec), "peers": sim.n_peers, "chaos": asdict(sim.chaos), "spectral_gap": gap,
        "precision": {"backend": sim.precision.backend, "reason": sim.precision.reason},
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
