"""``lpdl-peer export`` / peer.export.export_model: real files, read back by real consumers.

onnxruntime runs the ONNX file on the whole test set and its top-1 is compared with the daemon's own evaluation of
the checkpoint; the safetensors file is loaded with ``strict=True`` into a freshly built model; the TorchScript file
is loaded with ``torch.jit.load``. Sources: a trained checkpoint (fp32, int8: the graphs in its 8-bit numerics by
default, in fp32 on request), the average of several checkpoints (against state.average_model), a live daemon over
mutual TLS (GetModel), a plug-in model file trained in int8, and failures naming their cause.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from torch import nn

from peer.cli.main import cli
from peer.config import DataSpec, GossipSpec, ModelSpec, OptimSpec, RunSpec
from peer.export import ExportError, export_model
from peer.export.formats import write_onnx, write_torchscript
from peer.export.numerics import check_ranges, inlined_for_tracing
from peer.lowp.layers import QConv2d, QLinear, _Sim8ProductFn
from peer.lowp.precision import PrecisionConfig
from peer.models import build_model
from peer.runtime import build, state
from peer.runtime.evaluation import evaluate
from peer.runtime.flat import FlatModel
from peer.security import ca
from peer.security.identity import ROLE_OPERATOR
from peer.train import run_training
from tests.daemon_helpers import fleet_ca, free_ports, start_daemon

onnxruntime = pytest.importorskip("onnxruntime")
safetensors_torch = pytest.importorskip("safetensors.torch")

#: Local steps of the trained checkpoints: enough to be far from the initial model (~80% on mnist5k).
STEPS = 30
#: Share of the test set on which onnxruntime's top-1 must equal the PyTorch evaluation's.
AGREEMENT = 0.995
#: Largest |accuracy difference| between an 8-bit model's fp32 master weights (the safetensors file in the user's
#: class) and the daemon's 8-bit evaluation: the quantization moves a few percent of the top-1 answers both ways.
FP32_VS_8BIT_ACC = 0.03


def mnist_spec(precision: str) -> RunSpec:
    return RunSpec(model=ModelSpec(name="mnist-cnn", precision=precision, norm="range-evonorm"),
                   data=DataSpec(dataset="mnist5k", batch_size=32, seed=0),
                   optim=OptimSpec(lr=0.01, epochs=1.0, warmup_epochs=0.0),
                   gossip=GossipSpec(algorithm="sgp", compression=0.0, bits=32))


def trained(root: Path, spec: RunSpec, steps: int = STEPS) -> Path:
    run_training(spec, torch.device("cpu"), root, max_steps=steps)
    return root


@pytest.fixture(scope="module")
def fp32_run(tmp_path_factory: pytest.TempPathFactory, one_torch_thread) -> Path:
    return trained(tmp_path_factory.mktemp("fp32"), mnist_spec("fp32"))


@pytest.fixture(scope="module")
def int8_run(tmp_path_factory: pytest.TempPathFactory, one_torch_thread) -> Path:
    return trained(tmp_path_factory.mktemp("int8"), mnist_spec("int8"))


@pytest.fixture(scope="module")
def mnist_test(fp32_run: Path) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The normalised mnist5k test split, as the daemon evaluates it."""
    return build.test_batches(build.load_splits(mnist_spec("fp32").data), torch.device("cpu"))


# --- consumers ---------------------------------------------------------------------------------------------------
def daemon_model(ckpt: dict, spec: RunSpec, z: torch.Tensor | None = None) -> nn.Module:
    """The model the daemon evaluates (its own precision), holding the checkpoint's z (or ``z``)."""
    built = build.build_peer_model(spec.model, build.load_splits(spec.data), torch.device("cpu"), seed=spec.data.seed)
    flat = FlatModel(built.model)
    with torch.no_grad():
        flat.z.copy_(state.debiased(ckpt) if z is None else z)
    state.load_buffers(built.model, ckpt["buffers"])
    return built.model.eval()


def torch_top1(model: nn.Module, batches: list) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return torch.cat([model(x).argmax(dim=1) for x, _ in batches])


