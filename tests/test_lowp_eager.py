"""Eager twins of the pass bodies (twins.eager_twin): bit for bit the bodies' results, in place in a few buffers,
used by the eager path only; eager stochastic rounding draws the compiled generator's bits in either layout."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from peer.lowp import evonorm as E
from peer.lowp import masks as M
from peer.lowp import qmath as Q
from peer.lowp import twins
from peer.lowp.counter_rng import sr_seed
from peer.lowp.passes import FusedPasses, PassInfo
from peer.lowp.quantize import quantize_codes, tensor_qparams

pytestmark = pytest.mark.usefixtures("one_torch_thread")
CL = torch.channels_last


def _same(got, want) -> None:
    """Equal values, dtypes and layouts (strides; ambiguous for 1x1 spatial tensors, so compared where defined)."""
    got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b)
        if a.dim() < 4 or a.shape[-2:] != (1, 1):
            assert a.stride() == b.stride()


def _inputs(shape, layout):
    torch.manual_seed(0)
    x = torch.randn(shape) * 2 + 0.3
    return x.contiguous(memory_format=layout) if x.dim() == 4 else x


SHAPES = [(8, 16, 6, 6), (3, 12, 7, 9), (4, 24), (2, 8, 1, 1)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("layout", [torch.contiguous_format, CL])
@pytest.mark.parametrize("channels_last", [False, True])
def test_activation_twins_equal_the_bodies(shape, layout, channels_last):
    x = _inputs(shape, layout)
    cl = channels_last and x.dim() == 4
    _same(Q.act_batch_codes_eager(x, -128, 127, cl), Q.act_batch_codes(x, -128, 127, cl))
    lo, hi = torch.tensor(-1.0), torch.tensor(2.5)  # values outside the range: clamped
    _same(Q.act_range_codes_eager(x, lo, hi, -8, 7, cl), Q.act_range_codes(x, lo, hi, -8, 7, cl))
    codes, scale, zp = Q.act_range_codes(x, lo, hi, -128, 127, cl)
    _same(Q.centered_eager(codes, zp), Q.centered(codes, zp))
    other = codes.flip(0).contiguous(memory_format=CL) if codes.dim() == 4 else codes.flip(0)
    _same(Q.dequant_sum_eager(codes, scale, zp, other, scale * 1.7, zp - 3),
          Q.dequant_sum(codes, scale, zp, other, scale * 1.7, zp - 3))


def test_activation_twin_computes_in_the_bodys_dtype():
    x = _inputs((4, 8, 5, 5), CL).mul(3).to(torch.bfloat16)  # x / scale rounds in bf16 in the body
    lo, hi = torch.tensor(-1.0), torch.tensor(2.0)
    _same(Q.act_range_codes_eager(x, lo, hi, -128, 127, False), Q.act_range_codes(x, lo, hi, -128, 127, False))


@pytest.mark.parametrize("shape, kernel", [((8, 16, 12, 12), (2, 2)), ((3, 4, 7, 9), (2, 2)), ((2, 3, 9, 9), (3, 3)),
                                           ((2, 3, 8, 8), (2, 4)), ((2, 3, 5, 6), (1, 2)), ((2, 3, 5, 6), (1, 1))])
def test_window_pool_twins_equal_the_bodies_with_ties(shape, kernel):
    x = _inputs(shape, torch.contiguous_format).round()  # many ties: the first maximal tap, as max(-1) picks
    y, offset = M._window_max(x, kernel)
    _same(M._window_max_eager(x, kernel), (y, offset))
    g = torch.randn(y.shape)
    _same(M._window_scatter_eager(g, offset, kernel, shape[-2:]), M._window_scatter(g, offset, kernel, shape[-2:]))


def _norm_case(shape, groups):
    torch.manual_seed(1)
    n, c = shape[:2]
    data = torch.randint(0, 256, shape, dtype=torch.uint8)
    data[0, :2] = 200  # ties at a group's max
    data[-1, :c // groups] = 17  # a constant group: max == min
    params = [torch.randn(1, c, 1, 1) * 2, torch.randn(1, c, 1, 1), torch.randn(1, c, 1, 1)]
    return data, torch.tensor(0.037), torch.tensor(121.0), params


@pytest.mark.parametrize("formula", [E.range_evonorm, E.evonorm_s0])
@pytest.mark.parametrize("shape, groups", [((4, 32, 6, 6), 8), ((3, 12, 7, 9), 4), ((2, 8, 1, 1), 8)])
@pytest.mark.parametrize("block", [None, 1])
def test_norm_twins_equal_the_bodies(formula, shape, groups, block, monkeypatch):
    if block is not None:  # the Range EvoNorm backward in blocks of one sample
        monkeypatch.setattr(E, "NORM_BLOCK_ELEMENTS", block)
    data, scale, zp, params = _norm_case(shape, groups)
    _same(E._from_codes_eager(formula, data, scale, zp, *params, groups, 1e-5),
          E._from_codes(formula, data, scale, zp, *params, groups, 1e-5))
    _same(E._from_codes_with_output_codes_eager(formula, data, scale, zp, *params, groups, 1e-5, -128, 127),
          E._from_codes_with_output_codes(formula, data, scale, zp, *params, groups, 1e-5, -128, 127))
    g = torch.randn(shape)
    g.view(-1)[::7] = 0.0
    backward = E.BACKWARDS[formula]
    for channels_last in (False, True):
        got = E._backward_from_codes_eager(backward, data, scale, zp, *params, groups, 1e-5, g, channels_last)
        want = E._backward_from_codes(backward, data, scale, zp, *params, groups, 1e-5, g, channels_last)
        if block is not None and formula is E.range_evonorm and shape[0] > 1:  # dv, dgamma: sums of block sums
            for i in (1, 2):
                assert torch.allclose(got[i], want[i], rtol=1e-5, atol=1e-6)
            got, want = (got[0], got[3]), (want[0], want[3])
        _same(got, want)


def test_every_twin_is_tested_here():
    tested = {Q.act_range_codes, Q.act_batch_codes, Q.centered, Q.dequant_sum, M._window_max,
              M._window_scatter, E._from_codes, E._from_codes_with_output_codes, E._backward_from_codes, Q.grad_codes_hashed}
    assert set(twins._EAGER_TWINS) == tested


@pytest.mark.parametrize("shape", [(8, 16, 6, 6), (64, 128), (3 * Q.SR_CHUNK + 5,), (2, 3, 200, 200)])
@pytest.mark.parametrize("layout", [torch.contiguous_format, CL])
@pytest.mark.parametrize("channels_last", [False, True])
def test_eager_stochastic_rounding_equals_the_hashed_body_in_either_layout(shape, layout, channels_last):
    """Block by block in memory order (several blocks for the larger shapes), the twin draws what the body draws per
    element: the same codes, step and output layout; a full-range seed (one part negative) wraps the counters."""
    g = _inputs(shape, layout) * 3
    seed = torch.tensor([-0x7654321F, 0x12345678], dtype=torch.int32)
    cl = channels_last and g.dim() == 4
    codes, scale = Q.grad_codes_hashed_eager(g, seed, 127, cl)
    _same((codes, scale), Q.grad_codes_hashed(g, seed, 127, cl))
    assert codes.dtype == torch.uint8 and torch.equal(scale, tensor_qparams(g, 8, symmetric=True).scale)
    assert codes.is_contiguous(memory_format=CL if cl else torch.contiguous_format)


@pytest.mark.parametrize("layout", [torch.contiguous_format, CL])
def test_eager_stochastic_rounding_gives_sim8s_codes_under_the_same_seed(layout):
    """sim8's reference quantizer draws from the same generator: int8 and sim8 round a gradient alike."""
    g = _inputs((3, 12, 7, 9), layout) * 3
    qp = tensor_qparams(g, 8, symmetric=True)
    torch.manual_seed(5)
    want = quantize_codes(g, qp, stochastic=True).to(torch.int32) + 128
    torch.manual_seed(5)
    codes, _ = Q.grad_codes_hashed_eager(g, sr_seed(g.device), 127, False)
    assert torch.equal(codes.int(), want)


