"""The int8 path on a CUDA device: every kernel the probe can pick there is bit-exact on full-range operands, and the
probed int8 model trains (Jetson-class devices and GPU hosts run this path; CI machines have no GPU, so these tests
skip there with the reason).

Same contract as tests/test_lowp_kernels.py on the CPU: a kernel the probe admits gives exactly ``float32(p)`` for
the exact integer product ``p``; ``torch._int_mm`` on CUDA takes int8 operands only (the uint8 codes are shifted by
128 with the zero point) and needs padded shapes (M > 16, K and N multiples of 8) and b column-major, which the cases below exercise.
"""

import pytest
import torch

from peer.lowp import PrecisionConfig, resolve_precision
from peer.lowp.kernels import ConvGeometry, all_kernels
from peer.lowp.plan import KernelPlan
from peer.lowp.probe import OpCase, check_exact, full_range_operands, reference, run_kernel

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA device (the int8 CUDA path: torch._int_mm, cuDNN without TF32)")
CUDA = torch.device("cuda")
G3 = ConvGeometry((3, 3), padding=(1, 1))
CASES = {
    "conv3x3": OpCase("conv.fwd", (3, 8, 7, 7), (6, 8, 3, 3), G3),  # N = 6, K = 72: padded to multiples of 8
    "conv3x3-longK": OpCase("conv.fwd", (2, 64, 5, 5), (4, 64, 3, 3), G3),
    "conv-s2": OpCase("conv.fwd", (2, 5, 8, 8), (4, 5, 3, 3), ConvGeometry((3, 3), (2, 2), (1, 1))),
    "conv-grouped": OpCase("conv.fwd", (2, 4, 5, 5), (4, 2, 3, 3), ConvGeometry((3, 3), padding=(1, 1), groups=2)),
    "dgrad3x3": OpCase("conv.dgrad", (3, 6, 7, 7), (6, 8, 3, 3), G3, (3, 8, 7, 7)),
    "dgrad-s2": OpCase("conv.dgrad", (2, 4, 4, 4), (4, 5, 3, 3), ConvGeometry((3, 3), (2, 2), (1, 1)), (2, 5, 8, 8)),
    "linear": OpCase("linear.fwd", (9, 13), (5, 13)),  # M = 9 < 17 rows: padded
    "linear-longK": OpCase("linear.fwd", (6, 1100), (4, 1100)),
    "linear-dgrad": OpCase("linear.dgrad", (9, 5), (5, 13)),
}
KERNELS = {k.name: k for k in all_kernels()}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("name", KERNELS)
def test_every_admitted_kernel_is_bit_exact_on_cuda(name, case):
    kernel, case = KERNELS[name], CASES[case]
    if kernel.unavailable(CUDA) or not kernel.supports(case.op, case.geom):
        pytest.skip(f"{name} cannot run {case.op} on CUDA")
    refused = check_exact(kernel, case, CUDA)
    if refused is not None:  # never picked: the plan falls back to an exact kernel
        assert KernelPlan(CUDA, [kernel] + [k for k in all_kernels() if k.name == "fp32"]).choose(case).kernel.name \
            == "fp32", refused
        return
    a, w = full_range_operands(case, CUDA, seed=5)
    for zp in (0, 1, 128, 254, 255):
        want = reference(case, a.cpu(), zp, w.cpu())
        got = run_kernel(kernel, case, a, zp, w)
        assert got.device.type == "cuda" and got.dtype == torch.float32
        assert torch.equal(got.cpu(), want.float()), f"{name} {case.label()} zp {zp}"


def test_int_mm_is_admitted_on_cuda():
    """The tensor-core kernel is the reason to run int8 on a GPU: the probe must not refuse it on full-range codes."""
    kernel = KERNELS["int_mm"]
    assert kernel.unavailable(CUDA) is None
    for case in ("conv3x3", "linear", "dgrad3x3"):
        assert check_exact(kernel, CASES[case], CUDA) is None, case


def test_the_probed_int8_mnist_cnn_trains_on_cuda():
    from peer.models import build_model

    resolved = resolve_precision(PrecisionConfig("int8"), CUDA)
    assert resolved.config_in_use.mode == "int8", resolved.reason
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, 1, 28, 28, generator=gen).to(CUDA)
    y = torch.randint(0, 10, (64,), generator=gen).to(CUDA)
    torch.manual_seed(0)
    model = build_model("mnist-cnn", in_channels=1, precision=resolved.config_in_use).to(CUDA)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for _ in range(30):
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        assert all(p.grad is None or bool(torch.isfinite(p.grad).all()) for p in model.parameters())
        opt.step()
        losses.append(float(loss))
    assert losses[-1] < 0.5 * losses[0], losses  # one fixed batch: int8 training memorises it
