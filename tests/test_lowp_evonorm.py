"""EvoNorm-S0 and Range EvoNorm: formulas on hand-computed tensors, per-sample independence."""

import math

import pytest
import torch

from peer.lowp import (
    BatchNormAct,
    EvoNormS0,
    PrecisionConfig,
    RangeEvoNorm,
    make_norm_act,
    range_constant,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(autouse=True)
def eager_passes(monkeypatch):
    """Eager quantization passes (no per-shape compilation in unit tests; compiled == eager: test_lowp_passes)."""
    monkeypatch.setenv("LPDL_LOWP_EAGER", "1")  # every config's passes decide eager at first use


# One sample, 2 channels, 1x2 spatial, 1 group -> m = 4 elements: values 0, 1, 2, 3.
X = torch.tensor([[[[0.0, 1.0]], [[2.0, 3.0]]]])


def test_evonorm_s0_hand_computed():
    norm = EvoNormS0(2, groups=1)
    var = 1.25  # mean 1.5, biased variance of 0, 1, 2, 3
    def sig(u):
        return 1 / (1 + math.exp(-u))
    expected = [x * sig(x) / math.sqrt(var + 1e-5) for x in (0.0, 1.0, 2.0, 3.0)]
    assert torch.allclose(norm(X).flatten(), torch.tensor(expected), atol=1e-6)


def test_range_evonorm_hand_computed():
    norm = RangeEvoNorm(2, groups=1)
    c = 1 / math.sqrt(2 * math.log(4))
    den = c * 3.0 + 1e-5  # range of 0..3 is 3
    def hsig(u):
        return min(1.0, max(0.0, (u + 3) / 6))
    expected = [x * hsig(x) / den for x in (0.0, 1.0, 2.0, 3.0)]
    assert torch.allclose(norm(X).flatten(), torch.tensor(expected), atol=1e-6)
    assert range_constant(4) == pytest.approx(c)


def test_groups_are_separate_and_affine_is_per_channel():
    norm = RangeEvoNorm(2, groups=2)  # each channel its own group: m = 2
    with torch.no_grad():
        norm.gamma.copy_(torch.tensor([2.0, 3.0]).view(1, 2, 1, 1))
        norm.beta.copy_(torch.tensor([0.5, -1.0]).view(1, 2, 1, 1))
    c = range_constant(2)
    def hsig(u):
        return min(1.0, max(0.0, (u + 3) / 6))
    y = norm(X).flatten()
    expected = [x * hsig(x) / (c * 1.0 + 1e-5) * g + b
                for x, g, b in ((0.0, 2, 0.5), (1.0, 2, 0.5), (2.0, 3, -1.0), (3.0, 3, -1.0))]
    assert torch.allclose(y, torch.tensor(expected), atol=1e-5)


def test_init_and_gcd_group_fallback():
    norm = EvoNormS0(12, groups=8)
    assert norm.groups == 4  # gcd(12, 8)
    assert torch.equal(norm.v, torch.ones(1, 12, 1, 1))
    assert torch.equal(norm.gamma, torch.ones(1, 12, 1, 1))
    assert torch.equal(norm.beta, torch.zeros(1, 12, 1, 1))
    assert make_norm_act("range-evonorm", 3, groups=8).groups == 1


@pytest.mark.parametrize("kind", ["evonorm", "range-evonorm"])
@pytest.mark.parametrize("mode", ["fp32", "sim8", "int8"])
def test_samples_never_mix(kind, mode):
    torch.manual_seed(0)
    norm = make_norm_act(kind, 16, PrecisionConfig(mode))
    x = torch.randn(3, 16, 4, 4)
    norm(x)  # training step: initialises the running input range
    # eval: in 8-bit training the input quantizer's range is a batch mean (docs/method.md#8-bit-local-training), so
    # only the norm itself is batch-independent; in eval the range is the running estimate.
    norm.eval()
    y = norm(x)
    x2 = x.clone()
    x2[1] = x2[1] * 7 + 3
    y2 = norm(x2)
    assert torch.equal(y[0], y2[0]) and torch.equal(y[2], y2[2])
    assert not torch.equal(y[1], y2[1])


@pytest.mark.parametrize("kind", ["evonorm", "range-evonorm"])
def test_fp32_training_samples_never_mix(kind):
    norm = make_norm_act(kind, 8, PrecisionConfig("fp32"))
    x = torch.randn(2, 8, 3, 3, requires_grad=True)
    y = norm(x)
    y[0].sum().backward()
    assert torch.equal(x.grad[1], torch.zeros_like(x.grad[1]))


@pytest.mark.parametrize("kind", ["evonorm", "range-evonorm", "batchnorm"])
def test_int8_mode_equals_sim8_mode(kind):
    outs = []
    for mode in ("sim8", "int8"):
        torch.manual_seed(0)
        norm = make_norm_act(kind, 16, PrecisionConfig(mode))
        x = torch.randn(4, 16, 5, 5, requires_grad=True)
        y = norm(x)
        y.backward(torch.linspace(-1, 1, y.numel()).reshape(y.shape))
        outs.append([y.detach(), x.grad] + [p.grad for p in norm.parameters()])
    for a, b in zip(*outs):
        assert torch.allclose(a, b, atol=1e-6)


def test_8bit_modes_quantize_the_norm_input():
    norm = make_norm_act("range-evonorm", 8, PrecisionConfig("sim8", bits=2))
    ref = make_norm_act("range-evonorm", 8)
    x = torch.randn(2, 8, 3, 3)
    assert not torch.allclose(norm(x), ref(x), atol=1e-3)


def test_zero_gamma_and_factory():
    for kind in ("evonorm", "range-evonorm", "batchnorm"):
        norm = make_norm_act(kind, 8)
        norm.zero_gamma_()
        out = norm(torch.randn(2, 8, 3, 3))
        assert torch.equal(out, torch.zeros_like(out))
    assert isinstance(make_norm_act("batchnorm", 4), BatchNormAct)
    with pytest.raises(ValueError, match="norm must be one of"):
        make_norm_act("layernorm", 4)