def test_the_eager_path_runs_the_twin_and_the_compiled_path_the_body(monkeypatch):
    calls = []
    monkeypatch.setitem(twins._EAGER_TWINS, Q.centered, lambda *a: calls.append("twin") or Q.centered_eager(*a))
    codes = torch.randint(0, 256, (4, 5), dtype=torch.uint8)
    FusedPasses(try_compile=False).run("centered", Q.centered, codes, torch.tensor(3.0))
    assert calls == ["twin"]
    engine = FusedPasses(try_compile=False)
    engine._info = PassInfo("compiled", "test")
    monkeypatch.setattr(engine, "_compile", lambda name, fn: lambda *a: calls.append(fn.__name__) or fn(*a))
    engine.run("centered", Q.centered, codes, torch.tensor(3.0))
    assert calls == ["twin", "centered"]


class _FullSizeBuffers(TorchDispatchMode):
    """Counts the ops that return an fp32 tensor of at least ``numel`` elements in fresh memory (not an input's:
    in-place and ``out=`` ops write into existing buffers): the full-size temporaries."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel, self.count = numel, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = {t.untyped_storage().data_ptr() for t in list(args) + list(kwargs.values())
                  if isinstance(t, torch.Tensor)}
        out = func(*args, **kwargs)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        self.count += sum(isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.numel() >= self.numel
                          and t.untyped_storage().data_ptr() not in inputs for t in outs)
        return out


def _buffers(fn, *args, numel: int) -> int:
    with _FullSizeBuffers(numel) as mode:
        fn(*args)
    return mode.count


def test_eager_twins_hold_few_full_size_temporaries(monkeypatch):
    """What the twins are for: the bodies run eagerly allocate one fp32 tensor per op (the Range EvoNorm backward
    28), the twins a few reused buffers; the Range EvoNorm backward works in blocks of samples, so only its outputs
    (dL/dx) is full-size."""
    shape, groups = (4, 32, 6, 6), 8
    data, scale, zp, params = _norm_case(shape, groups)
    g, numel = torch.randn(shape), data.numel()
    args = (E.range_evonorm_backward, data, scale, zp, *params, groups, 1e-5, g, True)
    assert _buffers(E._backward_from_codes, *args, numel=numel) >= 20
    monkeypatch.setattr(E, "NORM_BLOCK_ELEMENTS", data[0].numel())  # one sample per block
    assert _buffers(E._backward_from_codes_eager, *args, numel=numel) == 1
    assert _buffers(E._backward_from_codes_eager, *args, numel=data[0].numel()) <= 1 + 9 * shape[0]
    x = torch.randn(shape)
    assert _buffers(Q.act_batch_codes, x, -128, 127, True, numel=numel) >= 4
    assert _buffers(Q.act_batch_codes_eager, x, -128, 127, True, numel=numel) == 1
    seed = torch.tensor([1, 2], dtype=torch.int32)
    assert _buffers(Q.grad_codes_hashed, torch.randn(4 * Q.SR_CHUNK), seed, 127, False, numel=numel) >= 3
    assert _buffers(Q.grad_codes_hashed_eager, torch.randn(4 * Q.SR_CHUNK), seed, 127, False,
                    numel=Q.SR_CHUNK + 1) == 0
