"""Quantized layers: int8 == sim8, gradient bifurcation, eval determinism, QAdd."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.grad import conv2d_input, conv2d_weight

from peer.lowp import (
    PrecisionConfig,
    QAdd,
    QConv2d,
    QLinear,
    batch_range,
    fake_quantize,
    qparams_from_range,
    quantize_codes,
    tensor_qparams,
)
from tests.lowp_helpers import forward_backward, product_step

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(autouse=True)
def eager_passes(monkeypatch):
    """Eager quantization passes: their stochastic rounding draws from sim8's generator (same seed, same
    codes); the compiled passes are checked against eager in test_lowp_passes.py."""
    monkeypatch.setenv("LPDL_LOWP_EAGER", "1")  # every config's passes decide eager at first use


def _pair(make, x_shape, mode_a="sim8", mode_b="int8"):
    torch.manual_seed(0)
    a = make(PrecisionConfig(mode_a))
    b = make(PrecisionConfig(mode_b))
    b.load_state_dict(a.state_dict())
    x = torch.randn(*x_shape) * 2 + 0.5
    return a, b, x


def _x_hat(x):
    lo, hi = batch_range(x)
    return fake_quantize(x, qparams_from_range(lo, hi, 8, False))


def _kept(x):
    """1 where the input range kept ``x`` (its code is not an end of the grid other than zero), 0 where it clipped
    it: the input gradient flows only through the kept inputs (layers.py, clipped straight-through)."""
    lo, hi = batch_range(x)
    qp = qparams_from_range(lo, hi, 8, False)
    codes = quantize_codes(x, qp, False)
    return (~(((codes == qp.qmin) | (codes == qp.qmax)) & (codes != qp.zero_point))).float()


def _w_hat(w):
    return fake_quantize(w.detach(), tensor_qparams(w, 8, True))




LAYERS = {
    "linear": (lambda p: QLinear(24, 10, precision=p), (6, 24)),
    "linear3d": (lambda p: QLinear(24, 10, precision=p), (2, 3, 24)),
    "conv": (lambda p: QConv2d(5, 8, 3, padding=1, precision=p), (3, 5, 7, 7)),
    "conv-stride2": (lambda p: QConv2d(5, 8, 3, stride=2, padding=1, precision=p), (3, 5, 8, 8)),
    "conv-1x1-rect": (lambda p: QConv2d(5, 8, (1, 3), stride=(2, 1), precision=p), (2, 5, 5, 6)),
    "conv-grouped": (lambda p: QConv2d(4, 4, 3, padding=1, groups=2, precision=p), (2, 4, 5, 5)),
}


@pytest.mark.parametrize("kind", LAYERS)
def test_int8_products_equal_sim8_within_one_step(kind):
    make, shape = LAYERS[kind]
    sim, real, x = _pair(make, shape)
    y_s, dx_s, dw_s, db_s = forward_backward(sim, x, dy := torch.randn_like(sim(x)))
    y_i, dx_i, dw_i, db_i = forward_backward(real, x, dy)
    step = product_step(x, sim.weight)
    assert (y_s - y_i).abs().max() <= step
    assert torch.allclose(dx_s, dx_i, atol=1e-5, rtol=1e-4)  # same stochastic codes (same seed)
    assert torch.allclose(dw_s, dw_i, atol=1e-5, rtol=1e-4)
    assert torch.allclose(db_s, db_i)


@pytest.mark.parametrize("mode", ["sim8", "int8"])
def test_linear_gradient_bifurcation(mode):
    torch.manual_seed(0)
    layer = QLinear(16, 12, precision=PrecisionConfig(mode))
    x = torch.randn(32, 16)
    dy = torch.randn(32, 12)
    _, dx, dw, db = forward_backward(layer, x, dy, seed=7)
    x_hat, w_hat = _x_hat(x), _w_hat(layer.weight)
    # dW uses the UNQUANTIZED output gradient ...
    assert torch.allclose(dw, dy.t() @ x_hat, atol=1e-5)
    dy_q_nearest = fake_quantize(dy, tensor_qparams(dy, 8, True))
    assert not torch.allclose(dw, dy_q_nearest.t() @ x_hat, atol=1e-4)
    # ... while dX uses the 8-bit stochastically rounded one (same RNG draw as the layer).
    torch.manual_seed(7)
    dy_q = fake_quantize(dy, tensor_qparams(dy, 8, True), stochastic=True)
    kept = _kept(x)
    assert 0 < kept.mean() < 1  # the batch range clips some inputs (the mean of per-sample extremes)
    assert torch.allclose(dx, (dy_q @ w_hat) * kept, atol=1e-5)
    assert not torch.allclose(dx, (dy @ w_hat) * kept, atol=1e-4)
    assert torch.allclose(db, dy.sum(0))


@pytest.mark.parametrize("mode", ["sim8", "int8"])
def test_conv_gradient_bifurcation(mode):
    torch.manual_seed(0)
    layer = QConv2d(4, 6, 3, padding=1, bias=False, precision=PrecisionConfig(mode))
    x = torch.randn(2, 4, 6, 6)
    dy = torch.randn(2, 6, 6, 6)
    x_in = x.clone().requires_grad_()
    y = layer(x_in)
    torch.manual_seed(5)
    y.backward(dy)
    x_hat, w_hat = _x_hat(x), _w_hat(layer.weight)
    assert torch.allclose(layer.weight.grad, conv2d_weight(x_hat, w_hat.shape, dy, padding=1),
                          atol=1e-4)
    torch.manual_seed(5)
    dy_q = fake_quantize(dy, tensor_qparams(dy, 8, True), stochastic=True)
    kept = _kept(x)
    assert 0 < kept.mean() < 1
    assert torch.allclose(x_in.grad, conv2d_input(x.shape, w_hat, dy_q, padding=1) * kept, atol=1e-4)
    assert not torch.allclose(x_in.grad, conv2d_input(x.shape, w_hat, dy, padding=1) * kept, atol=1e-3)


def test_forward_matches_fake_quant_formula():
    torch.manual_seed(0)
    layer = QConv2d(3, 4, 3, padding=1, precision=PrecisionConfig("sim8"))
    x = torch.randn(2, 3, 5, 5)
    expected = F.conv2d(_x_hat(x), _w_hat(layer.weight), layer.bias, padding=1)
    assert torch.allclose(layer(x), expected, atol=1e-6)


def test_master_weight_stays_fp32_and_is_not_modified():
    layer = QLinear(8, 4, precision=PrecisionConfig("int8"))
    before = layer.weight.detach().clone()
    layer(torch.randn(3, 8)).sum().backward()
    assert layer.weight.dtype == torch.float32 and torch.equal(layer.weight, before)


def test_int8_saves_int8_activations_for_backward():
    saved = {}
    for mode in ("sim8", "int8"):
        layer = QConv2d(8, 8, 3, padding=1, precision=PrecisionConfig(mode))
        sizes = []

        def pack(t, sizes=sizes):
            sizes.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            layer(torch.randn(4, 8, 16, 16, requires_grad=True))
        saved[mode] = sum(sizes)
    assert saved["int8"] * 4 <= saved["sim8"] * 1.01


@pytest.mark.parametrize("mode", ["sim8", "int8"])
def test_eval_is_deterministic(mode):
    torch.manual_seed(0)
    layer = QConv2d(3, 4, 3, padding=1, precision=PrecisionConfig(mode))
    x = torch.randn(4, 3, 6, 6)
    layer(x)  # training step initialises the running range
    layer.eval()
    outs = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        outs.append(layer(x))
    assert torch.equal(*outs)


def test_fp32_mode_is_plain():
    torch.manual_seed(0)
    layer = QLinear(5, 3, precision=PrecisionConfig("fp32"))
    x = torch.randn(4, 5)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    assert not hasattr(layer, "input_quant")


def test_string_padding_rejected_in_8bit_modes():
    with pytest.raises(ValueError, match="padding"):
        QConv2d(3, 3, 3, padding="same", precision=PrecisionConfig("sim8"))


def test_qadd_quantizes_both_inputs():
    add = QAdd(PrecisionConfig("sim8"))
    a, b = torch.randn(4, 3, 2, 2), torch.randn(4, 3, 2, 2) * 10
    assert torch.allclose(add(a, b), _x_hat(a) + _x_hat(b), atol=1e-6)
    assert not torch.allclose(add(a, b), a + b, atol=1e-4)
    assert torch.equal(QAdd()(a, b), a + b)


@pytest.mark.parametrize("zero_point", [0.0, 255.0, 128.0, 3.0, 127.5])
def test_the_clipped_mask_of_uint8_codes_is_the_general_rule(zero_point):
    """The int8 mode's one-comparison mask (uint8 codes, ends 0 and 255) marks exactly what the general rule does:
    an end of the grid that is not the zero point."""
    from peer.lowp.layers import _clipped

    codes = torch.randint(0, 256, (4, 8, 5, 5), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    codes.view(-1)[:6] = torch.tensor([0, 255, 1, 254, 0, 255], dtype=torch.uint8)
    codes = codes.contiguous(memory_format=torch.channels_last)
    zp = torch.tensor(zero_point)
    want = ((codes == 0) | (codes == 255)) & (codes != zp)
    got = _clipped(codes, zp, 0, 255)
    assert got.dtype == torch.bool and torch.equal(got, want) and bool(want.any())
    assert torch.equal(_clipped(codes.float(), zp, 0, 255), want)  # another dtype: the general rule
