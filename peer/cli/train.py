"""``lpdl-peer train``: single-device (centralised) training, the baseline every decentralized result is compared
with. It is the runtime's one peer with no neighbours, so it shares the exact training code path."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict
from pathlib import Path

import click
import torch
from tqdm import tqdm

from peer.cli.options import pop_run_spec, run_spec_options
from peer.config import RunSpec
from peer.data import load_dataset
from peer.runtime import state
from peer.runtime.build import build_peer, build_peer_model, test_batches
from peer.runtime.evaluation import evaluate

log = logging.getLogger(__name__)


@click.command("train")
@run_spec_options
@click.option("--device", default="cpu", help="torch device (cpu, cuda).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="runs/train",
              help="Directory for metrics.json and checkpoint.pt.")
@click.option("--max-steps", type=int, default=None, help="Stop after this many steps (smoke tests).")
@click.option("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice).")
def train(device: str, out_dir: str, max_steps: int | None, threads: int | None, **kwargs: object) -> None:
    """Train one model on the whole training set and report test accuracy per epoch."""
    spec = pop_run_spec(kwargs, defaults={"gossip": {"algorithm": "sgp", "compression": 0.0, "bits": 32}})
    if threads:
        torch.set_num_threads(threads)
    metrics = run_training(spec, torch.device(device), Path(out_dir), max_steps)
    click.echo(f"final test accuracy {metrics['epochs'][-1]['test_acc'] * 100:.2f}% "
               f"({metrics['precision']['backend']}); metrics and checkpoint in {out_dir}")


def run_training(spec: RunSpec, device: torch.device, out_dir: Path, max_steps: int | None = None) -> dict:
    """Centralised training: the runtime's one peer on shard 0/1 (the whole training set) with no neighbours.
    Writes metrics.json and checkpoint.pt (the daemon's checkpoint schema) into ``out_dir``; returns the metrics."""
    try:
        splits = load_dataset(spec.data.dataset, spec.data.root)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    built = build_peer_model(spec.model, splits, device, seed=spec.data.seed)
    log.info("precision in use: %s (%s)", built.precision.backend, built.precision.reason)
    peer = build_peer(spec, "central", (0, 1), splits, device, built)
    test = test_batches(splits, device)
    total = math.ceil(spec.optim.epochs * peer.steps_per_epoch)
    if max_steps is not None:
        total = min(total, max_steps)
    epochs: list[dict] = []
    with tqdm(total=total, desc="train", unit="step", dynamic_ncols=True, disable=None) as bar:
        while peer.steps < total:
            steps = min(peer.steps_per_epoch - peer.steps % peer.steps_per_epoch, total - peer.steps)
            loss = peer.train_steps(steps)
            bar.update(steps)
            test_loss, test_acc = evaluate(peer.model, test)
            row = {"epoch": round(peer.epoch, 3), "step": peer.steps, "lr": peer.lr(), "train_loss": loss,
                   "test_loss": test_loss, "test_acc": test_acc}
            epochs.append(row)
            bar.set_postfix(loss=f"{loss:.3f}", acc=f"{test_acc * 100:.1f}%")
            tqdm.write(f"epoch {row['epoch']:.2f}  loss {loss:.4f}  test acc {test_acc * 100:.2f}%")
    metrics = {"spec": asdict(spec), "fingerprint": built.fingerprint,
               "precision": {"requested": spec.model.precision, "backend": built.precision.backend,
                             "reason": built.precision.reason},
               "epochs": epochs}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
    state.save(peer, out_dir / "checkpoint.pt", 0, asdict(spec), built.fingerprint)
    return metrics
