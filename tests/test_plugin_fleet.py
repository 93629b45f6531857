"""Three real daemons train torchvision's MobileNetV3-Small in int8 on their own image folders (the bundled MNIST
digits, one folder per device, no image on two devices), gossip over loopback with mutual TLS, and the fleet's model
leaves through `lpdl-peer export`: onnxruntime agrees with a daemon's own evaluation, the 8-bit graph of the fleet's
average reaches a stated accuracy, and the safetensors file loads into a fresh torchvision model that computes what
the export's fp32 graph computes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from peer.config import DataSpec
from peer.export import export_model
from peer.export.sources import run_spec
from peer.runtime import build, state
from peer.runtime.flat import FlatModel
from tests.daemon_helpers import fleet_ca, free_ports, kill_all, start_daemon

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from digit_folders import write_digit_folders  # noqa: E402

torchvision = pytest.importorskip("torchvision")
onnxruntime = pytest.importorskip("onnxruntime", reason="the export extra provides onnxruntime")
safetensors_torch = pytest.importorskip("safetensors.torch", reason="the export extra provides safetensors")

DEVICES = 3
EPOCHS = 6
#: Stated accuracy the fleet's averaged model must reach on the 300 validation digits (10 classes: chance is 10%).
#: Dense SGP: the averaged model is then what every device holds (Choco at 99% leaves the devices apart for much
#: longer than this short run: its averaged model stayed at 27%).
MIN_ACCURACY = 0.60
#: onnxruntime's top-1 must equal the daemon's own evaluation on this share of the test images.
AGREEMENT = 0.995
#: The safetensors file holds the fp32 master weights, evaluated without the 8-bit quantization the fleet trained and
#: evaluated with (and with BatchNorm statistics measured in 8-bit): a different model, 3-13 points below the 8-bit
#: graph in the runs so far (75.7% vs 79.0%, 63.7% vs 76.3%); still far above chance.
MIN_FP32_ACCURACY = 0.40


def _top1_onnx(path: Path, batches: list) -> torch.Tensor:
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return torch.cat([torch.from_numpy(session.run(["logits"], {"input": x.numpy()})[0]).argmax(1)
                      for x, _ in batches])


def _top1(model: torch.nn.Module, batches: list) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([model.eval()(x).argmax(1) for x, _ in batches])


@pytest.mark.slow
def test_three_daemons_train_mobilenet_on_their_own_folders_and_the_model_leaves(tmp_path: Path) -> None:
    roots = write_digit_folders(tmp_path / "folders", DEVICES, per_device=600, val=300)
    ports = free_ports(DEVICES)
    ca_dir = fleet_ca(tmp_path)
    flags = ["--model", "torchvision:mobilenet_v3_small", "--norm", "keep", "--precision", "int8",
             "--dataset", "imagefolder", "--image-size", "32", "--lr", "0.05", "--warmup-epochs", "0",
             "--epochs", str(EPOCHS), "--algorithm", "sgp", "--compression", "0"]
    daemons = []
    try:
        for i, root in enumerate(roots):
            daemons.append(start_daemon(
                tmp_path / "run" / f"peer-{i}", f"peer-{i:03d}", ports[i], tls_ca=ca_dir, eval_every=40,
                neighbors=[f"127.0.0.1:{p}" for j, p in enumerate(ports) if j != i],
                run_flags=[*flags, "--data-root", str(root)], extra=["--exit-when-done"],
                env={"LPDL_LOWP_EAGER": "1"}))
        ready = [d.wait_ready(timeout_s=180) for d in daemons]
        assert all(s["model"]["source_kind"] == "torchvision" for s in ready)
        assert "100.0% of multiply-adds in 8-bit" in ready[0]["model"]["layers_summary"]
        assert [d.wait_exit(timeout_s=900) for d in daemons] == [0] * DEVICES
    finally:
        kill_all(daemons)

    # one device's own model: onnxruntime agrees with the daemon's own (int8) evaluation of it
    own = export_model(tmp_path / "run" / "peer-0", tmp_path / "own")
    ckpt = state.load(tmp_path / "run" / "peer-0" / "checkpoint.pt")
    spec = run_spec(ckpt["spec"], tmp_path)
    splits = build.load_splits(DataSpec(dataset="imagefolder", root=str(roots[0]), image_size=32))
    batches = build.test_batches(splits, torch.device("cpu"))
    daemon_model = build.build_peer_model(spec.model, splits, torch.device("cpu")).model
    with torch.no_grad():
        FlatModel(daemon_model).z.copy_(state.debiased(ckpt))
    state.load_buffers(daemon_model, ckpt["buffers"])
    agreement = float((_top1_onnx(own.files["onnx"], batches) == _top1(daemon_model, batches)).float().mean())
    print(f"device 0: onnxruntime agrees with its daemon's own int8 evaluation on {agreement:.2%}")
    assert agreement >= AGREEMENT

    # the fleet's averaged model: its 8-bit graph reaches the stated accuracy, and a fresh torchvision model takes
    # the safetensors file (the fp32 master weights) and computes what the export's fp32 graph computes
    fleet = export_model(tmp_path / "run", tmp_path / "fleet")
    fp32_graph = export_model(tmp_path / "run", tmp_path / "fleet-fp32", formats=("onnx",), numerics="fp32")
    fresh = torchvision.models.mobilenet_v3_small(num_classes=10)
    fresh.load_state_dict(safetensors_torch.load_file(str(fleet.files["safetensors"])), strict=True)
    fresh_top1, truth = _top1(fresh, batches), torch.cat([y for _, y in batches])
    fresh_acc = float((fresh_top1 == truth).float().mean())
    onnx_acc = float((_top1_onnx(fleet.files["onnx"], batches) == truth).float().mean())
    fresh_vs_graph = float((_top1_onnx(fp32_graph.files["onnx"], batches) == fresh_top1).float().mean())
    card = json.loads(fleet.card_path.read_text())
    print(f"fleet of {DEVICES}: averaged model {onnx_acc:.1%} (onnxruntime, 8-bit graph), {fresh_acc:.1%} (its "
          f"fp32 master weights in a fresh torchvision model, which agrees with the fp32 graph on "
          f"{fresh_vs_graph:.2%}); export {card['export_s']:.1f} s, "
          f"{ {k: v['bytes'] for k, v in card['files'].items()} }")
    assert onnx_acc >= MIN_ACCURACY and fresh_vs_graph >= AGREEMENT and fresh_acc >= MIN_FP32_ACCURACY
    assert card["origin"]["kind"] == "average" and card["source"]["ref"] == "torchvision:mobilenet_v3_small"
