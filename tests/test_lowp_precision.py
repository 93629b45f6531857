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
    assert f"no integer product kernel beats fp32 here (products {speedup:.2f}x" in resolved.reason
    assert any("no integer product kernel beats fp32" in r.getMessage() for r in caplog.records)
    assert resolved.describe()["int8_faster_than_fp32"] is False


def test_copied_int8_model_shares_the_kernel_plan():
    import copy

    from peer.models import build_model

    plan = KernelPlan(CPU)
    model = build_model("mnist-cnn", in_channels=1, precision=PrecisionConfig("int8", plan=plan))
    clone = copy.deepcopy(model)
    assert clone.classifier[0].precision.plan is plan


# ---- the measured training step (peer.lowp.steptime) ----------------------------------------------------------------

@pytest.fixture(scope="module")
def resolved_int8():
    """int8 resolved once for this module's step tests (the start-up probe takes a few seconds)."""
    return resolve_precision(PrecisionConfig("int8"), CPU)


def _with_timings(resolved, int8_s: float, fp32_s: float):
    """``resolved`` with a fresh step check whose timer reports the given step times (s) and counts its calls."""
    from dataclasses import replace

    from peer.lowp.steptime import StepCheck

    calls = []
    check = StepCheck(timer=lambda a, b, x: calls.append((a, b, tuple(x.shape))) or [int8_s, fp32_s])
    return replace(resolved, config_in_use=replace(resolved.config_in_use, step_check=check)), calls


def _mnist(resolved):
    from peer.models import build_model

    torch.manual_seed(0)
    return build_model("mnist-cnn", in_channels=1, precision=resolved.config_in_use)


def test_step_not_measured_before_the_first_training_step_says_so(resolved_int8):
    resolved, calls = _with_timings(resolved_int8, 0.05, 0.04)
    model = _mnist(resolved)
    model.eval()
    with torch.no_grad():
        model(torch.randn(2, 1, 28, 28))  # evaluation is not a training step
    assert not calls and resolved.step is None and resolved.describe()["step_time_vs_fp32"] is None
    assert "training step vs fp32 not measured yet" in resolved.reason


def test_int8_step_slower_than_fp32_is_said_with_the_measured_ratio(resolved_int8, caplog):
    resolved, calls = _with_timings(resolved_int8, 0.05, 0.04)
    model = _mnist(resolved)
    with caplog.at_level(logging.INFO, logger="peer.lowp"):
        model(torch.randn(4, 1, 28, 28)).sum().backward()
        assert not calls and "not measured yet" in resolved.reason  # the first step runs as without the check
        model(torch.randn(4, 1, 28, 28)).sum().backward()
    assert len(calls) == 1 and calls[0][2] == (4, 1, 28, 28)
    int8_model, fp32_model, _ = calls[0]
    assert int8_model is not model and int8_model.features[0].precision.mode == "int8"
    assert fp32_model.features[0].precision.mode == "fp32"
    assert "training step 1.25x fp32 time (50.0 vs 40.0 ms" in resolved.reason
    assert "int8 is SLOWER than fp32 on this machine" in resolved.reason
    assert resolved.reason.index("training step") < resolved.reason.index("products vs fp32")  # the headline
    detail = resolved.describe()
    assert detail["int8_faster_than_fp32"] is False and detail["step_time_vs_fp32"]["ratio"] == 1.25
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("1.25x fp32 time" in m and "SLOWER" in m for m in warnings)


def test_int8_step_faster_than_fp32_is_said_and_not_warned(resolved_int8, caplog):
    resolved, _ = _with_timings(resolved_int8, 0.03, 0.04)
    model = _mnist(resolved)
    with caplog.at_level(logging.INFO, logger="peer.lowp"):
        model(torch.randn(2, 1, 28, 28))
        model(torch.randn(2, 1, 28, 28))
    assert "training step 0.75x fp32 time" in resolved.reason and "not slower than fp32" in resolved.reason
    assert "SLOWER" not in resolved.reason and resolved.describe()["int8_faster_than_fp32"] is True
    assert not any("0.75x" in r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)


def test_step_measured_once_for_all_replicas_without_touching_the_training_rng(resolved_int8):
    import copy

    from peer.lowp.steptime import StepCheck

    def losses(resolved):
        model = _mnist(resolved)
        replica = copy.deepcopy(model)  # a peer's private copy shares the check
        x = torch.randn(3, 1, 28, 28)
        torch.manual_seed(7)
        out = [model(x).sum().item(), replica(x).sum().item(), model(x).sum().item()]  # dropout draws from the RNG
        return out, replica

    from dataclasses import replace

    plain = replace(resolved_int8, config_in_use=replace(resolved_int8.config_in_use, step_check=None))
    timed, calls = _with_timings(resolved_int8, 0.05, 0.04)
    want, _ = losses(plain)
    got, replica = losses(timed)
    assert got == want and len(calls) == 1
    assert replica.features[0].precision.step_check is timed.config_in_use.step_check
    assert StepCheck().result is None


def test_the_measurement_hands_its_memory_back(resolved_int8, monkeypatch):
    from peer.lowp import steptime

    released = []
    monkeypatch.setattr(steptime, "trim_heap", lambda: released.append(1) or True)
    resolved, _ = _with_timings(resolved_int8, 0.05, 0.04)
    model = _mnist(resolved)
    model(torch.randn(2, 1, 28, 28))
    assert not released
    model(torch.randn(2, 1, 28, 28))
    assert released == [1]
