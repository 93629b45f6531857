"""The fleet's learning curves while it runs: accuracy, consensus distance and bytes sent, sampled over time.

Every daemon of a fleet checkpoints every ``eval_every`` rounds (the fleet passes ``--checkpoint-every``), right after
evaluating its own model. :class:`History` samples, at most every ``every_s`` seconds and only when some checkpoint
moved on: the consensus distance of the peers' latest checkpoints (mean_i ||z_i - z_bar||, docs/method.md#measurements,
peer/runtime/state.py), the mean of their latest own test accuracies, the mean bytes each has sent, and the mean round
of those checkpoints. The report adds the final row from the checkpoint evaluation (averaged model too), and writes
``history.csv`` and, with the plot extra, ``fleet.png`` (peer/plots.py).

Reading checkpoints imports torch (the fleet command itself starts without it): at the first sample, or in the
background from :meth:`History.load_in_background` on, sampling nothing until it is there - an import of a few
seconds on loaded cores must not hold up the fleet's status polls, which see each daemon's evaluations as they come.
"""

from __future__ import annotations

import csv
import importlib
import math
import threading
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from peer.daemon.paths import CHECKPOINT_NAME, PREVIOUS_CHECKPOINT_NAME
from peer.fleet.launch import Daemon
from peer.plots import Series, write_learning_curves

#: Seconds between two samples at least (a sample reads every peer's checkpoint).
DEFAULT_EVERY_S = 5.0


@dataclass
class Sample:
    """One point of the fleet's curves.

    Attributes:
        elapsed_s: seconds since the fleet started.
        round: mean round of the checkpoints sampled.
        mb_sent_per_peer: mean MB sent by a peer so far (status counters; final checkpoints: the last snapshot).
        mean_peer_acc: mean of the peers' latest own test accuracies in [0, 1] (None before the first evaluation).
        averaged_model_acc: accuracy of the averaged model (final row only; None otherwise).
        consensus_distance: mean_i ||z_i - z_bar|| over the sampled checkpoints.
        consensus_distance_relative: consensus_distance / ||z_bar||.
        peers: checkpoints sampled.
    """

    elapsed_s: float
    round: float
    mb_sent_per_peer: float
    mean_peer_acc: float | None
    averaged_model_acc: float | None
    consensus_distance: float
    consensus_distance_relative: float | None
    peers: int


@dataclass
class _Seen:
    mtime_ns: int
    round: int
    z: Any  # torch.Tensor


class History:
    """Samples of a running fleet (see the module docstring)."""

    def __init__(self, every_s: float = DEFAULT_EVERY_S) -> None:
        self.every_s = every_s
        self.samples: list[Sample] = []
        self._seen: dict[Path, _Seen] = {}
        self._last = -math.inf
        self._loaded: threading.Event | None = None

    def load_in_background(self) -> None:
        """Import what reading checkpoints needs (torch) in a thread; :meth:`sample` samples nothing until then."""
        self._loaded = threading.Event()
        loaded = self._loaded

        def load() -> None:
            try:
                importlib.import_module("peer.runtime.state")
            finally:
                loaded.set()  # a failed import fails again, and loudly, at the first sample

        threading.Thread(target=load, name="history-imports", daemon=True).start()

    def sample(self, daemons: list[Daemon], elapsed_s: float) -> Sample | None:
        """Record a sample if ``every_s`` passed since the last one and some checkpoint is new; returns it."""
        if elapsed_s - self._last < self.every_s or (self._loaded is not None and not self._loaded.is_set()):
            return None
        self._last = elapsed_s
        if not self._read(daemons):
            return None
        from peer.runtime import state

        seen = [self._seen[d.state_dir] for d in daemons if d.state_dir in self._seen]
        zs = [s.z for s in seen]
        distance = state.consensus_distance(zs)
        norm = float(state.average_model(zs).norm())
        accs = [d.seen.evals[-1]["test_acc"] for d in daemons if d.seen.evals]
        row = Sample(elapsed_s=elapsed_s, round=sum(s.round for s in seen) / len(seen),
                     mb_sent_per_peer=sum(d.seen.bytes_total("bytes_sent") for d in daemons) / len(daemons) / 1e6,
                     mean_peer_acc=sum(accs) / len(accs) if accs else None, averaged_model_acc=None,
                     consensus_distance=distance, consensus_distance_relative=distance / norm if norm > 0 else None,
                     peers=len(seen))
        self.samples.append(row)
        return row

    def _read(self, daemons: list[Daemon]) -> bool:
        """Load the checkpoints that changed since the last read; whether any did."""
        from peer.runtime import state

        changed = False
        for d in daemons:
            path = d.state_dir / CHECKPOINT_NAME
            try:
                mtime = path.stat().st_mtime_ns
            except FileNotFoundError:
                continue  # none yet, or a write is swapping the files
            if d.state_dir in self._seen and self._seen[d.state_dir].mtime_ns == mtime:
                continue
            try:
                saved, _, _ = state.load_newest(path, d.state_dir / PREVIOUS_CHECKPOINT_NAME)
            except state.CheckpointError:
                continue
            self._seen[d.state_dir] = _Seen(mtime, int(saved["round"]), state.debiased(saved))
            changed = True
        return changed

    def add_final(self, summary: dict[str, Any]) -> Sample:
        """The last row: the final checkpoints' evaluation (averaged model included) and the last status bytes."""
        peers = summary["per_peer"]
        accs = [p["final_test_acc"] for p in peers if p["final_test_acc"] is not None]
        row = Sample(elapsed_s=summary["wall_s"], round=sum(p["rounds"] for p in peers) / len(peers),
                     mb_sent_per_peer=sum(p["bytes_sent"] for p in peers) / len(peers) / 1e6,
                     mean_peer_acc=sum(accs) / len(accs) if accs else None,
                     averaged_model_acc=summary["averaged_model_acc"],
                     consensus_distance=summary["consensus_distance"],
                     consensus_distance_relative=summary["consensus_distance_relative"], peers=len(accs))
        self.samples.append(row)
        return row

    def rows(self) -> list[dict[str, Any]]:
        return [asdict(s) for s in self.samples]

    def write_csv(self, path: Path) -> Path:
        with path.open("w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=[f.name for f in fields(Sample)])
            writer.writeheader()
            writer.writerows(self.rows())
        return path


def curves(samples: list[Sample]) -> tuple[list[Series], list[Series]]:
    """(accuracy, consensus) series of the fleet's samples: the mean of the peers' own accuracies, the averaged
    model where it was evaluated (the final row), and the consensus distance."""
    def series(label: str, points: list[tuple[Sample, float]]) -> Series:
        return Series(label, [s.round for s, _ in points], [s.mb_sent_per_peer for s, _ in points],
                      [value for _, value in points])

    accuracy = [series("mean of the peers' own evaluations",
                       [(s, s.mean_peer_acc) for s in samples if s.mean_peer_acc is not None]),
                series("averaged model (final checkpoints)",
                       [(s, s.averaged_model_acc) for s in samples if s.averaged_model_acc is not None])]
    consensus = [series("consensus distance", [(s, s.consensus_distance) for s in samples])]
    return accuracy, consensus


def plot_history(samples: list[Sample], path: Path, title: str) -> Path:
    """fleet.png: the four panels of peer/plots.py over the samples.

    Raises:
        PlotUnavailable: matplotlib is not installed.
    """
    accuracy, consensus = curves(samples)
    return write_learning_curves(path, accuracy, consensus, title)
