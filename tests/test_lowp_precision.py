"""Precision config validation, int8 capability probe and fallback to sim8."""

import logging

import pytest
import torch

from peer.lowp import PRECISION_MODES, PrecisionConfig, ProbeResult, probe_int8, resolve_precision
from peer.lowp.kernels import col2im, im2col_int8, int8_mm

CPU = torch.device("cpu")


def saturating_int8_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """What a non-VNNI CPU does: u8 x s8 pair products summed with int16 saturation."""
    prods = (a.int() + 128)[:, :, None] * b.int()[None]  # u8 (a + 128) times s8
    pairs = prods.reshape(a.shape[0], -1, 2, b.shape[1]).sum(2).clamp(-32768, 32767)
    return (pairs.sum(1) - 128 * b.int().sum(0)).int()


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
        assert resolved.config_in_use.mode == mode


def test_saturating_kernel_is_detected_as_inexact():
    result = probe_int8(CPU, matmul=saturating_int8_mm)
    assert not result.ok and not result.exact
    assert "inexact" in result.reason


def test_fallback_to_sim8_when_probe_fails_is_logged(caplog):
    def probe(device):
        return probe_int8(device, matmul=saturating_int8_mm)

    with caplog.at_level(logging.WARNING, logger="peer.lowp.precision"):
        resolved = resolve_precision(PrecisionConfig("int8", bits=6), CPU, probe=probe)
    assert resolved.config_in_use == PrecisionConfig("sim8", 6)
    assert resolved.backend == "fake-quant"
    assert "inexact" in resolved.reason and "sim8" in resolved.reason
    assert any("inexact" in r.getMessage() for r in caplog.records)


def test_int8_kept_when_probe_passes():
    ok = ProbeResult(True, True, 5.0, "int8 matmul exact, 5.0x fp32 speed")
    resolved = resolve_precision(PrecisionConfig("int8"), CPU, probe=lambda _d: ok)
    assert resolved.config_in_use == PrecisionConfig("int8")
    assert resolved.backend == "torch._int_mm"


def test_real_probe_on_this_machine_is_exact_or_explains():
    result = probe_int8(CPU, min_speedup=0.0)
    assert result.exact == result.ok
    assert result.reason
    slow = probe_int8(CPU, min_speedup=1e9)
    if slow.exact:
        assert not slow.ok and "slower" in slow.reason


def test_int8_mm_exact_on_full_range_operands():
    gen = torch.Generator().manual_seed(1)
    a = torch.randint(-128, 128, (9, 13), dtype=torch.int8, generator=gen)
    b = torch.randint(-128, 128, (13, 5), dtype=torch.int8, generator=gen)
    if not probe_int8(CPU, min_speedup=0.0).exact:
        pytest.skip("torch._int_mm inexact on this CPU")
    assert torch.equal(int8_mm(a, b).long(), a.long() @ b.long())


def test_im2col_col2im_match_conv():
    x = torch.randint(-5, 5, (2, 3, 5, 6), dtype=torch.int8)
    w = torch.randn(4, 3, 3, 3)
    cols = im2col_int8(x, (3, 3), (2, 1), (1, 1), pad_code=0).float()
    ref = torch.nn.functional.conv2d(x.float(), w, stride=(2, 1), padding=1)
    got = (cols @ w.reshape(4, -1).t()).reshape(2, 3, 6, 4).permute(0, 3, 1, 2)
    assert torch.allclose(got, ref, atol=1e-5)
    g = torch.randn_like(ref)
    dx = col2im(g.permute(0, 2, 3, 1).reshape(-1, 4) @ w.reshape(4, -1), 2, (5, 6), (3, 3),
                (2, 1), (1, 1))
    ref_dx = torch.nn.grad.conv2d_input(x.shape, w, g, stride=(2, 1), padding=1)
    assert torch.allclose(dx, ref_dx, atol=1e-5)
