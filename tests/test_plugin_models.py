"""The user's own models through the one build path: checked against the data in one line, converted, and
fingerprinted by their structure, so peers whose model code differs refuse each other at the handshake."""

from __future__ import annotations

import shutil
import textwrap
from pathlib import Path

import pytest
import torch

from peer.config import ModelSpec
from peer.data import load_dataset
from peer.models.source import ModelSourceError
from peer.runtime.build import build_peer_model
from tests.daemon_helpers import free_ports, fleet_ca, kill_all, start_daemon

NET = """
from torch import nn

class Net(nn.Module):
    def __init__(self, num_classes, in_channels):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(in_channels, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                  nn.MaxPool2d(2), nn.Conv2d(8, 8, {kernel}, padding={pad}), nn.ReLU())
        self.head = nn.Linear(8, num_classes)

    def forward(self, x):
        return self.head(self.body(x).mean((2, 3)))
"""


def _net_file(directory: Path, kernel: int = 3) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "net.py"
    path.write_text(textwrap.dedent(NET.format(kernel=kernel, pad=kernel // 2)))
    return path


@pytest.fixture(scope="module")
def digits():
    return load_dataset("synthetic", num_classes=10, n_train=64, n_test=16, image_size=28, in_channels=1)


def test_same_code_in_two_places_is_one_model_other_code_is_another(tmp_path: Path, digits) -> None:
    a = _net_file(tmp_path / "device_a")
    b = tmp_path / "device_b" / "net.py"
    b.parent.mkdir()
    shutil.copy(a, b)
    other = _net_file(tmp_path / "device_c", kernel=5)
    prints = [build_peer_model(ModelSpec(name=f"{p}:Net", precision="fp32"), digits, torch.device("cpu")).fingerprint
              for p in (a, b, other)]
    assert prints[0] == prints[1] != prints[2]
    int8 = build_peer_model(ModelSpec(name=f"{a}:Net", precision="int8"), digits, torch.device("cpu"))
    assert int8.fingerprint == prints[0]  # the precision is not the architecture: peers of any precision average
    kept = build_peer_model(ModelSpec(name=f"{a}:Net", precision="fp32", norm="keep"), digits, torch.device("cpu"))
    assert kept.fingerprint != prints[0]  # the norm changes the parameters


def test_a_model_that_does_not_fit_the_data_is_refused_in_one_line(digits) -> None:
    with pytest.raises(ModelSourceError) as err:
        build_peer_model(ModelSpec(name="torchvision:resnet18", precision="fp32"), digits, torch.device("cpu"))
    message = str(err.value)
    assert "\n" not in message and "torchvision:resnet18" in message and "synthetic" in message
    assert "1x28x28" in message and "expects 3 input channels" in message


def test_a_model_with_another_class_count_is_refused_in_one_line(tmp_path: Path, digits) -> None:
    path = tmp_path / "fixed.py"
    path.write_text("from torch import nn\n\ndef make():\n    return nn.Sequential(nn.Flatten(), nn.Linear(784, 5))\n")
    with pytest.raises(ModelSourceError, match=r"outputs 5 classes, dataset synthetic has 10$"):
        build_peer_model(ModelSpec(name=f"{path}:make", precision="fp32"), digits, torch.device("cpu"))


def test_two_daemons_with_different_model_code_refuse_each_other_by_fingerprint(tmp_path: Path) -> None:
    ports = free_ports(2)
    ca_dir = fleet_ca(tmp_path)
    files = [_net_file(tmp_path / "code_a"), _net_file(tmp_path / "code_b", kernel=5)]
    daemons = []
    try:
        for i, (port, path) in enumerate(zip(ports, files)):
            daemons.append(start_daemon(
                tmp_path / f"d{i}", f"peer-{i:03d}", port, neighbors=[f"127.0.0.1:{ports[1 - i]}"], tls_ca=ca_dir,
                run_flags=["--model", f"{path}:Net", "--dataset", "synthetic", "--precision", "fp32"]))
        prints = [d.wait_ready()["model"]["fingerprint"] for d in daemons]
        assert prints[0] != prints[1]
        for i, d in enumerate(daemons):
            line = d.wait_log(r"ignoring peer 'peer-00\d' at \S+: fingerprint mismatch \(theirs='(\w+)', "
                              r"ours='(\w+)'\)")
            assert (line.group(1), line.group(2)) == (prints[1 - i], prints[i])
            status = d.status()
            assert status["model"]["source_kind"] == "file" and not status["neighbours"].get(f"peer-{1 - i:03d}",
                                                                                            {}).get("live")
    finally:
        kill_all(daemons)


def test_a_converted_int8_model_runs_eager_passes_unless_compiling_is_forced(tmp_path: Path, digits,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from peer.lowp import passes as passes_module
    from peer.lowp.compile_policy import ENV_EAGER

    from peer.runtime.build import CONVERTED_EAGER_WHY

    path = _net_file(tmp_path / "code")
    spec = ModelSpec(name=f"{path}:Net", precision="int8")
    monkeypatch.delenv(ENV_EAGER, raising=False)
    built = build_peer_model(spec, digits, torch.device("cpu"))
    info = built.precision.config_in_use.passes.info
    assert info.path == "eager" and "converted models" in info.reason
    assert all(m.precision.passes is built.precision.config_in_use.passes
               for m in built.model.modules() if hasattr(m, "precision"))  # the config's passes, held by every layer
    monkeypatch.setenv(ENV_EAGER, "0")  # the operator asks to compile: the passes are left to decide at first use
    assert passes_module.passes_for(CONVERTED_EAGER_WHY)._info is None
