"""Centralised training, the baseline every decentralized result is compared with.

The runtime's one peer (shard 0/1, the whole training set) with no neighbours, so it shares the exact training code
path of the daemon and the simulator, and writes the daemon's checkpoint schema. Used by ``lpdl-peer train`` and bench/reproduce_paper.py. torch and the training stack are imported
inside :func:`run_training`, so the CLI can import this module for ``train --help`` without loading them.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from peer.config import RunSpec

if TYPE_CHECKING:
    import torch

    from peer.data import DatasetSplits
    from peer.models.source import ModelSource

log = logging.getLogger(__name__)



def run_training(spec: RunSpec, device: str | torch.device, out_dir: Path, max_steps: int | None = None,
                 splits: DatasetSplits | None = None, source: ModelSource | None = None) -> dict[str, Any]:
    """Train on the whole training split, evaluate after every epoch, write metrics.json and checkpoint.pt.

    Args:
        spec: the run; gossip settings only shape the worker (no neighbours).
        device: torch device.
        out_dir: created if missing.
        max_steps: stop after this many local steps (smoke tests); None = ``spec.optim.epochs`` epochs.
        splits: the dataset, if the caller loaded it already; None = ``spec.data``'s.
        source: the model, where it is not ``spec.model.name`` (the Python API's callable).

    Returns:
        The metrics written to metrics.json (spec, fingerprint, precision in use, one row per evaluation).

    Raises:
        ValueError: the dataset cannot be loaded (the message names the path or name).
    """
    import torch
    from tqdm import tqdm

    from peer.runtime import state
    from peer.runtime.build import build_peer, build_peer_model, load_splits, test_batches
    from peer.runtime.evaluation import evaluate

    device = torch.device(device)
    if splits is None:
        splits = load_splits(spec.data)
    built = build_peer_model(spec.model, splits, device, seed=spec.data.seed, source=source)
    log.info("precision in use: %s (%s)", built.precision.backend, built.precision.reason)
    layers = built.layer_report()
    if layers:
        tqdm.write(layers["layers"])
    peer = build_peer(spec, "central", (0, 1), splits, device, built)
    test = test_batches(splits, device)
    total = math.ceil(spec.optim.epochs * peer.steps_per_epoch)
    if max_steps is not None:
        total = min(total, max_steps)
    epochs: list[dict[str, Any]] = []
    with tqdm(total=total, desc="train", unit="step", dynamic_ncols=True, disable=None) as bar:
        while peer.steps < total:
            steps = min(peer.steps_per_epoch - peer.steps % peer.steps_per_epoch, total - peer.steps)
            loss = peer.train_steps(steps)
            bar.update(steps)
            peer.prepare_evaluation()
            test_loss, test_acc = evaluate(peer.model, test)
            row = {"epoch": round(peer.epoch, 3), "step": peer.steps, "lr": peer.lr(), "train_loss": loss,
                   "test_loss": test_loss, "test_acc": test_acc}
            epochs.append(row)
            bar.set_postfix(loss=f"{loss:.3f}", acc=f"{test_acc * 100:.1f}%")
            tqdm.write(f"epoch {row['epoch']:.2f}  loss {loss:.4f}  test acc {test_acc * 100:.2f}%")
    metrics = {"spec": asdict(spec), "fingerprint": built.fingerprint,
               "model": {"source": built.source.ref, "source_kind": built.source.kind, **layers},
               "precision": built.precision.describe(),  # kernels, quantizer path, the measured step vs fp32
               "epochs": epochs}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
    state.save(peer, out_dir / "checkpoint.pt", 0, asdict(spec), built.fingerprint,
               info={**built.info(), "test_acc": epochs[-1]["test_acc"] if epochs else None})
    return metrics
