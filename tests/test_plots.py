"""Learning-curve PNGs (peer/plots.py) of the simulator and the fleet: four panels - accuracy and consensus
distance, each over rounds and over MB sent - fed the runs' own series; a one-line note without matplotlib."""

from __future__ import annotations

import struct
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner

from peer.cli.main import cli
from peer.config import DataSpec, ModelSpec, RunSpec
from peer.fleet.history import History, plot_history
from peer.fleet.history import curves as fleet_curves
from peer.fleet.launch import Daemon
from peer.plots import DPI, FIGSIZE, MISSING, PANELS, Series, learning_curves
from peer.sim.results import curves as sim_curves
from peer.sim.results import write_results
from peer.sim.simulation import EpochRow
from peer.sim.transport import ChaosSpec
from tests.status_helpers import neighbour_json, status_document

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SIZE = (int(FIGSIZE[0] * DPI), int(FIGSIZE[1] * DPI))


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk, after checking the signature."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def drawn(fig) -> list[dict]:
    """What each panel of a figure shows: axis labels and every line's (label, xs, ys)."""
    return [{"x": ax.get_xlabel(), "y": ax.get_ylabel(), "scale": ax.get_yscale(),
             "lines": [(ln.get_label(), list(map(float, ln.get_xdata())), list(map(float, ln.get_ydata())))
                       for ln in ax.get_lines()]} for ax in fig.get_axes()]


def rows() -> list[EpochRow]:
    return [EpochRow(epoch=e, round=10 * e, avg_model_acc=0.5 + 0.1 * e, mean_peer_acc=0.45 + 0.1 * e,
                     train_loss=1.0 / e, bytes_per_peer=2.5e6 * e, consensus_distance=0.8 / e ** 2, wall_s=e)
            for e in (1, 2, 3)]


def test_four_panels_accuracy_and_consensus_over_rounds_and_bytes() -> None:
    acc = [Series("a", [1, 2, 3], [0.1, 0.2, 0.3], [0.5, 0.6, float("nan")])]
    cons = [Series("c", [1, 2, 3], [0.1, 0.2, 0.3], [1.0, 0.1, 0.01])]
    fig = learning_curves(acc, cons, "t")
    try:
        panels = drawn(fig)
    finally:
        import matplotlib.pyplot as plt
        plt.close(fig)
    assert len(panels) == 4 == len(PANELS)
    assert [(p["x"], p["y"].split()[0]) for p in panels] == [
        ("round", "test"), ("MB sent per peer", "test"), ("round", "consensus"), ("MB sent per peer", "consensus")]
    assert panels[0]["lines"] == [("a", [1.0, 2.0], [50.0, 60.0])]  # percent; the NaN point is left out
    assert panels[1]["lines"] == [("a", [0.1, 0.2], [50.0, 60.0])]
    assert panels[2]["lines"] == [("c", [1.0, 2.0, 3.0], [1.0, 0.1, 0.01])] and panels[2]["scale"] == "log"
    assert panels[3]["lines"][0][1] == [0.1, 0.2, 0.3]


def test_simulator_png_holds_its_rows(tmp_path: Path) -> None:
    sim = SimpleNamespace(n_peers=3, chaos=ChaosSpec(), precision=SimpleNamespace(backend="fp32", reason="asked"),
                          recoveries=[])
    note = write_results(tmp_path, RunSpec(), sim, rows(), 0.5, plot=True)
    assert note is None
    assert png_size(tmp_path / "results.png") == SIZE
    fig = learning_curves(*sim_curves(rows()), "t")
    panels = drawn(fig)
    import matplotlib.pyplot as plt
    plt.close(fig)
    rounds, mb = [10.0, 20.0, 30.0], [2.5, 5.0, 7.5]
    assert panels[0]["lines"] == [("averaged model", rounds, [60.0, 70.0, 80.0]),
                                  ("mean per peer", rounds, pytest.approx([55.0, 65.0, 75.0]))]
    assert [ln[1] for ln in panels[1]["lines"]] == [mb, mb]
    assert panels[2]["lines"] == [("consensus distance", rounds, pytest.approx([0.8, 0.2, 0.8 / 9]))]
    assert panels[3]["lines"][0][1] == mb