def onnx_top1(path: Path, batches: list) -> torch.Tensor:
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return torch.cat([torch.from_numpy(session.run(["logits"], {"input": x.numpy()})[0]).argmax(dim=1)
                      for x, _ in batches])


def labels(batches: list) -> torch.Tensor:
    return torch.cat([y for _, y in batches])


def agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    """Share of the test set on which two top-1 answers agree."""
    return float((a == b).float().mean())


def fresh_registry_model(card: dict) -> nn.Module:
    """mnist-cnn as anyone builds it from the registry (fp32), for the safetensors file."""
    return build_model("mnist-cnn", num_classes=card["data"]["num_classes"],
                       in_channels=card["data"]["input_shape"][0], norm=card["norm"],
                       precision=PrecisionConfig("fp32"), groups=card["groups"])


def check_files(result) -> None:
    """Every file the card lists exists with the size and sha256 it says."""
    for entry in result.card["files"].values():
        data = (result.out_dir / entry["file"]).read_bytes()
        assert len(data) == entry["bytes"] and hashlib.sha256(data).hexdigest() == entry["sha256"]
    assert json.loads(result.card_path.read_text()) == result.card


# --- (a) a trained checkpoint ------------------------------------------------------------------------------------
def check_checkpoint_export(run: Path, out: Path, batches: list, precision: str, numerics: str = "trained",
                            via_cli: bool = False) -> dict:
    """Export ``run``'s checkpoint (with ``lpdl-peer export`` where ``via_cli``) and read every file back; the graphs
    must agree with the daemon's own evaluation where they compute its numerics, else with the fp32 model. Returns
    the figures for the report."""
    if via_cli:
        done = CliRunner().invoke(cli, ["export", str(run), "--out", str(out), "--numerics", numerics])
        assert done.exit_code == 0, done.output
        card = json.loads((out / "card.json").read_text())
        assert f"graphs compute {card['precision']['graph_numerics']}" in done.output
        files = {fmt: out / entry["file"] for fmt, entry in card["files"].items()}
    else:
        result = export_model(run, out, numerics=numerics)
        check_files(result)
        card, files = result.card, result.files
    ckpt = state.load(run / "checkpoint.pt")
    eight_bit = numerics == "trained" and precision != "fp32"
    assert set(card["files"]) == {"safetensors", "torchscript", "onnx"}
    assert card["source"] == {"ref": "mnist-cnn", "kind": "registry", "options": []}
    assert card["fingerprint"] == ckpt["fingerprint"] and card["round"] == ckpt["round"]
    assert card["test_acc"] == ckpt["info"]["test_acc"]
    assert card["precision"]["trained_in"] == precision and card["norm"] == "range-evonorm"
    assert card["precision"]["numerics"] == numerics and card["precision"]["files"] == "fp32"
    assert card["precision"]["graph_numerics"] == (
        "8-bit (fake-quantized weights and activations, as evaluated in training)" if eight_bit
        else "fp32 (as trained)" if precision == "fp32" else
        "fp32 (the master weights without the 8-bit quantization the model was trained and evaluated with)")
    assert card["data"]["input_shape"] == [1, 28, 28]
    assert card["input"]["normalization"]["mean"] == pytest.approx([0.1307])
    assert card["input"]["normalization"]["in_graph"] is False
    assert card["state_dict"]["loads_into_source"] is True

    # the daemon's own evaluation of the checkpoint (its precision), and the fp32 master weights in a fresh model
    daemon = daemon_model(ckpt, mnist_spec(precision))
    daemon_acc = evaluate(daemon, batches)[1]
    assert daemon_acc == pytest.approx(ckpt["info"]["test_acc"])
    daemon_top1 = torch_top1(daemon, batches)
    fresh = fresh_registry_model(card)
    fresh.load_state_dict(safetensors_torch.load_file(str(files["safetensors"])), strict=True)
    fresh_top1 = torch_top1(fresh, batches)

    onnx = onnx_top1(files["onnx"], batches)
    scripted = torch.jit.load(str(files["torchscript"]))
    script_top1 = torch_top1(scripted, batches)
    reference = daemon_top1 if eight_bit else fresh_top1
    assert agreement(onnx, reference) >= AGREEMENT
    assert agreement(script_top1, reference) >= AGREEMENT
    y = labels(batches)
    return {"onnx_vs_daemon": agreement(onnx, daemon_top1), "onnx_vs_fp32": agreement(onnx, fresh_top1),
            "torchscript_vs_daemon": agreement(script_top1, daemon_top1),
            "fp32_vs_daemon": agreement(fresh_top1, daemon_top1), "onnx_acc": agreement(onnx, y),
            "fp32_acc": agreement(fresh_top1, y), "daemon_acc": daemon_acc, "export_s": card["export_s"],
            "bytes": {k: v["bytes"] for k, v in card["files"].items()}}


