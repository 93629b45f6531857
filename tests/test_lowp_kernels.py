"""Exactness of every int8 product kernel the probe can select, and rejection of saturating kernels (issue 9).

A kernel the probe admits (check_exact on full-range operands) must then give, on fresh full-range operands and
every zero point, exactly ``float32(p)`` for the exact integer product ``p`` (the int32 accumulator, bit for bit
where |p| < 2^24). A kernel that adds u8 x s8 pairs in saturating int16 (what CPUs without VNNI do) must be refused.
"""

import pytest
import torch
import torch.nn.functional as F

from peer.lowp import PrecisionConfig, resolve_precision
from peer.lowp.kernels import (
    FP32_EXACT_K,
    ConvGeometry,
    FloatCodesKernel,
    ProductKernel,
    all_kernels,
    col2im,
    im2col,
)
from peer.lowp.plan import KernelPlan, NoExactKernel
from peer.lowp.probe import OpCase, check_exact, full_range_operands, reference, run_kernel

pytestmark = pytest.mark.usefixtures("one_torch_thread")
CPU = torch.device("cpu")
G3 = ConvGeometry((3, 3), padding=(1, 1))
CASES = {
    "conv3x3": OpCase("conv.fwd", (3, 8, 7, 7), (6, 8, 3, 3), G3),
    "conv3x3-longK": OpCase("conv.fwd", (2, 64, 5, 5), (4, 64, 3, 3), G3),  # K = 576 > FP32_EXACT_K: split
    "conv-s2": OpCase("conv.fwd", (2, 5, 8, 8), (4, 5, 3, 3), ConvGeometry((3, 3), (2, 2), (1, 1))),
    "conv-1x1-s2": OpCase("conv.fwd", (2, 6, 6, 6), (5, 6, 1, 1), ConvGeometry((1, 1), (2, 2))),
    "conv-rect": OpCase("conv.fwd", (2, 5, 5, 6), (8, 5, 1, 3), ConvGeometry((1, 3), (2, 1))),
    "conv-grouped": OpCase("conv.fwd", (2, 4, 5, 5), (4, 2, 3, 3), ConvGeometry((3, 3), padding=(1, 1), groups=2)),
    "dgrad3x3": OpCase("conv.dgrad", (3, 6, 7, 7), (6, 8, 3, 3), G3, (3, 8, 7, 7)),
    "dgrad-longK": OpCase("conv.dgrad", (2, 64, 5, 5), (64, 4, 3, 3), G3, (2, 4, 5, 5)),
    "dgrad-s2": OpCase("conv.dgrad", (2, 4, 4, 4), (4, 5, 3, 3), ConvGeometry((3, 3), (2, 2), (1, 1)), (2, 5, 8, 8)),
    # strided input gradients by stride phase (oneDNN): odd input size, 1x1 (phases no tap reaches), uneven strides
    "dgrad-s2-odd": OpCase("conv.dgrad", (2, 4, 5, 5), (4, 5, 3, 3), ConvGeometry((3, 3), (2, 2), (1, 1)),
                           (2, 5, 9, 9)),
    "dgrad-1x1-s2": OpCase("conv.dgrad", (2, 4, 3, 3), (4, 5, 1, 1), ConvGeometry((1, 1), (2, 2)), (2, 5, 6, 6)),
    "dgrad-rect-s3x2": OpCase("conv.dgrad", (2, 4, 4, 3), (4, 5, 5, 3), ConvGeometry((5, 3), (3, 2), (2, 0)),
                              (2, 5, 10, 7)),
    "dgrad-s2-longK": OpCase("conv.dgrad", (2, 128, 3, 3), (128, 4, 3, 3), ConvGeometry((3, 3), (2, 2), (1, 1)),
                             (2, 4, 6, 6)),
    "linear": OpCase("linear.fwd", (9, 13), (5, 13)),
    "linear-longK": OpCase("linear.fwd", (6, 1100), (4, 1100)),
    "linear-dgrad": OpCase("linear.dgrad", (9, 5), (5, 13)),
}
KERNELS = {k.name: k for k in all_kernels()}


def test_long_cases_really_split_k():
    assert CASES["conv3x3-longK"].w_shape[1] * 9 > FP32_EXACT_K
    assert CASES["linear-longK"].w_shape[1] > FP32_EXACT_K


