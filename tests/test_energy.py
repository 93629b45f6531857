"""Energy model (docs/method.md#compute-and-energy): hand-checked counts, pricing, norm/skip/pool detection, model
figures and the CLI."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from torch import nn

import peer.models
from peer.cli.energy import energy
from peer.energy import (
    PJ_FP32_ADD,
    PJ_FP32_MULT,
    PJ_INT8_ADD,
    PJ_INT8_MULT,
    OpCount,
    energy_report,
    format_report,
    layer_terms,
    walk_model,
)


def _conv_linear() -> nn.Module:
    # L = 9, K = 3, S = 2, P = 1 -> O = floor((9 + 2 - 3) / 2) + 1 = 5
    return nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.Flatten(), nn.Linear(8 * 5 * 5, 10))


def test_one_conv_one_linear_counts_by_hand() -> None:
    b = 2
    report = energy_report(_conv_linear(), (3, 9, 9), batch=b)
    conv, linear = report.layers
    assert (conv.kind, conv.cin, conv.cout, conv.k, conv.s, conv.p, conv.h, conv.oh) == ("conv", 3, 8, 3, 2, 1, 9, 5)
    assert (linear.kind, linear.cin, linear.cout) == ("linear", 200, 10)

    conv_train = layer_terms(conv, b, training=True)
    assert conv_train["conv"].adds == conv_train["conv"].mults == 3 * b * 8 * 3 * 3**2 * 5**2
    assert (conv_train["act-quant"].adds, conv_train["act-quant"].mults) == (2 * b * 3 * 81, 4 * b * 3 * 81)
    assert (conv_train["weight-quant"].adds, conv_train["weight-quant"].mults) == (2 * 8 * 3 * 9, 4 * 8 * 3 * 9)
    conv_infer = layer_terms(conv, b, training=False)
    assert conv_infer["conv"].adds == b * 8 * 3 * 9 * 25
    assert conv_infer["weight-quant"] == conv_train["weight-quant"]
    assert conv_infer["act-quant"].adds == b * 3 * 81  # half of training: forward only (documented choice)

    lin_train = layer_terms(linear, b, training=True)
    assert lin_train["linear"].adds == lin_train["linear"].mults == 3 * b * 10 * 200
    assert (lin_train["weight-quant"].adds, lin_train["weight-quant"].mults) == (2 * 10 * 200, 4 * 10 * 200)
    assert layer_terms(linear, b, training=False)["linear"].mults == b * 10 * 200

    macs_train = 3 * b * 8 * 3 * 9 * 25 + 3 * b * 10 * 200
    total = report.train_total
    assert total.fp32_pj == pytest.approx(macs_train * (PJ_FP32_ADD + PJ_FP32_MULT))
    quant_adds = 2 * b * 3 * 81 + 2 * 8 * 3 * 9 + 2 * b * 200 + 2 * 10 * 200
    quant_mults = 2 * quant_adds
    expected_8bit = macs_train * (PJ_INT8_ADD + PJ_INT8_MULT) + quant_adds * PJ_FP32_ADD + quant_mults * PJ_FP32_MULT
    assert total.lowp_pj == pytest.approx(expected_8bit)
    paper_8bit = macs_train * (PJ_INT8_ADD + PJ_INT8_MULT) + quant_adds * PJ_INT8_ADD + quant_mults * PJ_INT8_MULT
    assert total.lowp_pj_paper == pytest.approx(paper_8bit)  # the paper: every op of the 8-bit model at int8
    assert total.lowp_pj_priced("paper") == total.lowp_pj_paper and total.lowp_pj_priced("quant-fp32") == total.lowp_pj
    assert total.lowp_pj < total.fp32_pj
    assert report.infer_total.lowp_pj < report.infer_total.fp32_pj


def test_prices_are_horowitz_45nm() -> None:
    assert (PJ_FP32_ADD, PJ_FP32_MULT, PJ_INT8_ADD, PJ_INT8_MULT) == (0.9, 3.7, 0.03, 0.2)


class RangeEvoNorm(nn.Module):
    """Stand-in detected by class name, like the real peer.lowp.evonorm.RangeEvoNorm."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class _Residual(nn.Module):
    def __init__(self, add: nn.Module) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.norm = RangeEvoNorm()
        self.add = add
        self.pool = nn.AdaptiveAvgPool2d(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(self.add(self.norm(self.conv(x)), x))


def test_norm_skip_and_pool_counts() -> None:
    from peer.lowp.layers import QAdd

    b, c, hw = 3, 4, 36
    layers = walk_model(_Residual(QAdd()), (4, 6, 6))
    assert [layer.kind for layer in layers] == ["conv", "norm", "skip", "pool"]
    norm, skip, pool = layers[1:]
    assert norm.norm_kind == "range-evonorm"
    v = b * c * hw
    assert layer_terms(norm, b, True)["norm"] == OpCount(6 * v, 10 * v + 5 * c)
    assert layer_terms(norm, b, False)["norm"] == OpCount(2 * v, 4 * v + 2 * c)
    assert layer_terms(skip, b, True)["skip"].adds == 2 * v
    assert layer_terms(skip, b, True)["act-quant"].adds == 2 * (2 * v)  # both inputs of the add are quantized
    assert (layer_terms(pool, b, True)["pool"].adds, layer_terms(pool, b, True)["pool"].mults) == (v, 2 * b * c)
    assert layer_terms(pool, b, False)["pool"].mults == b * c


def test_real_norm_classes_and_batchnorm_counted_once() -> None:
    from peer.lowp.evonorm import make_norm_act

    for kind, expected in (("range-evonorm", "range-evonorm"), ("evonorm", "evonorm"), ("batchnorm", "batchnorm")):
        model = nn.Sequential(nn.Conv2d(3, 8, 3), make_norm_act(kind, 8))
        norms = [layer for layer in walk_model(model, (3, 8, 8)) if layer.kind == "norm"]
        assert [n.norm_kind for n in norms] == [expected]
    layers = walk_model(nn.Sequential(nn.Conv2d(3, 8, 3), make_norm_act("batchnorm", 8)), (3, 8, 8))
    bn = next(layer for layer in layers if layer.kind == "norm")
    v = 5 * 8 * 36
    assert (layer_terms(bn, 5, True)["norm"].adds, layer_terms(bn, 5, True)["norm"].mults) == (9 * v, 6 * v + 7 * 8)


def test_model_figures() -> None:
    model = _conv_linear()
    figures = energy_report(model, (3, 9, 9), batch=2).figures
    params = 8 * 3 * 9 + 8 + 200 * 10 + 10
    assert figures.parameters == params and figures.model_bytes_fp32 == 4 * params
    assert figures.model_bytes_int8 == (216 + 2000) + 4 * 2 + 4 * (8 + 10)
    assert figures.saved_activations == 2 * (3 * 81 + 200)
    assert figures.train_memory_bytes_fp32 == 12 * params + 4 * figures.saved_activations
    assert figures.train_memory_bytes_int8 < figures.train_memory_bytes_fp32


def test_report_leaves_model_mode_alone_and_formats() -> None:
    model = _conv_linear().train()
    report = energy_report(model, (3, 9, 9))
    assert model.training
    text = format_report(report)
    assert "ratio fp32 / 8-bit" in text and "conv" in text and "linear" in text
    assert format_report(report, "paper") != text
    with pytest.raises(ValueError, match="pricing"):
        format_report(report, "cheap")
    with pytest.raises(ValueError, match="batch"):
        energy_report(model, (3, 9, 9), batch=0)


def test_cli_json_parses(monkeypatch: pytest.MonkeyPatch) -> None:
    built: dict[str, object] = {}

    def fake_build_model(name: str, **kwargs: object) -> nn.Module:
        built.update(kwargs, name=name)
        return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 5))

    monkeypatch.setattr(peer.models, "build_model", fake_build_model)
    args = ["--model", "tiny", "--batch", "8", "--image-size", "12", "--in-channels", "1", "--num-classes", "5"]
    result = CliRunner().invoke(energy, [*args, "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert built == {"name": "tiny", "num_classes": 5, "in_channels": 1, "norm": "range-evonorm"}
    assert data["batch"] == 8 and [layer["kind"] for layer in data["layers"]] == ["conv", "pool", "linear"]
    assert data["layers"][0]["h"] == 12
    for pricing in ("quant-fp32", "paper"):
        ratios = data[f"ratio_fp32_over_8bit_{pricing.replace('-', '_')}"]
        assert ratios["train"] > 1 and ratios["inference"] > 1
    # the paper prices quantization arithmetic at int8 too: a larger saving than the default pricing
    assert data["ratio_fp32_over_8bit_paper"]["train"] > data["ratio_fp32_over_8bit_quant_fp32"]["train"]
    total = data["total"]["train"]
    assert total["lowp_pj_paper"] < total["lowp_pj_quant_fp32"] < total["fp32_pj"]
    table = CliRunner().invoke(energy, args)
    assert table.exit_code == 0 and "quant-fp32 pricing" in table.output and "paper pricing" in table.output
    paper = CliRunner().invoke(energy, [*args, "--pricing", "paper"])
    assert paper.exit_code == 0 and "8-bit priced: paper" in paper.output
    assert CliRunner().invoke(energy, [*args, "--pricing", "cheap"]).exit_code == 2


def test_cli_unknown_model_is_a_usage_error() -> None:
    result = CliRunner().invoke(energy, ["--model", "nope"])
    assert result.exit_code == 2 and "nope" in result.output


def test_real_resnet20() -> None:
    report = energy_report(peer.models.build_model("resnet20"), (3, 32, 32), batch=32)
    kinds = [layer.kind for layer in report.layers]
    assert kinds.count("conv") >= 19 and kinds.count("linear") == 1 and kinds.count("skip") == 9
    assert kinds.count("norm") >= 19 and kinds.count("pool") == 1
    # ResNet-20 forward is about 41 M multiply-accumulates per sample
    macs = sum(layer_terms(layer, 1, False).get("conv", layer_terms(layer, 1, False).get("linear")).mults
               for layer in report.layers if layer.kind in ("conv", "linear"))
    assert 38e6 < macs < 44e6
    assert report.train_total.fp32_pj / report.train_total.lowp_pj > 5
