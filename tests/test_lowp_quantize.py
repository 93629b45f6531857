"""Quantizers: grids, rounding modes, straight-through gradients, activation ranges."""

import pytest
import torch

from peer.lowp import (
    ActivationQuantizer,
    QParams,
    batch_range,
    dequantize,
    fake_quantize,
    qparams_from_range,
    quantize_codes,
    tensor_qparams,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _qp(scale: float, zero: float, bits: int = 8) -> QParams:
    half = 2 ** (bits - 1)
    return QParams(torch.tensor(scale), torch.tensor(zero), -half, half - 1)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_nearest_is_exact_on_grid_values(bits):
    qp = _qp(0.25, 1.0, bits)  # power-of-two scale: grid values are exact in fp32
    codes = torch.arange(qp.qmin, qp.qmax + 1, dtype=torch.float32)
    grid = (codes - 1.0) * 0.25
    assert torch.equal(quantize_codes(grid, qp, stochastic=False), codes)
    assert torch.equal(dequantize(quantize_codes(grid, qp, False), qp), grid)


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("bits", [3, 8])
def test_round_trip_error_within_half_step(symmetric, bits):
    x = torch.randn(1000) * 3 + 1
    qp = tensor_qparams(x, bits, symmetric)
    err = (dequantize(quantize_codes(x, qp, False), qp) - x).abs().max()
    assert err <= qp.scale / 2 * (1 + 1e-5)
    codes = quantize_codes(x, qp, False)
    assert codes.min() >= qp.qmin and codes.max() <= qp.qmax


def test_symmetric_grid_and_zero_point():
    qp = tensor_qparams(torch.tensor([-2.0, 0.5, 1.0]), 8, symmetric=True)
    assert qp.zero_point.item() == 0 and (qp.qmin, qp.qmax) == (-127, 127)
    assert qp.scale.item() == pytest.approx(2.0 / 127)


def test_asymmetric_range_contains_zero_exactly():
    x = torch.rand(100) + 1.0  # all positive: range is widened to include 0
    qp = tensor_qparams(x, 8, symmetric=False)
    zero = dequantize(quantize_codes(torch.zeros(3), qp, False), qp)
    assert torch.equal(zero, torch.zeros(3))
    assert dequantize(torch.tensor([float(qp.qmax)]), qp).item() == pytest.approx(x.max().item(), rel=1e-5)


def test_all_zero_tensor_quantizes_to_zero():
    z = torch.zeros(4, 5)
    qp = tensor_qparams(z, 8, symmetric=True)
    assert torch.equal(dequantize(quantize_codes(z, qp, True), qp), z)


def test_stochastic_rounding_is_unbiased_and_on_neighbours():
    torch.manual_seed(0)
    qp = _qp(1.0, 0.0)
    x = torch.full((200_000,), 0.3)
    codes = quantize_codes(x, qp, stochastic=True)
    assert set(codes.unique().tolist()) == {0.0, 1.0}
    assert codes.mean().item() == pytest.approx(0.3, abs=0.005)  # ~5 sigma
    y = torch.linspace(-5, 5, 101).repeat(2000)
    assert quantize_codes(y, qp, True).mean().item() == pytest.approx(y.mean().item(), abs=0.01)


@pytest.mark.parametrize("stochastic", [False, True])
def test_straight_through_gradient_is_identity(stochastic):
    x = torch.randn(10, requires_grad=True)
    qp = tensor_qparams(x, 4, symmetric=False)
    g = torch.randn(10)
    fake_quantize(x, qp, stochastic).backward(g)
    assert torch.equal(x.grad, g)


def test_batch_range_is_mean_of_per_sample_min_max():
    x = torch.tensor([[[-1.0, 2.0]], [[-3.0, 4.0]]])
    lo, hi = batch_range(x)
    assert (lo.item(), hi.item()) == (-2.0, 3.0)


def test_activation_quantizer_running_range_and_eval():
    q = ActivationQuantizer(8, momentum=0.5)
    q.train()
    q(torch.tensor([[-1.0, 1.0]]))
    assert (q.running_lo.item(), q.running_hi.item()) == (-1.0, 1.0)  # first batch initialises
    q(torch.tensor([[-3.0, 3.0]]))
    assert (q.running_lo.item(), q.running_hi.item()) == (-2.0, 2.0)
    q.eval()
    qp = q.qparams(torch.tensor([[-100.0, 100.0]]))  # eval ignores the batch range
    assert qp.scale.item() == pytest.approx(4.0 / 255)
    assert q.running_hi.item() == 2.0


def test_eval_quantization_is_deterministic():
    q = ActivationQuantizer(8)
    x = torch.randn(8, 3, 5, 5)
    q(x)
    q.eval()
    torch.manual_seed(1)
    a = q(x + 0.01)
    torch.manual_seed(2)
    assert torch.equal(a, q(x + 0.01))


@pytest.mark.parametrize("bits", [1, 9, 8.0, True])
def test_bits_validation_names_the_field(bits):
    with pytest.raises(ValueError, match="bits"):
        ActivationQuantizer(bits)


def test_qparams_from_range_symmetric_uses_largest_magnitude():
    qp = qparams_from_range(torch.tensor(-0.5), torch.tensor(2.0), 4, True)
    assert qp.scale.item() == pytest.approx(2.0 / 7)