def test_the_fp32_kernels_exact_reduction_length_follows_the_zero_point():
    """K = 576 (ResNet-20's 64-channel 3x3 convolutions) needs no split for codes centred near 128 (values within
    +-227), but does at the extreme zero points (values up to 255): the exactness tests run both."""
    kernel = FloatCodesKernel()
    assert kernel.max_k(0) == kernel.max_k(255) == FP32_EXACT_K < 576
    assert kernel.max_k(128) == 1024 and kernel.max_k(127) == 1024
    assert kernel.max_k(227) >= 576 > kernel.max_k(228)
    for zp in (0, 64, 128, 200, 255):  # the bound itself: K * max|value| * 128 within 2^24
        assert kernel.max_k(zp) * max(zp, 255 - zp) * 128 <= 2 ** 24 < (kernel.max_k(zp) + 1) * max(zp, 255 - zp) * 128


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("name", KERNELS)
def test_every_admitted_kernel_is_bit_exact_on_full_range_operands(name, case):
    kernel, case = KERNELS[name], CASES[case]
    if kernel.unavailable(CPU) or not kernel.supports(case.op, case.geom):
        pytest.skip(f"{name} cannot run {case.op} here")
    if check_exact(kernel, case, CPU) is not None:  # refused here: the plan must never pick it (tested below)
        assert KernelPlan(CPU, [kernel, FloatCodesKernel()]).choose(case).kernel.name == "fp32"
        return
    a, w = full_range_operands(case, CPU, seed=5)
    for zp in (0, 1, 128, 254, 255):
        want = reference(case, a, zp, w)
        got = run_kernel(kernel, case, a, zp, w)
        assert got.dtype == torch.float32
        assert torch.equal(got, want.float()), f"{name} {case.label()} zp {zp}"
        small = want.abs() < 2 ** 24  # where fp32 holds the int32 accumulator itself: the very integer
        assert torch.equal(got[small].long(), want[small].long())


def test_scale_multiplies_the_exact_product():
    case = CASES["conv3x3"]
    a, w = full_range_operands(case, CPU)
    for kernel in (k for k in all_kernels() if not k.unavailable(CPU) and check_exact(k, case, CPU) is None):
        got = run_kernel(kernel, case, a, 128, w, scale=0.25)
        assert torch.equal(got, reference(case, a, 128, w).float() * 0.25), kernel.name


def _saturating_mm(a: torch.Tensor, zp: int, w: torch.Tensor) -> torch.Tensor:
    """u8 x s8 products summed in pairs with int16 saturation (vpmaddubsw without VNNI), then exactly."""
    prods = a.long()[:, None, :] * w.long()[None, :, :]  # [M, N, K]
    if prods.shape[-1] % 2:
        prods = F.pad(prods, (0, 1))
    pairs = prods.reshape(*prods.shape[:2], -1, 2).sum(-1).clamp(-32768, 32767)
    return pairs.sum(-1) - zp * w.long().sum(1)


class SaturatingKernel(ProductKernel):
    """A kernel with the pair-saturation bug of u8 x s8 instructions on CPUs without VNNI."""

    name = "saturating"

    def supports(self, op, geom):
        return op in ("conv.fwd", "linear.fwd", "linear.dgrad") and (geom is None or geom.plain)

    def conv_fwd(self, x, zp, w, geom, scale):
        n, c_out = x.shape[0], w.shape[0]
        cols = im2col(x, geom.kernel, geom.stride, geom.padding, zp)
        ho, wo = geom.out_hw(tuple(x.shape[2:]))
        acc = _saturating_mm(cols, zp, w.reshape(c_out, -1))
        return acc.float().mul_(scale).reshape(n, ho, wo, c_out).permute(0, 3, 1, 2)

    def linear(self, x, zp, w, scale):
        return _saturating_mm(x, zp, w).float().mul_(scale)


@pytest.mark.parametrize("case", ["conv3x3", "linear", "linear-dgrad"])
def test_saturating_kernel_is_refused(case):
    case = CASES[case]
    reason = check_exact(SaturatingKernel(), case, CPU)
    assert reason is not None and "inexact" in reason
    choice = KernelPlan(CPU, [SaturatingKernel(), FloatCodesKernel()]).choose(case)
    assert choice.kernel.name == "fp32" and "saturating" in choice.rejected


