"""Learning curves as a PNG, for ``lpdl-peer simulate`` and ``lpdl-peer fleet``: test accuracy and consensus
distance, each over rounds and over megabytes sent per peer - four panels in a 2 x 2 figure.

matplotlib is an optional extra (``pip install 'lpdl-peer[plot]'``; the daemon never needs it): it is imported
only when a figure is drawn, and its absence raises :class:`PlotUnavailable` with a one-line message the commands
print as is.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from peer.errors import PeerError

if TYPE_CHECKING:
    from matplotlib.figure import Figure

#: Size of the figure (inches) and resolution: the PNG is 1100 x 800 pixels.
FIGSIZE = (11.0, 8.0)
DPI = 100
#: The four panels, row by row: (quantity, x axis).
PANELS = (("accuracy", "round"), ("accuracy", "mb"), ("consensus", "round"), ("consensus", "mb"))
X_LABELS = {"round": "round", "mb": "MB sent per peer"}
Y_LABELS = {"accuracy": "test accuracy %", "consensus": "consensus distance (mean ||z_i - z_bar||)"}
MISSING = "no plot written: matplotlib is not installed (pip install 'lpdl-peer[plot]', or pass --no-plot)"


class PlotUnavailable(PeerError, RuntimeError):
    """matplotlib is missing; the message is one line for the user."""

    default_reason = "plot_unavailable"


@dataclass(frozen=True)
class Series:
    """One curve, drawn against both x axes.

    Attributes:
        label: legend text.
        rounds: x values of the round panels.
        mb_sent: x values of the bytes panels (MB sent per peer).
        values: y values (accuracy in [0, 1], shown in %; consensus distance as is).
    """

    label: str
    rounds: Sequence[float]
    mb_sent: Sequence[float]
    values: Sequence[float]

    def __post_init__(self) -> None:
        if not len(self.rounds) == len(self.mb_sent) == len(self.values):
            raise ValueError(f"series {self.label!r}: rounds, mb_sent and values differ in length")

    def points(self, x: str) -> tuple[list[float], list[float]]:
        """(xs, ys) against ``x`` ("round" or "mb"), leaving out points without a value (None or NaN)."""
        xs = self.rounds if x == "round" else self.mb_sent
        keep = [(float(a), float(v)) for a, v in zip(xs, self.values)
                if a is not None and v is not None and math.isfinite(v)]
        return [a for a, _ in keep], [v for _, v in keep]


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise PlotUnavailable(MISSING) from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def learning_curves(accuracy: Sequence[Series], consensus: Sequence[Series], title: str) -> Figure:
    """The 2 x 2 figure of :data:`PANELS` (the caller closes it). Consensus panels use a log scale when every
    value is positive (consensus decays geometrically)."""
    plt = _pyplot()
    fig, grid = plt.subplots(2, 2, figsize=FIGSIZE)
    for ax, (quantity, x) in zip(grid.flat, PANELS):
        series = accuracy if quantity == "accuracy" else consensus
        scale = 100.0 if quantity == "accuracy" else 1.0
        positive = True
        for s in series:
            xs, ys = s.points(x)
            ys = [v * scale for v in ys]
            positive = positive and all(v > 0 for v in ys)
            ax.plot(xs, ys, marker="o", markersize=3, label=s.label)
        if quantity == "consensus" and positive and any(s.points(x)[1] for s in series):
            ax.set_yscale("log")
        ax.set_xlabel(X_LABELS[x])
        ax.set_ylabel(Y_LABELS[quantity])
        ax.grid(alpha=0.3)
        if series:
            ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def write_learning_curves(path: Path, accuracy: Sequence[Series], consensus: Sequence[Series], title: str) -> Path:
    """Draw :func:`learning_curves` into ``path`` (PNG, :data:`FIGSIZE` x :data:`DPI` pixels); returns it.

    Raises:
        PlotUnavailable: matplotlib is not installed.
    """
    fig = learning_curves(accuracy, consensus, title)
    try:
        fig.savefig(path, dpi=DPI)
    finally:
        _pyplot().close(fig)
    return path