def test_fp32_checkpoint_exports_to_files_onnxruntime_and_a_fresh_model_agree_on(fp32_run: Path, mnist_test: list,
                                                                                 tmp_path: Path) -> None:
    figures = check_checkpoint_export(fp32_run, tmp_path / "out", mnist_test, "fp32")
    # fp32: the daemon evaluates the very model exported
    assert figures["onnx_vs_daemon"] >= AGREEMENT
    assert figures["onnx_acc"] == pytest.approx(figures["daemon_acc"], abs=1 - AGREEMENT)
    print("mnist-cnn fp32 export:", figures)


def test_int8_checkpoint_graphs_compute_its_8bit_numerics(int8_run: Path, mnist_test: list, tmp_path: Path) -> None:
    """An int8 peer's graphs compute its 8-bit numerics (sim8 twin): onnxruntime and TorchScript agree with the
    daemon's own int8 evaluation on >= 99.5%; the safetensors file (fp32 master weights) gives about its accuracy in
    a fresh registry model."""
    figures = check_checkpoint_export(int8_run, tmp_path / "out", mnist_test, "int8")
    assert figures["onnx_vs_daemon"] >= AGREEMENT and figures["torchscript_vs_daemon"] >= AGREEMENT
    assert figures["fp32_acc"] == pytest.approx(figures["daemon_acc"], abs=FP32_VS_8BIT_ACC)
    print("mnist-cnn int8 export, 8-bit graphs:", figures)


def test_int8_checkpoint_exports_fp32_graphs_on_request(int8_run: Path, mnist_test: list, tmp_path: Path) -> None:
    """``--numerics fp32``: the graphs of the fp32 master weights (agreeing with the fp32 model on >= 99.5%); the
    safetensors file holds the same tensors whatever the numerics (not the same bytes: safetensors writes its
    metadata in a varying order)."""
    figures = check_checkpoint_export(int8_run, tmp_path / "out", mnist_test, "int8", numerics="fp32", via_cli=True)
    assert figures["onnx_vs_fp32"] >= AGREEMENT
    trained_numerics = export_model(int8_run, tmp_path / "trained", formats=("safetensors",))
    fp32_weights = safetensors_torch.load_file(str(tmp_path / "out" / "model.safetensors"))
    weights = safetensors_torch.load_file(str(trained_numerics.files["safetensors"]))
    assert weights.keys() == fp32_weights.keys() and all(torch.equal(weights[k], fp32_weights[k]) for k in weights)
    print("mnist-cnn int8 export, fp32 graphs:", figures)


