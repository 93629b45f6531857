"""The fleet's final report: every peer's checkpoint evaluated, summary.json, and the summary text.

Consensus distance follows docs/method.md#measurements: mean_i ||z_i - z_bar||, the absolute L2 distance of each peer's
de-biased model z_i = x_i / w_i to their average z_bar (the simulator's figure). ``consensus_distance_relative`` divides
it by ||z_bar|| (dimensionless) for comparing models of different scale.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from peer.config import RunSpec
from peer.daemon.paths import CHECKPOINT_NAME
from peer.fleet.launch import Daemon
from peer.lowp.kinds import STORE_FILLING, STORE_NOT_PREPARED


@dataclass
class CheckpointEval:
    """Test accuracy (in [0, 1]) of the peers' final checkpoints and of their average.

    Attributes:
        per_peer: accuracy of each peer's de-biased model, None where a peer left no checkpoint.
        averaged: accuracy of the averaged model (None if no checkpoint was found).
        consensus_distance: mean_i ||z_i - z_bar|| (L2, in model units; None without checkpoints).
        consensus_distance_relative: consensus_distance / ||z_bar|| (dimensionless).
        backend: precision backend the evaluation ran with.
    """

    per_peer: list[float | None]
    averaged: float | None
    consensus_distance: float | None
    consensus_distance_relative: float | None
    backend: str


def evaluate_checkpoints(spec: RunSpec, state_dirs: list[Path]) -> CheckpointEval:
    """Evaluate each peer's final de-biased model z = x / w, and the average of all of them, on the test split.

    Loads ``checkpoint.pt`` from each state directory; the averaged model (mean z with mean floating buffers) and
    the consensus distance (mean_i ||z_i - z_bar||) are the runtime's one definition (peer/runtime/state.py).
    Imports torch and the training stack only here.
    """
    import torch

    from peer.runtime import state
    from peer.runtime.build import build_peer_model, load_splits, test_batches
    from peer.runtime.evaluation import evaluate
    from peer.runtime.flat import FlatModel

    splits = load_splits(spec.data)
    built = build_peer_model(spec.model, splits, torch.device("cpu"), seed=spec.data.seed)
    flat = FlatModel(built.model)
    batches = test_batches(splits, torch.device("cpu"))
    states = []
    for state_dir in state_dirs:
        path = state_dir / CHECKPOINT_NAME
        states.append(state.load(path, built.fingerprint) if path.exists() else None)
    found = [s for s in states if s is not None]

    def accuracy(z: torch.Tensor, buffers: dict[str, torch.Tensor]) -> float:
        with torch.no_grad():
            flat.z.copy_(z)
        state.load_buffers(built.model, buffers)
        return evaluate(built.model, batches)[1]

    per_peer = [None if s is None else accuracy(state.debiased(s), s["buffers"]) for s in states]
    if not found:
        return CheckpointEval(per_peer, None, None, None, built.precision.backend)
    zs = [state.debiased(s) for s in found]
    z_bar = state.average_model(zs)
    distance = state.consensus_distance(zs)
    norm = float(z_bar.norm())
    averaged = accuracy(z_bar, state.average_buffers([s["buffers"] for s in found]))
    return CheckpointEval(per_peer, averaged, distance, distance / norm if norm > 0 else None,
                          built.precision.backend)


def _finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None


def peer_summary(d: Daemon, accuracy: float | None) -> dict[str, Any]:
    """Per-peer figures (bytes and rounds from the last status snapshot, accuracy from the final checkpoint)."""
    s = d.seen.status
    rounds = s.round if s is not None else 0
    sent, received = d.seen.bytes_total("bytes_sent"), d.seen.bytes_total("bytes_received")
    samples = list(d.seen.round_samples.values())
    return {
        "peer_id": d.peer_id, "shard": d.index, "exit_code": d.proc.returncode, "log": str(d.log_path),
        "final_test_acc": accuracy, "last_own_eval": asdict(s.eval) if s is not None and s.eval else None,
        "rounds": rounds, "epoch": s.epoch if s is not None else None, "w": s.w if s is not None else None,
        "w_p5": _finite_or_none(d.seen.low_w()),
        "bytes_sent": sent, "bytes_received": received,
        "bytes_sent_per_round": sent / rounds if rounds else None,
        "steady_bytes_sent_per_round": _finite_or_none(d.seen.steady_sent_per_round()),
        "mean_round_s": _finite_or_none(d.seen.mean_round_s()),
        "median_round_s": statistics.median(samples) if samples else None,
        "peak_rss_mb": d.seen.peak_rss_kb / 1024 if d.seen.peak_rss_kb else None,
        "memory": asdict(s.memory) if s is not None and s.memory is not None else None,
        "consensus": asdict(s.consensus) if s is not None and s.consensus is not None else None,
        "evals": d.seen.evals,
    }


def build_summary(spec: RunSpec, daemons: list[Daemon], fleet: str, run_dir: Path, wall_s: float,
                  interrupted: bool, result: CheckpointEval) -> dict[str, Any]:
    """Everything summary.json holds: spec, per-peer figures, fleet mean and averaged-model accuracy."""
    peers = [peer_summary(d, acc) for d, acc in zip(daemons, result.per_peer)]
    accs = [a for a in result.per_peer if a is not None]
    precision = next((asdict(d.seen.status.precision) for d in daemons if d.seen.status is not None),
                     {"backend": result.backend})
    return {
        "fleet": fleet, "run_dir": str(run_dir), "peers": len(daemons), "wall_s": wall_s,
        "interrupted": interrupted, "ok": not interrupted and all(p["exit_code"] == 0 for p in peers),
        "precision": precision, "spec": asdict(spec), "gamma": spec.gossip.effective_gamma,
        "mean_peer_acc": sum(accs) / len(accs) if accs else None, "averaged_model_acc": result.averaged,
        "consensus_distance": result.consensus_distance,
        "consensus_distance_relative": result.consensus_distance_relative,
        "per_peer": peers,
    }


def write_summary(summary: dict[str, Any], run_dir: Path) -> Path:
    """Write ``summary.json`` into the run directory and return its path."""
    path = run_dir / "summary.json"
    path.write_text(json.dumps(summary, indent=2, default=str))
    return path


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.2f}%"


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def consensus_lines(summary: dict[str, Any]) -> list[str]:
    """The consensus phase's line (rounds, bytes against the whole run's), where the daemons ran one."""
    phases = [p["consensus"] for p in summary["per_peer"] if p.get("consensus") and p["consensus"]["rounds"]]
    if not phases:
        return []
    extra = sum(c["bytes_sent"] for c in phases)
    total = sum(p["bytes_sent"] for p in summary["per_peer"])
    share = f"; {extra / (total - extra):.2f}x the training's bytes" if total > extra else ""
    return [f"consensus phase       {max(c['rounds'] for c in phases)} rounds at most, {extra / 1e6:.3f} MB sent "
            f"by all peers{share}"]


def prepare_hint(precision_reason: str) -> list[str]:
    """A line saying how to run the compiled passes next time, where the daemons ran them eagerly for want of stored
    graphs (a first int8 run on a host; docs/decisions/lowp-passes.md#prepared-at-install)."""
    if STORE_FILLING not in precision_reason and STORE_NOT_PREPARED not in precision_reason:
        return []
    return ["hint                  the 8-bit passes ran eagerly: this host's store of compiled passes lacked them. "
            "`lpdl-peer prepare` (with this run's training flags) compiles them once, in minutes; later runs load "
            "them"]


def format_summary(summary: dict[str, Any]) -> str:
    """Human-readable end-of-run summary."""
    header = (f"{'peer':<18} {'exit':>4} {'final acc':>9} {'rounds':>6} {'MB sent':>8} {'MB recv':>8} "
              f"{'ms/round':>8} {'peak RSS MB':>11}")
    lines = ["", header]
    for p in summary["per_peer"]:
        lines.append(f"{p['peer_id']:<18} {_num(p['exit_code'], 'd'):>4} {_pct(p['final_test_acc']):>9} "
                     f"{p['rounds']:>6} {p['bytes_sent'] / 1e6:>8.3f} {p['bytes_received'] / 1e6:>8.3f} "
                     f"{_num(_ms(p['mean_round_s']), '.0f'):>8} "
                     f"{_num(p['peak_rss_mb'], '.0f'):>11}")
    prec = summary["precision"]
    relative = summary["consensus_distance_relative"]
    lines += [
        "",
        f"fleet mean accuracy   {_pct(summary['mean_peer_acc'])}",
        f"averaged model        {_pct(summary['averaged_model_acc'])}",
        (f"consensus distance    {_num(summary['consensus_distance'], '.4g')}  (mean L2 distance of the peers' "
         f"models to their average" + (f"; {relative * 100:.2f}% of its norm)" if relative is not None else ")")),
        *consensus_lines(summary),
        f"precision backend     {prec.get('backend')}" + (f" ({prec['reason']})" if prec.get("reason") else ""),
        *prepare_hint(str(prec.get("reason", ""))),
        f"wall time             {summary['wall_s']:.1f}s" + ("  (interrupted)" if summary["interrupted"] else ""),
        f"summary               {summary['run_dir']}/summary.json",
    ]
    export = summary.get("export")
    if export:
        lines.append("export                " + (f"failed: {export['error']}" if "error" in export else
                                                f"{export['dir']} ({', '.join(export['bytes'])}; "
                                                f"{sum(export['bytes'].values()) / 1e6:.1f} MB)"))
    if summary.get("history_csv"):
        lines.append(f"curves                {summary['history_csv']}" + (f", {summary['plot']}" if summary.get("plot")
                                                                           else ""))
    return "\n".join(lines)
