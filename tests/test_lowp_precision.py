"""Precision config validation and resolution: int8 kept with its kernel choices, the summary line, the fallback."""

import logging

import pytest
import torch

from peer.lowp import PRECISION_MODES, FloatCodesKernel, KernelPlan, PrecisionConfig, resolve_precision

pytestmark = pytest.mark.usefixtures("one_torch_thread")
CPU = torch.device("cpu")


def test_modes_and_defaults():
    assert PRECISION_MODES == ("fp32", "sim8", "int8")
    assert PrecisionConfig() == PrecisionConfig("fp32", 8)


@pytest.mark.parametrize("kwargs, field", [({"mode": "int4"}, "mode"), ({"bits": 9}, "bits"),
                                           ({"bits": 1}, "bits"), ({"mode": "INT8"}, "mode")])
def test_bad_config_names_field_and_allowed_values(kwargs, field):
    with pytest.raises(ValueError, match=field) as err:
        PrecisionConfig(**kwargs)
    assert ("fp32" in str(err.value)) if field == "mode" else ("2..8" in str(err.value))


def test_fp32_and_sim8_resolve_without_probe():
    def probe(_device):
        raise AssertionError("probe must not run")

    for mode in ("fp32", "sim8"):
        resolved = resolve_precision(PrecisionConfig(mode), CPU, probe=probe)
        assert resolved.config_in_use.mode == mode and resolved.config_in_use.plan is None


def test_int8_resolves_to_int8_with_a_kernel_per_op_kind(caplog):
    plan = KernelPlan(CPU)
    with caplog.at_level(logging.INFO, logger="peer.lowp"):
        resolved = resolve_precision(PrecisionConfig("int8", bits=7), CPU, probe=lambda _d: plan)
    assert resolved.config_in_use == PrecisionConfig("int8", 7) and resolved.config_in_use.plan is plan
    assert resolved.backend.startswith("int8/")
    for op in ("conv.fwd", "conv.dgrad", "linear.fwd", "linear.dgrad"):
        kernel = plan.describe()["ops"][op]["kernel"]
        assert f"{op} {kernel} " in resolved.reason  # one line: kernel and measured speed-up per op kind
    detail = resolved.describe()
    assert detail["mode"] == "int8" and detail["quantizers"]["path"] in ("compiled", "eager")
    assert detail["int8_faster_than_fp32"] == (detail["products_speedup_vs_fp32"] >= 1.0)
    assert any("precision:" in r.getMessage() for r in caplog.records)


class _SlowFloat(FloatCodesKernel):
    """The exact fp32-on-codes kernel made slower than fp32 (a machine where no 8-bit path wins)."""

    def linear(self, x, zp, w, scale):
        for _ in range(4):
            out = super().linear(x, zp, w, scale)
        return out

    def conv_fwd(self, x, zp, w, geom, scale):
        for _ in range(4):
            out = super().conv_fwd(x, zp, w, geom, scale)
        return out

    def conv_dgrad(self, g, zp, w, geom, x_shape, scale):
        for _ in range(4):
            out = super().conv_dgrad(g, zp, w, geom, x_shape, scale)
        return out


def test_int8_slower_than_fp32_is_kept_and_said_with_the_ratio(caplog):
    with caplog.at_level(logging.WARNING, logger="peer.lowp.precision"):
        resolved = resolve_precision(PrecisionConfig("int8"), CPU, probe=lambda _d: KernelPlan(CPU, [_SlowFloat()]))
    assert resolved.config_in_use.mode == "int8"  # never silently another mode: the memory saving stays
    speedup = resolved.config_in_use.plan.product_speedup()
    assert speedup < 1.0
    assert f"no 8-bit path beats fp32 here (products {speedup:.2f}x" in resolved.reason
    assert any("no 8-bit path beats fp32" in r.getMessage() for r in caplog.records)
    assert resolved.describe()["int8_faster_than_fp32"] is False


def test_copied_int8_model_shares_the_kernel_plan():
    import copy

    from peer.models import build_model

    plan = KernelPlan(CPU)
    model = build_model("mnist-cnn", in_channels=1, precision=PrecisionConfig("int8", plan=plan))
    clone = copy.deepcopy(model)
    assert clone.classifier[0].precision.plan is plan