def test_cli_exports_a_state_directory(fp32_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "cli"
    result = CliRunner().invoke(cli, ["export", str(fp32_run), "--out", str(out), "--formats", "safetensors,onnx"])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == ["card.json", "model.onnx", "model.safetensors"]
    assert "state dict loads into peer.models.build_model('mnist-cnn'" in result.output
    assert "fingerprint" in result.output and "model.onnx" in result.output
    assert "graphs compute fp32 (as trained)" in result.output


def test_normalisation_in_the_graph_takes_pixels_on_the_0_1_scale(fp32_run: Path, mnist_test: list,
                                                                  tmp_path: Path) -> None:
    result = export_model(fp32_run, tmp_path / "norm", formats=("onnx",), normalize_in_graph=True)
    assert result.card["input"]["normalization"]["in_graph"] is True
    raw = [(x * 0.3081 + 0.1307, y) for x, y in mnist_test[:4]]  # back to the 0..1 scale
    plain = export_model(fp32_run, tmp_path / "plain", formats=("onnx",))
    assert torch.equal(onnx_top1(result.files["onnx"], raw), onnx_top1(plain.files["onnx"], mnist_test[:4]))


# --- (b) the average of several checkpoints ------------------------------------------------------------------------
def fake_fleet(run_dir: Path, ckpt: dict, n: int = 3) -> list[torch.Tensor]:
    """``n`` peers' checkpoints around ``ckpt``'s model, each with its own push-sum weight; returns their z."""
    zs = []
    for i in range(n):
        peer = {**ckpt, "peer_id": f"peer-{i:03d}", "round": 10 + i, "engine": dict(ckpt["engine"])}
        z = state.debiased(ckpt) + 0.01 * torch.randn(ckpt["engine"]["x"].shape,
                                                        generator=torch.Generator().manual_seed(i))
        w = torch.tensor(0.5 + 0.5 * i, dtype=ckpt["engine"]["w"].dtype) if torch.is_tensor(ckpt["engine"]["w"]) \
            else 0.5 + 0.5 * i
        peer["engine"]["x"], peer["engine"]["w"] = z * w, w
        state.save_atomic(peer, run_dir / f"peer-{i}" / "checkpoint.pt")
        zs.append(state.debiased(peer))
    return zs


def test_run_directory_exports_the_average_of_its_checkpoints(fp32_run: Path, mnist_test: list,
                                                              tmp_path: Path) -> None:
    ckpt = state.load(fp32_run / "checkpoint.pt")
    run_dir = tmp_path / "run"
    zs = fake_fleet(run_dir, ckpt)
    (run_dir / "summary.json").write_text(json.dumps({"averaged_model_acc": 0.5}))
    result = export_model(run_dir, run_dir / "export")
    card = result.card
    assert card["origin"]["kind"] == "average" and len(card["origin"]["peers"]) == 3
    assert card["round"] == 12 and card["test_acc"] == 0.5
    z_bar = state.average_model(zs)
    fresh = fresh_registry_model(card)
    fresh.load_state_dict(safetensors_torch.load_file(str(result.files["safetensors"])), strict=True)
    assert torch.allclose(FlatModel(fresh).z, z_bar, atol=1e-6)
    averaged = daemon_model(ckpt, mnist_spec("fp32"), z_bar)
    assert float((onnx_top1(result.files["onnx"], mnist_test) == torch_top1(averaged, mnist_test)).float().mean()) \
        >= AGREEMENT


def test_checkpoints_of_different_models_are_not_averaged(fp32_run: Path, tmp_path: Path) -> None:
    ckpt = state.load(fp32_run / "checkpoint.pt")
    fake_fleet(tmp_path / "run", ckpt, n=2)
    other = state.load(tmp_path / "run" / "peer-1" / "checkpoint.pt")
    state.save_atomic({**other, "fingerprint": "0" * 16}, tmp_path / "run" / "peer-1" / "checkpoint.pt")
    with pytest.raises(ExportError, match="fingerprint 0000000000000000 differs"):
        export_model(tmp_path / "run", tmp_path / "out")


def test_fleet_exports_its_averaged_model_and_reports_a_failure_in_one_line(fp32_run: Path, tmp_path: Path) -> None:
    from peer.fleet.run import EXPORT_DIR_NAME, export_averaged

    run_dir = tmp_path / "run"
    fake_fleet(run_dir, state.load(fp32_run / "checkpoint.pt"), n=2)
    done = export_averaged(run_dir, 0.42)
    assert done["dir"] == str(run_dir / EXPORT_DIR_NAME) and done["loads_into_source"] is True
    assert set(done["bytes"]) == {"safetensors", "torchscript", "onnx"}
    card = json.loads((run_dir / EXPORT_DIR_NAME / "card.json").read_text())
    assert card["test_acc"] == 0.42 and card["origin"]["kind"] == "average"
    (tmp_path / "empty").mkdir()
    failed = export_averaged(tmp_path / "empty", None)
    assert list(failed) == ["error"] and "no checkpoint.pt" in failed["error"] and "\n" not in failed["error"]


# --- bad input: one line naming the cause ----------------------------------------------------------------------------
def test_bad_sources_are_refused_in_one_line(fp32_run: Path, tmp_path: Path) -> None:
    ckpt = state.load(fp32_run / "checkpoint.pt")
    with pytest.raises(ExportError, match="no such state or run directory"):
        export_model(tmp_path / "missing", tmp_path / "out")
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    with pytest.raises(ExportError, match="no checkpoint.pt in it nor in any subdirectory"):
        export_model(tmp_path / "empty", tmp_path / "out")
    state.save_atomic({**ckpt, "schema": 1}, tmp_path / "old" / "checkpoint.pt")
    with pytest.raises(ExportError, match="schema 1, this version reads schema"):
        export_model(tmp_path / "old", tmp_path / "out")
    state.save_atomic({**ckpt, "info": {}}, tmp_path / "noinfo" / "checkpoint.pt")
    with pytest.raises(ExportError, match="holds no model info"):
        export_model(tmp_path / "noinfo", tmp_path / "out")
    spec = {**ckpt["spec"], "model": {**ckpt["spec"]["model"], "name": "python:make_net"}}
    state.save_atomic({**ckpt, "spec": spec}, tmp_path / "code" / "checkpoint.pt")
    with pytest.raises(ExportError, match="given in code as a callable.*model=factory"):
        export_model(tmp_path / "code", tmp_path / "out")
    with pytest.raises(ExportError, match="formats: expected some of"):
        export_model(fp32_run, tmp_path / "out", formats=("tflite",))
    with pytest.raises(ExportError, match="numerics: expected one of trained, fp32, got 'int4'"):
        export_model(fp32_run, tmp_path / "out", numerics="int4")
    result = CliRunner().invoke(cli, ["export", str(tmp_path / "missing"), "--out", str(tmp_path / "out")])
    assert result.exit_code == 1 and result.output.strip().splitlines() == [
        f"Error: {tmp_path / 'missing'}: no such state or run directory"]


# --- (d) a forward that cannot be traced names its layer -------------------------------------------------------------
class _Sign(torch.autograd.Function):
    """A custom autograd Function computed in NumPy: traces as a Python call, which neither format can hold."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(np.sign(x.detach().numpy()))

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


class SignAct(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sign.apply(x)


class BatchBranch(nn.Module):
    """A Python branch on the input (its batch size): tracing freezes the branch the trace input took, so the graph
    disagrees with the model on the check input (batch 3, the trace's 2)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 0 if x.size(0) > 2 else x


def small_net(middle: nn.Module) -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.Sequential(nn.ReLU(), middle), nn.Flatten(),
                         nn.Linear(4 * 8 * 8, 10)).eval()


@pytest.mark.parametrize("writer", [write_torchscript, write_onnx], ids=["torchscript", "onnx"])
@pytest.mark.parametrize("middle", [SignAct, BatchBranch])
def test_untraceable_layer_is_named(writer, middle: type, tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    example, check = torch.randn(2, 1, 8, 8, generator=g), torch.randn(3, 1, 8, 8, generator=g)
    path = tmp_path / "model"
    with pytest.raises(ExportError, match=rf"layer '1\.1' \({middle.__name__}\)"):
        writer(small_net(middle()), example, check, path)
    assert not path.exists()


def test_traceable_model_writes_both_graphs(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    example, check = torch.randn(2, 1, 8, 8, generator=g), torch.randn(3, 1, 8, 8, generator=g)
    assert write_torchscript(small_net(nn.Identity()), example, check, tmp_path / "m.pt") < 1e-5
    assert write_onnx(small_net(nn.Identity()), example, check, tmp_path / "m.onnx") < 1e-5


def sim8_net(trained_steps: int) -> nn.Module:
    """A small sim8 network after ``trained_steps`` training-mode forwards (which set its activation ranges)."""
    p = PrecisionConfig("sim8", 8)
    net = nn.Sequential(QConv2d(1, 4, 3, padding=1, precision=p), nn.ReLU(), nn.Flatten(),
                        QLinear(4 * 8 * 8, 10, precision=p))
    g = torch.Generator().manual_seed(1)
    for _ in range(trained_steps):
        net(torch.randn(8, 1, 8, 8, generator=g))
    return net.eval()


def test_sim8_layers_trace_into_both_graphs_in_their_eval_numerics(tmp_path: Path) -> None:
    """The sim8 product Function, untraceable as such, is inlined while tracing: both graphs equal the model's eval
    forward (running ranges: the check input's other batch size gives the same per-sample outputs)."""
    g = torch.Generator().manual_seed(0)
    example, check = torch.randn(2, 1, 8, 8, generator=g), torch.randn(3, 1, 8, 8, generator=g)
    net = sim8_net(trained_steps=3)
    assert write_torchscript(net, example, check, tmp_path / "m.pt") < 1e-5
    assert write_onnx(net, example, check, tmp_path / "m.onnx") < 1e-5
    with torch.no_grad():
        assert torch.equal(net(check)[:2], net(torch.cat([check[:2], example]))[:2])  # batch-independent
    assert "apply" not in _Sim8ProductFn.__dict__


def test_inlining_leaves_untraced_calls_to_autograd() -> None:
    """Training beside an export (another thread) keeps the Functions' own backward: gradients are the same bits
    inside and outside :func:`inlined_for_tracing`."""
    net = sim8_net(trained_steps=1).train()
    x = torch.randn(4, 1, 8, 8, generator=torch.Generator().manual_seed(2))

    def grads() -> list[torch.Tensor]:
        torch.manual_seed(3)  # the output gradient's stochastic rounding
        net.zero_grad()
        net(x).square().sum().backward()
        return [p.grad.clone() for p in net.parameters()]

    outside = grads()
    with inlined_for_tracing():
        inside = grads()
    assert all(torch.equal(a, b) for a, b in zip(outside, inside, strict=True))


def test_activation_quantizer_without_a_range_is_named() -> None:
    with pytest.raises(ExportError, match=r"cannot export layer '0\.input_quant' \(ActivationQuantizer\): its "
                                          r"activation range was never measured.*--numerics fp32"):
        check_ranges(sim8_net(trained_steps=0))
    check_ranges(sim8_net(trained_steps=1))


# --- (c) a remote peer: GetModel over mutual TLS ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def remote_peer(tmp_path_factory: pytest.TempPathFactory):
    """One secured daemon that trains a round every 60 s (its model stands still between rounds; 30 s was outlasted by
    this file's remote tests once, beside another test file) and checkpoints
    every round; yields (daemon, CA directory)."""
    root = tmp_path_factory.mktemp("remote")
    ca_dir = fleet_ca(root)
    d = start_daemon(root / "a", "peer-000", free_ports(1)[0], neighbors="127.0.0.1:1", tls_ca=ca_dir,
                     run_flags=["--model", "mnist-cnn", "--dataset", "mnist5k", "--precision", "fp32"],
                     checkpoint_every=1, eval_every=1, join_wait_s=0, extra=["--round-interval", "60"])
    try:
        d.wait_status(lambda s: s["round"] >= 1 and s.get("eval"), 120, "round 1 evaluated")
        d.wait_status(lambda s: d.checkpoint_path.exists(), 30, "first checkpoint")
        yield d, ca_dir
    finally:
        d.kill()


def remote_export(d, out: Path, tls_dir: Path | None):
    return export_model(d.state_dir, out, peer=d.address, tls_dir=tls_dir, formats=("safetensors",))


def export_and_check(d, out: Path, tls_dir: Path) -> None:
    """Export from the remote daemon and check the files against its checkpoint of the same round. A round may
    land between the export and the checkpoint read (one every 60 s; under a loaded suite the module's earlier
    tests can use up the window): then the export is taken again, within the next round's 60 s."""
    for attempt in range(2):
        result = remote_export(d, out / str(attempt), tls_dir)
        ckpt = d.checkpoint()
        if result.card["round"] == ckpt["round"]:
            check_remote(result, ckpt)
            return
    raise AssertionError("the daemon trained a round during each of two exports (60 s apart)")


def check_remote(result, ckpt) -> None:
    card = result.card
    assert card["origin"]["kind"] == "remote" and card["origin"]["peer_id"] == "peer-000"
    fresh = fresh_registry_model(card)
    fresh.load_state_dict(safetensors_torch.load_file(str(result.files["safetensors"])), strict=True)
    assert torch.allclose(FlatModel(fresh).z, state.debiased(ckpt), atol=1e-6)


def test_remote_peer_refuses_a_caller_without_certificate(remote_peer, tmp_path: Path) -> None:
    d, _ = remote_peer
    with pytest.raises(ExportError, match=rf"peer {d.address} refused or did not answer.*--tls-dir"):
        remote_export(d, tmp_path / "out", None)


def test_remote_peer_exports_to_a_fleet_certificate(remote_peer, tmp_path: Path) -> None:
    d, ca_dir = remote_peer
    ca.issue(ca_dir, "exporter-1", tmp_path / "tls")
    export_and_check(d, tmp_path / "out", tmp_path / "tls")


def test_remote_peer_exports_to_an_operator_certificate(remote_peer, tmp_path: Path) -> None:
    d, ca_dir = remote_peer
    ca.issue(ca_dir, "alice", tmp_path / "op", role=ROLE_OPERATOR)
    export_and_check(d, tmp_path / "out", tmp_path / "op")


# --- (e) a torchvision model, once the converter is there ------------------------------------------------------------
def converter_ready() -> bool:
    """Whether peer.lowp.convert converts plug-in models (the placeholder raises NotImplementedError)."""
    from peer.lowp.convert import convert

    try:
        convert(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()), PrecisionConfig("fp32"),
                norm="keep", groups=1)
    except NotImplementedError:
        return False
    return True


@pytest.mark.slow
@pytest.mark.skipif(not converter_ready(), reason="peer.lowp.convert is still the placeholder: plug-in models "
                                                  "cannot be built until the converter is merged")
def test_torchvision_mobilenet_int8_keep_norm_loads_into_torchvision(tmp_path: Path) -> None:
    """mobilenet_v3_small trained briefly in int8 with its own BatchNorm: the safetensors file loads strict into
    torchvision's model, which agrees with the fp32 graph, and onnxruntime's 8-bit graph agrees with the daemon on
    >= 99.5%."""
    torchvision = pytest.importorskip("torchvision")
    spec = RunSpec(model=ModelSpec(name="torchvision:mobilenet_v3_small", precision="int8", norm="keep"),
                   data=DataSpec(dataset="synthetic", batch_size=16, seed=0),
                   optim=OptimSpec(lr=0.01, epochs=1.0, warmup_epochs=0.0),
                   gossip=GossipSpec(algorithm="sgp", compression=0.0, bits=32))
    run = trained(tmp_path / "run", spec, steps=10)
    result = export_model(run, tmp_path / "out")
    card = result.card
    check_files(result)
    assert card["source"]["kind"] == "torchvision" and card["state_dict"]["loads_into_source"] is True
    assert card["state_dict"]["loads_into"] == "torchvision.models.mobilenet_v3_small(num_classes=10)"
    splits = build.load_splits(spec.data)
    batches = build.test_batches(splits, torch.device("cpu"))
    model = torchvision.models.mobilenet_v3_small(num_classes=10)
    model.load_state_dict(safetensors_torch.load_file(str(result.files["safetensors"])), strict=True)
    ckpt = state.load(run / "checkpoint.pt")
    daemon = daemon_model(ckpt, spec)
    # the fresh torchvision model computes what the fp32 graph of the same export computes (the master weights);
    # how far that is from the 8-bit model the daemon evaluates depends on the training (printed below)
    fp32_graph = export_model(run, tmp_path / "fp32", formats=("onnx",), numerics="fp32")
    assert agreement(onnx_top1(fp32_graph.files["onnx"], batches), torch_top1(model, batches)) >= AGREEMENT
    assert card["precision"]["graph_numerics"].startswith("8-bit")
    onnx, daemon_top1 = onnx_top1(result.files["onnx"], batches), torch_top1(daemon, batches)
    assert agreement(onnx, daemon_top1) >= AGREEMENT
    print("mobilenet_v3_small int8 keep export:", card["export_s"], {k: v["bytes"] for k, v in card["files"].items()},
          {"onnx_vs_daemon": agreement(onnx, daemon_top1),
           "fp32_vs_daemon": agreement(torch_top1(model, batches), daemon_top1)})


class TinyNet(nn.Module):
    """A user's own model given in code (the Python API's callable)."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                  nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(8, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


@pytest.mark.skipif(not converter_ready(), reason="peer.lowp.convert is still the placeholder: plug-in models "
                                                  "cannot be built until the converter is merged")
def test_model_given_in_code_exports_with_its_factory(tmp_path: Path) -> None:
    from peer.api import train

    train(TinyNet, dataset="synthetic", out_dir=tmp_path / "run", max_steps=3, precision="fp32", norm="keep",
          batch_size=16)
    with pytest.raises(ExportError, match="python:TinyNet was given in code"):
        export_model(tmp_path / "run", tmp_path / "out")
    result = export_model(tmp_path / "run", tmp_path / "out", model=TinyNet)
    assert result.card["source"] == {"ref": "python:TinyNet", "kind": "python", "options": []}
    assert result.card["state_dict"]["loads_into_source"] is True
    mine = TinyNet(num_classes=10)
    mine.load_state_dict(safetensors_torch.load_file(str(result.files["safetensors"])), strict=True)
    ckpt = state.load(tmp_path / "run" / "checkpoint.pt")
    assert "body.1.running_mean" in ckpt["buffers"]
    assert torch.equal(mine.body[1].running_mean, ckpt["buffers"]["body.1.running_mean"])


NETS_PY = """
from torch import nn


class Net(nn.Module):
    def __init__(self, num_classes: int = 10, in_channels: int = 1) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2))
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(32 * 7 * 7, 64), nn.ReLU(), nn.Linear(64, num_classes))

    def forward(self, x):
        return self.classifier(self.features(x))
