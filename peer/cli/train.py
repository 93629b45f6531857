"""``lpdl-peer train``: single-device (centralised) training, the baseline (:mod:`peer.train` does the work)."""

from __future__ import annotations

from pathlib import Path

import click

from peer.cli.options import pop_run_spec, run_spec_options
from peer.gossip.kinds import Algorithm
from peer.train import run_training

#: train is dense single-device SGD unless flags or a config file say otherwise.
TRAIN_DEFAULTS = {"gossip": {"algorithm": Algorithm.SGP.value, "compression": 0.0, "bits": 32}}


@click.command("train")
@run_spec_options(TRAIN_DEFAULTS)
@click.option("--device", default="cpu", help="torch device (cpu, cuda).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="runs/train",
              help="Directory for metrics.json and checkpoint.pt.")
@click.option("--max-steps", type=int, default=None, help="Stop after this many steps (smoke tests).")
@click.option("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice).")
def train(device: str, out_dir: str, max_steps: int | None, threads: int | None, **kwargs: object) -> None:
    """Train one model on the whole training set and report test accuracy per epoch."""
    spec = pop_run_spec(kwargs, TRAIN_DEFAULTS)
    import torch

    from peer.runtime.build import load_splits

    if threads:
        torch.set_num_threads(threads)
    try:
        splits = load_splits(spec.data)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    metrics = run_training(spec, device, Path(out_dir), max_steps, splits)
    click.echo(f"final test accuracy {metrics['epochs'][-1]['test_acc'] * 100:.2f}% "
               f"({metrics['precision']['backend']}); metrics and checkpoint in {out_dir}")
