"""int8 mode saves 1-byte codes and masks for backward, never fp32 tensors of activation size (issue 9), and the
mask layers give exactly the gradients of the plain torch layers."""

import pytest
import torch
import torch.nn.functional as F

from peer.lowp import MaskDropout, MaskMaxPool2d, MaskReLU, PrecisionConfig
from peer.models import build_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")
INT8 = PrecisionConfig("int8")
MODELS = {"resnet20": (3, 32), "mnist-cnn": (1, 28), "vgg11": (3, 32)}
BATCH = 4
MIN_ACTIVATION = 64  # elements per sample: the smallest activation of these models (a 64-wide head input)


@pytest.fixture(autouse=True)
def eager_passes(monkeypatch):
    monkeypatch.setenv("LPDL_LOWP_EAGER", "1")  # every config's passes decide eager at first use


def _saved(model, x):
    """Every tensor autograd saves in one forward pass, parameters left out: (dtype, numel)."""
    saved = []
    params = {id(p) for p in model.parameters()}

    def pack(t):
        if id(t) not in params:
            saved.append((t.dtype, t.numel()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = F.cross_entropy(model(x), torch.arange(BATCH) % 10)
    loss.backward()
    return saved


@pytest.mark.parametrize("name", MODELS)
def test_int8_saves_nothing_fp32_of_activation_size(name):
    channels, size = MODELS[name]
    torch.manual_seed(0)
    x = torch.randn(BATCH, channels, size, size)
    saved = {mode: _saved(build_model(name, in_channels=channels, precision=PrecisionConfig(mode)), x)
             for mode in ("fp32", "int8")}
    big_float = [(d, n) for d, n in saved["int8"] if d.is_floating_point and n >= BATCH * MIN_ACTIVATION]
    assert big_float == []
    assert all(d.itemsize == 1 for d, n in saved["int8"] if n >= BATCH * MIN_ACTIVATION)
    if name != "vgg11":  # VGG-11 at batch 4: its 9 M weight codes (1 byte each, saved too) outweigh the activations
        nbytes = {mode: sum(d.itemsize * n for d, n in s) for mode, s in saved.items()}
        assert nbytes["int8"] * 4 <= nbytes["fp32"]  # 1 byte per saved activation element instead of 4 (or more)


def test_mask_max_pool_equals_max_pool():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 7, 9, requires_grad=True)
    g = torch.randn(2, 3, 3, 4)
    pool = MaskMaxPool2d(2, INT8)
    y = pool(x)
    (dx,) = torch.autograd.grad(y, x, g)
    x_ref = x.detach().requires_grad_()
    y_ref = F.max_pool2d(x_ref, 2)
    (dx_ref,) = torch.autograd.grad(y_ref, x_ref, g)
    assert torch.equal(y, y_ref) and torch.equal(dx, dx_ref)


@pytest.mark.parametrize("mode", ["fp32", "int8"])
@pytest.mark.parametrize("geometry, torch_calls", [(dict(kernel_size=2), []), (dict(kernel_size=(2, 3)), []),
                                                   (dict(kernel_size=(1, 2)), []), (dict(kernel_size=1), []),
                                                   (dict(kernel_size=3, stride=2, padding=1), [True])])
def test_evaluation_pools_with_torchs_values(mode, geometry, torch_calls, monkeypatch):
    """Without a gradient (a test evaluation) torch's NCHW CPU kernel (scalar, bench/pool.py) does not run:
    non-overlapping windows take each window's rows first, other geometries a channels-last copy - and the result
    is exactly torch's values, NCHW (odd sizes, padding, NaN and -inf included)."""
    torch.manual_seed(0)
    x = torch.randn(2, 5, 9, 11)
    x[0, 1, 2, 3], x[1, 4, 0, 0], x[1, 2, 5, 6] = float("nan"), float("-inf"), float("inf")
    pool = MaskMaxPool2d(precision=PrecisionConfig(mode), **geometry).eval()
    layouts = []
    real = F.max_pool2d
    monkeypatch.setattr(F, "max_pool2d", lambda t, *a, **k: layouts.append(
        t.is_contiguous(memory_format=torch.channels_last)) or real(t, *a, **k))
    with torch.no_grad():
        y = pool(x)
    monkeypatch.undo()
    expected = F.max_pool2d(x, geometry["kernel_size"], geometry.get("stride"), geometry.get("padding", 0))
    assert layouts == torch_calls
    assert y.data_ptr() != x.data_ptr()  # a new tensor, as torch's: an in-place op after it must not write into x
    assert y.is_contiguous() and torch.equal(y.isnan(), expected.isnan())
    assert torch.equal(y.nan_to_num(0.0), expected.nan_to_num(0.0))


def test_mask_relu_and_dropout_gradients():
    torch.manual_seed(0)
    x = torch.randn(64, 128, requires_grad=True)
    y = MaskReLU(INT8)(x)
    assert torch.equal(y, F.relu(x))
    (dx,) = torch.autograd.grad(y.sum(), x)
    assert torch.equal(dx, (x > 0).float())
    drop = MaskDropout(0.25, INT8).train()
    y = drop(x)
    kept = y != 0
    assert abs(kept.float().mean().item() - 0.75) < 0.02
    assert torch.allclose(y[kept], x[kept] / 0.75)
    (dx,) = torch.autograd.grad(y.sum(), x)
    assert torch.allclose(dx, kept.float() / 0.75)
    assert torch.equal(drop.eval()(x), x)
