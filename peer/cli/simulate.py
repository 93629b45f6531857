"""``lpdl-peer simulate``: n peers in one process on an in-memory transport (same gossip code as the daemon)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click

from peer.cli.options import pop_run_spec, run_spec_options
from peer.sim.results import write_results

if TYPE_CHECKING:
    from peer.sim.simulation import EpochRow, Simulation

HEADER = f"{'epoch':>6} {'avg-model acc':>13} {'mean peer acc':>13} {'loss':>7} {'MB/peer':>9} {'consensus':>10} {'wall s':>7}"


def format_row(row: EpochRow) -> str:
    """One line per epoch under HEADER (consensus = mean_i ||z_i - z_bar||, docs/method.md#measurements)."""
    return (f"{row.epoch:6.2f} {row.avg_model_acc * 100:12.2f}% {row.mean_peer_acc * 100:12.2f}% {row.train_loss:7.4f} "
            f"{row.bytes_per_peer / 1e6:9.3f} {row.consensus_distance:10.4f} {row.wall_s:7.1f}"
            + (f"  after the consensus phase: {row.consensus_rounds} rounds, "
               f"{row.consensus_bytes_per_peer / 1e6:.3f} MB/peer of the total" if row.phase == "consensus" else ""))


@click.command("simulate")
@run_spec_options()
@click.option("--peers", "n_peers", type=int, default=8, help="Number of simulated peers.")
@click.option("--drop", type=float, default=0.0, help="Probability a message or ack is lost.")
@click.option("--delay", type=int, default=0, help="Rounds between send and delivery.")
@click.option("--churn", type=float, default=0.0, help="Probability per round that a peer goes offline.")
@click.option("--device", default="cpu", help="torch device (cpu, cuda).")
@click.option("--threads", type=int, default=None, help="torch intra-op threads.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="runs/simulate",
              help="Directory for results.csv, results.json and results.png.")
@click.option("--plot/--no-plot", default=True,
              help="Write results.png: accuracy and consensus distance over rounds and MB sent (needs the plot "
                   "extra, matplotlib).")
def simulate(n_peers: int, drop: float, delay: int, churn: float, device: str, threads: int | None, out_dir: str,
             plot: bool, **kwargs: object) -> None:
    """Simulate a fleet and print accuracy, bytes and consensus distance per epoch."""
    spec = pop_run_spec(kwargs)
    import torch

    from peer.gossip.reach import describe, fewest_senders, max_insiders_bounded
    from peer.gossip.topology import Topology, spectral_gap
    from peer.runtime.build import load_splits
    from peer.sim.simulation import ChaosSpec, Simulation, SimulationDiverged

    if threads:
        torch.set_num_threads(threads)
    try:
        chaos = ChaosSpec(drop=drop, delay=delay, churn=churn)
        splits = load_splits(spec.data)
        sim = Simulation(spec, splits, n_peers, chaos=chaos, device=device)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    g = spec.gossip
    topology = Topology(g.topology, g.rotating, g.k, spec.data.seed)
    gap = spectral_gap(topology, n_peers)
    click.echo(f"{n_peers} peers, {spec.model.name} {sim.precision.backend}, {g.algorithm} c={g.compression} "
               f"{g.bits}-bit, {g.topology}{' rotating' if g.rotating else ''} (spectral gap {gap:.4f}), "
               f"skew {spec.data.skew}")
    # a peer that hears nobody (one peer; a random graph's unlucky draw) has nothing to bound
    if g.robust and (fewest := fewest_senders(topology, n_peers)):
        click.echo(f"each peer {describe(fewest, max_insiders_bounded(fewest, n_peers))}")
    if sim.layer_report:
        click.echo(sim.layer_report["layers"])
    try:
        run_with_progress(sim, spec.optim.epochs)
    except SimulationDiverged as exc:
        if sim.rows:
            _note(write_results(Path(out_dir), spec, sim, sim.rows, gap, plot))
        raise click.ClickException(f"{exc} (rows so far in {out_dir})" if sim.rows else str(exc)) from None
    _note(write_results(Path(out_dir), spec, sim, sim.rows, gap, plot))
    if sim.recoveries:
        click.echo(f"{len(sim.recoveries)} divergence recover{'y' if len(sim.recoveries) == 1 else 'ies'} (model "
                   f"rolled back, gamma or the learning rate halved): "
                   + "; ".join(f"{e.peer_id} round {e.round} -> gamma {e.gamma:.3g}, lr x{e.lr_factor:g}"
                               for e in sim.recoveries))
    click.echo(f"results in {out_dir}")


def _note(message: str | None) -> None:
    if message:
        click.echo(message, err=True)


def run_with_progress(sim: Simulation, epochs: float) -> list[EpochRow]:
    """Run ``epochs`` epochs with a progress bar, printing a row per epoch above it."""
    from tqdm import tqdm

    total = max(1, round(epochs * sim.rounds_per_epoch))
    tqdm.write(HEADER)
    with tqdm(total=total, desc="rounds", unit="round", dynamic_ncols=True, leave=False, disable=None) as bar:
        return sim.run(epochs, on_row=lambda row: tqdm.write(format_row(row)), on_round=lambda _: bar.update(1))