def test_without_matplotlib_one_line_and_no_png(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    sim = SimpleNamespace(n_peers=2, chaos=ChaosSpec(), precision=SimpleNamespace(backend="fp32", reason="asked"),
                          recoveries=[])
    assert write_results(tmp_path, RunSpec(), sim, rows(), 0.5, plot=True) == MISSING
    assert (tmp_path / "results.csv").exists() and not (tmp_path / "results.png").exists()
    assert "\n" not in MISSING and "--no-plot" in MISSING and "lpdl-peer[plot]" in MISSING


def test_simulate_command_writes_the_png(tmp_path: Path) -> None:
    out = tmp_path / "sim"
    result = CliRunner().invoke(cli, ["simulate", "--peers", "2", "--dataset", "synthetic", "--precision", "fp32",
                                      "--epochs", "1", "--threads", "1", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert png_size(out / "results.png") == SIZE


def test_simulate_without_matplotlib_says_so_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    result = CliRunner().invoke(cli, ["simulate", "--peers", "2", "--dataset", "synthetic", "--precision", "fp32",
                                      "--epochs", "0.5", "--threads", "1", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert MISSING in result.output and "Traceback" not in result.output
    assert not (tmp_path / "results.png").exists() and (tmp_path / "results.json").exists()


def _fleet_daemon(tmp_path: Path, index: int, sent: int, acc: float | None) -> Daemon:
    d = Daemon(index, f"f-p{index}", tmp_path / f"peer-{index}", tmp_path / f"peer-{index}.log",
               proc=SimpleNamespace(poll=lambda: 0, returncode=0))  # type: ignore[arg-type]
    ev = {} if acc is None else {"round": 31, "epoch": 1.0, "test_loss": 0.5, "test_acc": acc}
    d.seen.observe(status_document(round=31, last_round_s=0.1, eval=ev,
                                   neighbours={"x": neighbour_json(bytes_sent=sent)}), now=1.0, elapsed_s=1.0)
    return d


def test_fleet_history_samples_checkpoints_and_plots_them(tmp_path: Path) -> None:
    """Two peers' checkpoints z_1, z_2 = z_1 + 0.01: the sample's consensus distance is ||z_1 - z_2|| / 2
    (docs/method.md#measurements), bytes and accuracies are the peers' means, and fleet.png shows the samples."""
    from peer.daemon.paths import CHECKPOINT_NAME
    from peer.data import load_dataset
    from peer.runtime import state
    from peer.runtime.build import build_peer, build_peer_model

    spec = RunSpec(model=ModelSpec(precision="fp32"), data=DataSpec(dataset="synthetic"))
    splits = load_dataset("synthetic")
    built = build_peer_model(spec.model, splits, torch.device("cpu"))
    daemons = [_fleet_daemon(tmp_path, 0, 2_000_000, 0.8), _fleet_daemon(tmp_path, 1, 4_000_000, None)]
    history = History(every_s=5.0)
    assert history.sample(daemons, 10.0) is None  # no checkpoint yet
    z = None
    for i, d in enumerate(daemons):
        peer = build_peer(spec, d.peer_id, (i, 2), splits, torch.device("cpu"), built)
        z = peer.flat.z.detach().clone() if z is None else z
        peer.engine.state.x.copy_((z + 0.01 * i) * 0.5)
        peer.engine.state.w = 0.5
        state.save(peer, d.state_dir / CHECKPOINT_NAME, 31 + i, {}, built.fingerprint)
    assert history.sample(daemons, 12.0) is None  # within every_s of the last try
    s = history.sample(daemons, 15.0)
    assert s is not None and s.peers == 2 and s.round == 31.5
    assert s.consensus_distance == pytest.approx(float((0.01 * torch.ones_like(z)).norm()) / 2, rel=1e-3)
    assert s.mb_sent_per_peer == 3.0 and s.mean_peer_acc == 0.8 and s.averaged_model_acc is None
    assert history.sample(daemons, 30.0) is None  # nothing changed since
    final = history.add_final({"wall_s": 40.0, "averaged_model_acc": 0.85, "consensus_distance": 0.01,
                               "consensus_distance_relative": 0.001,
                               "per_peer": [{"final_test_acc": 0.84, "rounds": 40, "bytes_sent": 5_000_000},
                                            {"final_test_acc": 0.86, "rounds": 42, "bytes_sent": 7_000_000}]})
    assert (final.round, final.mb_sent_per_peer, final.mean_peer_acc) == (41.0, 6.0, pytest.approx(0.85))
    csv_text = history.write_csv(tmp_path / "history.csv").read_text().splitlines()
    assert csv_text[0].split(",")[:3] == ["elapsed_s", "round", "mb_sent_per_peer"] and len(csv_text) == 3

    assert png_size(plot_history(history.samples, tmp_path / "fleet.png", "t")) == SIZE
    fig = learning_curves(*fleet_curves(history.samples), "t")
    panels = drawn(fig)
    import matplotlib.pyplot as plt
    plt.close(fig)
    assert len(panels) == 4
    own, averaged = panels[0]["lines"]
    assert own[1:] == ([31.5, 41.0], pytest.approx([80.0, 85.0]))
    assert averaged[1:] == ([41.0], [85.0])  # the averaged model: the final checkpoints only
    assert panels[1]["lines"][0][1] == [3.0, 6.0]
    assert panels[2]["lines"][0][2] == pytest.approx([s.consensus_distance, 0.01])
    assert panels[3]["lines"][0][1] == [3.0, 6.0]

