"""The three examples of examples/ run as a user runs them (real processes, the bundled digits), shortened."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def _run(argv: list[str], cwd: Path, timeout: float = 300) -> str:
    # eager 8-bit passes: compiling them would cost more than these short runs train (README, Precision)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(EXAMPLES)]), "OMP_NUM_THREADS": "1",
           "LPDL_LOWP_EAGER": "1"}
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{argv} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout + done.stderr


def test_python_api_example_trains_a_fleet_of_its_own_model(tmp_path: Path) -> None:
    out = _run([sys.executable, str(EXAMPLES / "python_api.py"), "--epochs", "0.4", "--peers", "2"], tmp_path)
    accuracies = [float(a) for a in re.findall(r"averaged model ([\d.]+)%", out)]
    assert accuracies and accuracies[-1] > 30.0, out  # 10 classes: chance is 10%


def test_user_model_file_outside_the_package_trains_in_int8(tmp_path: Path) -> None:
    _run([sys.executable, "-m", "peer.cli.main", "train", "--model", f"{EXAMPLES / 'user_model' / 'net.py'}:SmallNet",
          "--model-options", "width=8", "--max-steps", "60", "--epochs", "1", "--warmup-epochs", "0",
          "--precision", "int8",
          "--out", str(tmp_path / "run")], tmp_path)
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["model"]["source_kind"] == "file"
    assert "multiply-adds in 8-bit" in metrics["model"]["layers_summary"]
    assert metrics["epochs"][-1]["test_acc"] > 0.2


@pytest.mark.slow
def test_mobilenet_on_an_image_folder_example(tmp_path: Path) -> None:
    _run([sys.executable, str(EXAMPLES / "mobilenet_imagefolder.py"), "--max-steps", "20",
          "--out", str(tmp_path / "run")], tmp_path)
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["model"]["source"] == "torchvision:mobilenet_v3_small"
    assert metrics["spec"]["data"]["dataset"] == "imagefolder" and (tmp_path / "run" / "checkpoint.pt").exists()