def test_saturating_kernel_is_exact_on_small_codes_so_the_probe_needs_full_range():
    """Codes 0..127 against signed weights never saturate a pair: a probe on such operands would admit the bug."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randint(0, 128, (9, 13), dtype=torch.uint8, generator=gen)
    w = torch.randint(-128, 128, (5, 13), dtype=torch.int8, generator=gen)
    assert torch.equal(_saturating_mm(a, 0, w), a.long() @ w.long().t())


def test_only_saturating_kernel_means_int8_falls_back_to_sim8():
    plan = KernelPlan(CPU, [SaturatingKernel()])
    with pytest.raises(NoExactKernel):
        plan.choose(CASES["linear"])
    resolved = resolve_precision(PrecisionConfig("int8", bits=6), CPU, probe=lambda _d: KernelPlan(
        CPU, [SaturatingKernel()]))
    assert resolved.config_in_use == PrecisionConfig("sim8", 6)
    assert resolved.backend == "fake-quant" and "sim8" in resolved.reason


def test_im2col_col2im_match_conv():
    x = torch.randint(0, 10, (2, 3, 5, 6), dtype=torch.uint8)
    w = torch.randn(4, 3, 3, 3)
    cols = im2col(x, (3, 3), (2, 1), (1, 1), pad_code=0).float()
    ref = F.conv2d(x.float(), w, stride=(2, 1), padding=1)
    got = (cols @ w.reshape(4, -1).t()).reshape(2, 3, 6, 4).permute(0, 3, 1, 2)
    assert torch.allclose(got, ref, atol=1e-5)
    g = torch.randn_like(ref)
    dx = col2im(g.permute(0, 2, 3, 1).reshape(-1, 4) @ w.reshape(4, -1), 2, (5, 6), (3, 3), (2, 1), (1, 1))
    assert torch.allclose(dx, torch.nn.grad.conv2d_input(x.shape, w, g, stride=(2, 1), padding=1), atol=1e-5)


def test_plan_reports_kernel_and_speedup_per_op_kind():
    plan = KernelPlan(CPU)
    for case in ("conv3x3", "dgrad3x3", "linear", "linear-dgrad"):
        plan.choose(CASES[case])
    ops = plan.describe()["ops"]
    assert set(ops) == {"conv.fwd", "conv.dgrad", "linear.fwd", "linear.dgrad"}
    for detail in ops.values():
        assert detail["kernel"] in KERNELS and detail["speedup_vs_fp32"] > 0
    assert plan.product_speedup() > 0


@pytest.mark.parametrize("case", ["conv3x3", "conv-s2", "dgrad3x3", "linear", "linear-dgrad"])
def test_int_mm_on_builds_that_take_int8_only_is_exact(monkeypatch, case):
    """CUDA and the aarch64 CPU build take int8 only: codes are shifted to int8 with the zero point, still exact."""
    import peer.lowp.kernels as kernels

    case = CASES[case]
    refused = check_exact(kernels.IntMMKernel(), case, CPU)
    if refused is not None:  # a CPU without VNNI (int16 pair saturation): the probe refuses the kernel, as it must
        pytest.skip(f"this CPU's torch._int_mm is refused by the probe here: {refused}")
    monkeypatch.setattr(kernels, "_int_mm_takes_uint8", lambda _device_type: False)
    calls = []
    real = torch._int_mm
    monkeypatch.setattr(torch, "_int_mm", lambda a, b: (calls.append(a.dtype), real(a, b))[1])
    a, w = full_range_operands(case, CPU, seed=7)
    for zp in (0, 128, 255):
        assert torch.equal(run_kernel(kernels.IntMMKernel(), case, a, zp, w), reference(case, a, zp, w).float())
    assert calls and set(calls) == {torch.int8}


def test_a_one_channel_weight_gradient_runs_on_the_channels_last_stride(monkeypatch):
    """A one-channel input's codes are contiguous in both layouts with either channel stride; the just-in-time
    compiled passes hand (H*W, H*W, W, 1), which oneDNN reads as NCHW (3x slower beside a channels_last gradient).
    The weight gradient gets the channels_last stride - the same memory, the same values."""
    from peer.lowp import plan as plan_module
    from peer.lowp.passes import FusedPasses
    from peer.lowp.qmath import Codes

    seen = []
    real = plan_module._conv_wgrad
    monkeypatch.setattr(plan_module, "_conv_wgrad", lambda x, *a: seen.append(x.stride()) or real(x, *a))
    data = torch.randint(0, 256, (4, 1, 6, 6), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    nchw = data.contiguous()
    assert nchw.stride() == (36, 36, 6, 1) and nchw.is_contiguous(memory_format=torch.channels_last)
    codes = Codes(nchw, torch.tensor(0.02), torch.tensor(128.0), -128, 127)
    g = torch.randn(4, 8, 6, 6)
    geom = ConvGeometry((3, 3), padding=(1, 1))
    engine = FusedPasses(try_compile=False)
    got = plan_module.conv_wgrad_from_codes(codes, g, torch.Size((8, 1, 3, 3)), geom, engine)
    assert seen == [(36, 1, 6, 1)]
    want = real(codes.centered(), g.contiguous(memory_format=torch.channels_last), torch.Size((8, 1, 3, 3)),
                geom).mul_(codes.scale)
    torch.testing.assert_close(got, want)  # oneDNN's two layouts may sum in another order on another CPU