"""


@pytest.mark.skipif(not converter_ready(), reason="peer.lowp.convert is still the placeholder: plug-in models "
                                                  "cannot be built until the converter is merged")
def test_plugin_file_int8_graphs_agree_with_the_daemon(tmp_path: Path, mnist_test: list) -> None:
    """A user's model file (Conv2d, BatchNorm2d kept, ReLU, MaxPool2d, Linear) converted and trained 40 steps in
    int8: its graphs compute the converted model's 8-bit numerics (onnxruntime agrees with the daemon's int8
    evaluation on >= 99.5%) and the safetensors file loads strict into the user's own class with about the daemon's
    accuracy."""
    (tmp_path / "nets.py").write_text(NETS_PY)
    spec = RunSpec(model=ModelSpec(name=f"{tmp_path / 'nets.py'}:Net", precision="int8", norm="keep"),
                   data=mnist_spec("int8").data, optim=mnist_spec("int8").optim, gossip=mnist_spec("int8").gossip)
    run = trained(tmp_path / "run", spec, steps=40)
    result = export_model(run, tmp_path / "out")
    card = result.card
    check_files(result)
    assert card["source"]["kind"] == "file" and card["state_dict"]["loads_into_source"] is True
    assert card["precision"]["graph_numerics"].startswith("8-bit")
    ckpt = state.load(run / "checkpoint.pt")
    daemon = daemon_model(ckpt, spec)
    daemon_acc = evaluate(daemon, mnist_test)[1]
    daemon_top1 = torch_top1(daemon, mnist_test)
    import importlib.util

    module_spec = importlib.util.spec_from_file_location("user_nets", tmp_path / "nets.py")
    nets = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(nets)
    mine = nets.Net(num_classes=10, in_channels=1)
    mine.load_state_dict(safetensors_torch.load_file(str(result.files["safetensors"])), strict=True)
    mine_top1 = torch_top1(mine, mnist_test)
    onnx = onnx_top1(result.files["onnx"], mnist_test)
    y = labels(mnist_test)
    figures = {"onnx_vs_daemon": agreement(onnx, daemon_top1), "fp32_vs_daemon": agreement(mine_top1, daemon_top1),
               "daemon_acc": daemon_acc, "onnx_acc": agreement(onnx, y), "fp32_acc": agreement(mine_top1, y),
               "export_s": card["export_s"]}
    assert figures["onnx_vs_daemon"] >= AGREEMENT
    assert figures["fp32_acc"] == pytest.approx(daemon_acc, abs=FP32_VS_8BIT_ACC)
    print("nets.py:Net int8 keep export, 8-bit graphs:", figures)
