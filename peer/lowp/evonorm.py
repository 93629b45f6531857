"""Batch-independent normalisation-activation layers (docs/method.md#normalisation-layers) and their factory.

EvoNorm-S0 and Range EvoNorm compute statistics per sample and per channel group only, so a
sample's output never depends on the other samples of the batch (which is what makes them
work on non-IID peers). In sim8/int8 the layer input is quantized to 8 bits; in int8 only
its 1-byte codes are saved for backward and the (elementwise) layer is recomputed from them
in the backward pass, instead of saving several fp32 intermediates. In int8 the layer runs
as one compiled function of the codes where torch.compile works (passes.py), eagerly otherwise.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from peer.lowp.counter_rng import sr_seed
from peer.lowp.handoff import activation_codes, attach_activation_codes, attach_gradient_codes
from peer.lowp.kinds import NORM_KINDS
from peer.lowp.layout import is_channels_last
from peer.lowp.passes import FusedPasses
from peer.lowp.precision import PrecisionConfig
from peer.lowp.qmath import (
    Codes,
    grad_codes_hashed,
    gradient_codes_of,
    gradient_grid_max,
)
from peer.lowp.qmath import act_batch_codes as _act_batch_codes
from peer.lowp.qmath import act_batch_codes_eager as _act_batch_codes_eager
from peer.lowp.qmath import empty_in_layout as _empty_in_layout
from peer.lowp.qmath import grid as _grid
from peer.lowp.quantize import ActivationQuantizer, fake_quantize
from peer.lowp.twins import eager_twin

Formula = Callable[[Tensor, Tensor, Tensor, Tensor, int, float], Tensor]
#: (x, v, gamma, beta, groups, eps, dL/dy) -> (dL/dx, dL/dv, dL/dgamma, dL/dbeta)
Backward = Callable[[Tensor, Tensor, Tensor, Tensor, int, float, Tensor], tuple[Tensor, Tensor, Tensor, Tensor]]
#: A Backward's eager twin, from the codes: (data, scale, zero_point, v, gamma, beta, groups, eps, dL/dy,
#: channels_last: the layout dL/dx is written in) -> the Backward's results at the dequantized codes.
EagerBackward = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, int, float, Tensor, bool],
                         tuple[Tensor, Tensor, Tensor, Tensor]]


def _from_codes(formula: Formula, data: Tensor, scale: Tensor, zero_point: Tensor, v: Tensor, gamma: Tensor,
                beta: Tensor, groups: int, eps: float) -> Tensor:
    """``formula`` on the dequantized codes (fused: the fp32 input is never materialised when compiled)."""
    return formula((data.float() - zero_point) * scale, v, gamma, beta, groups, eps)


def _from_codes_with_output_codes(formula: Formula, data: Tensor, scale: Tensor, zero_point: Tensor, v: Tensor,
                                  gamma: Tensor, beta: Tensor, groups: int, eps: float, qmin: int,
                                  qmax: int) -> tuple[Tensor, ...]:
    """:func:`_from_codes` plus the batch codes of its output (channels_last, what a following convolution reads;
    a residual add takes any layout), in one fused pass: the output is not read back by a separate quantization."""
    y = _from_codes(formula, data, scale, zero_point, v, gamma, beta, groups, eps)
    return (y, *_act_batch_codes(y, qmin, qmax, True))


def _dequantized(data: Tensor, scale: Tensor, zero_point: Tensor) -> Tensor:
    """``(data.float() - zero_point) * scale`` in one contiguous fp32 buffer (uint8 minus a 0-d fp32 tensor promotes
    inside the subtraction): the eager twins' input, bit for bit the bodies'."""
    return torch.sub(data, zero_point, out=torch.empty(data.shape, device=data.device)).mul_(scale)


@eager_twin(_from_codes)
def _from_codes_eager(formula: Formula, data: Tensor, scale: Tensor, zero_point: Tensor, v: Tensor, gamma: Tensor,
                      beta: Tensor, groups: int, eps: float) -> Tensor:
    """:func:`_from_codes` with the formula's in-place twin (where it has one)."""
    return EAGER_FORMULAS.get(formula, formula)(_dequantized(data, scale, zero_point), v, gamma, beta, groups, eps)


@eager_twin(_from_codes_with_output_codes)
def _from_codes_with_output_codes_eager(formula: Formula, data: Tensor, scale: Tensor, zero_point: Tensor, v: Tensor,
                                        gamma: Tensor, beta: Tensor, groups: int, eps: float, qmin: int,
                                        qmax: int) -> tuple[Tensor, ...]:
    """:func:`_from_codes_with_output_codes` from the eager twins."""
    y = _from_codes_eager(formula, data, scale, zero_point, v, gamma, beta, groups, eps)
    return (y, *_act_batch_codes_eager(y, qmin, qmax, True))


def _grad_from_codes(formula: Formula, data: Tensor, scale: Tensor, zero_point: Tensor, v: Tensor, gamma: Tensor,
                     beta: Tensor, groups: int, eps: float, g: Tensor) -> tuple[Tensor, ...]:
    """Gradients of ``formula`` at the dequantized codes w.r.t. input, v, gamma, beta by plain autograd on the scalar
    <y, g>: the generic path, for formulas without a hand-derived backward (and the reference of the tests)."""
    x_hat = ((data.float() - zero_point) * scale).requires_grad_()
    v_leaf, gamma_leaf, beta_leaf = (t.detach().requires_grad_() for t in (v, gamma, beta))
    with torch.enable_grad():
        y = formula(x_hat, v_leaf, gamma_leaf, beta_leaf, groups, eps)
        return torch.autograd.grad((y * g).sum(), [x_hat, v_leaf, gamma_leaf, beta_leaf])


def _backward_from_codes(backward: Backward, data: Tensor, scale: Tensor, zero_point: Tensor, v: Tensor,
                         gamma: Tensor, beta: Tensor, groups: int, eps: float, g: Tensor,
                         channels_last: bool) -> tuple[Tensor, ...]:
    """A hand-derived backward at the dequantized codes, recompute included: one fused kernel set when compiled, no
    fp32 input kept between forward and backward. The input gradient is written in the layout of the layer's input
    (channels_last after a convolution: what that convolution's backward reads fastest)."""
    dx, *rest = backward((data.float() - zero_point) * scale, v, gamma, beta, groups, eps, g)
    if channels_last:
        dx = dx.contiguous(memory_format=torch.channels_last)
    return (dx, *rest)


@eager_twin(_backward_from_codes)
def _backward_from_codes_eager(backward: Backward, data: Tensor, scale: Tensor, zero_point: Tensor, v: Tensor,
                               gamma: Tensor, beta: Tensor, groups: int, eps: float, g: Tensor,
                               channels_last: bool) -> tuple[Tensor, ...]:
    """:func:`_backward_from_codes` by the backward's eager twin, which writes dL/dx in the wanted layout itself."""
    twin = EAGER_BACKWARDS.get(backward)
    if twin is None:
        return _backward_from_codes(backward, data, scale, zero_point, v, gamma, beta, groups, eps, g, channels_last)
    return twin(data, scale, zero_point, v, gamma, beta, groups, eps, g, channels_last)


def _backward_and_gradient_codes(backward: Backward, data: Tensor, scale: Tensor, zero_point: Tensor, v: Tensor,
                                  gamma: Tensor, beta: Tensor, groups: int, eps: float, g: Tensor,
                                  channels_last: bool, seed: Tensor, qmax: int) -> tuple[Tensor, ...]:
    """:func:`_backward_from_codes` plus the stochastic-rounding codes of the input gradient (what the product layer
    before the norm quantizes it to), in the same fused pass."""
    grads = _backward_from_codes(backward, data, scale, zero_point, v, gamma, beta, groups, eps, g, channels_last)
    codes, step = grad_codes_hashed(grads[0], seed, qmax, channels_last)
    return (*grads, codes, step)


def _contiguous(t: Tensor) -> Tensor:
    """``t`` in contiguous (NCHW) layout: compiled on its own, a channels_last -> NCHW copy is a tiled transpose
    (2-4x faster than aten's copy here), and the norms' per-group reductions read NCHW several times faster."""
    return t.contiguous()


def _from_product_layer(x: Tensor) -> bool:
    """Whether ``x`` is the output of an int8 product layer (QConv2d / QLinear), by its autograd node."""
    node = x.grad_fn
    return node is not None and type(node).__name__ == "_Int8ProductFnBackward"


class _RecomputeFromCodes(torch.autograd.Function):
    """``formula(Q(x), v, gamma, beta)`` saving only the codes of x; recomputed in backward (STE on x)."""

    @staticmethod
    def forward(ctx, x: Tensor, codes: Codes, formula: Formula, groups: int, eps: float, out_bits: int | None,
                engine: FusedPasses, v: Tensor, gamma: Tensor, beta: Tensor) -> Tensor:
        ctx.save_for_backward(codes.data, v, gamma, beta)
        ctx.meta = (codes.scale, codes.zero_point, codes.qmin, codes.qmax)
        ctx.formula, ctx.groups, ctx.eps, ctx.engine = formula, groups, eps, engine
        ctx.channels_last = is_channels_last(x)
        # the input came from a product layer (whose backward quantizes this norm's input gradient): hand it the codes
        ctx.gradient_bits = codes.qmax.bit_length() + 1 if _from_product_layer(x) else None
        if out_bits is None:
            return engine.run(f"{formula.__name__}_codes", _from_codes, formula, codes.data, codes.scale,
                                codes.zero_point, v, gamma, beta, groups, eps)
        # the output feeds an 8-bit layer (training): its batch codes come out of the same pass, handed on with it
        qmin, qmax = _grid(out_bits, symmetric=False)
        y, data, scale, zero_point, lo, hi = engine.run(
            f"{formula.__name__}_codes_q", _from_codes_with_output_codes, formula, codes.data, codes.scale,
            codes.zero_point, v, gamma, beta, groups, eps, qmin, qmax)
        attach_activation_codes(y, Codes(data, scale, zero_point, qmin, qmax), lo, hi, out_bits)
        return y

    @staticmethod
    def backward(ctx, g: Tensor):
        data, *params = ctx.saved_tensors
        scale, zero_point = ctx.meta[:2]
        engine = ctx.engine
        name = ctx.formula.__name__
        backward = BACKWARDS.get(ctx.formula)
        if backward is None:
            grads = engine.run(f"{name}_codes_grad", _grad_from_codes, ctx.formula, data, scale, zero_point,
                               *params, ctx.groups, ctx.eps, g)
        else:
            if not g.is_contiguous():
                g = engine.run("to_contiguous", _contiguous, g)
            bits = ctx.gradient_bits
            head = (backward, data, scale, zero_point, *params, ctx.groups, ctx.eps, g, ctx.channels_last)
            if bits is not None and engine.ready(f"{name}_codes_bwd_sr", _backward_and_gradient_codes, *head,
                                                 _seed_like(g.device), gradient_grid_max(bits)):
                *grads, codes, step = engine.run(f"{name}_codes_bwd_sr", _backward_and_gradient_codes, *head,
                                                 sr_seed(g.device), gradient_grid_max(bits))
                attach_gradient_codes(grads[0], gradient_codes_of(codes, step, bits), bits)
            else:
                grads = engine.run(f"{name}_codes_bwd", _backward_from_codes, backward, data, scale, zero_point,
                                   *params, ctx.groups, ctx.eps, g, ctx.channels_last)
        return (grads[0], None, None, None, None, None, None, *grads[1:])


@functools.cache
def _seed_like(device: torch.device) -> Tensor:
    """A tensor of a stochastic-rounding seed's signature (its graph's key): the real seed is drawn only if that
    graph runs, so that the eager path draws as many seeds as the compiled one."""
    return torch.zeros(2, dtype=torch.int32, device=device)


def _grouped(x: Tensor, groups: int) -> Tensor:
    """[N, C, H, W] -> [N, G, C/G*H*W] (per-sample, per-group statistics; a copy for channels_last input)."""
    return x.reshape(x.shape[0], groups, -1)


def evonorm_s0(x: Tensor, v: Tensor, gamma: Tensor, beta: Tensor, groups: int, eps: float) -> Tensor:
    """EvoNorm-S0 on an fp32 input [N, C, H, W]; parameters [1, C, 1, 1]."""
    std = (_grouped(x, groups).var(-1, unbiased=False, keepdim=True) + eps).sqrt()
    num = _grouped(x * torch.sigmoid(v * x), groups)
    return (num / std).reshape(x.shape) * gamma + beta


def range_evonorm(x: Tensor, v: Tensor, gamma: Tensor, beta: Tensor, groups: int, eps: float) -> Tensor:
    """Range EvoNorm on an fp32 input [N, C, H, W]; parameters [1, C, 1, 1] (see RangeEvoNorm)."""
    xg = _grouped(x, groups)
    den = range_constant(xg.shape[-1]) * (xg.amax(-1, keepdim=True) - xg.amin(-1, keepdim=True)) + eps
    num = _grouped(x * F.hardsigmoid(v * x), groups)
    return (num / den).reshape(x.shape) * gamma + beta


def _channel_sum(t: Tensor) -> Tensor:
    """Sum over batch and space, as a [1, C, 1, 1] parameter gradient."""
    return t.sum((0, 2, 3), keepdim=True)


def evonorm_s0_backward(x: Tensor, v: Tensor, gamma: Tensor, beta: Tensor, groups: int, eps: float,
                        g: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients of :func:`evonorm_s0` (derived by hand; what autograd computes, up to fp32 rounding order)."""
    xg = _grouped(x, groups)
    m = xg.shape[-1]
    mean = xg.mean(-1, keepdim=True)
    centred = xg - mean
    std = ((centred * centred).mean(-1, keepdim=True) + eps).sqrt()  # [N, G, 1]
    s = torch.sigmoid(v * x)
    num = x * s
    gn = _grouped(g * gamma, groups)
    d_num = (gn / std).reshape(x.shape)
    d_std = -(gn * _grouped(num, groups)).sum(-1, keepdim=True) / (std * std)
    d_var = d_std / (2.0 * std)
    ds = s * (1.0 - s)  # sigmoid'(v x)
    dx = d_num * (s + x * v * ds) + (d_var * (2.0 / m) * centred).reshape(x.shape)
    dv = _channel_sum(d_num * x * x * ds)
    d_gamma = _channel_sum(g * (_grouped(num, groups) / std).reshape(x.shape))
    return dx, dv, d_gamma, _channel_sum(g)


def range_evonorm_backward(x: Tensor, v: Tensor, gamma: Tensor, beta: Tensor, groups: int, eps: float,
                           g: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients of :func:`range_evonorm` (derived by hand, as autograd computes them: the gradient of a group's
    max (min) is shared equally by the elements that tie for it; hardsigmoid's slope is 1/6 strictly inside
    (-3, 3))."""
    xg = _grouped(x, groups)
    hi, lo = xg.amax(-1, keepdim=True), xg.amin(-1, keepdim=True)
    c = range_constant(xg.shape[-1])
    den = c * (hi - lo) + eps  # [N, G, 1]
    u = v * x
    s = F.hardsigmoid(u)
    num = x * s
    gn = _grouped(g * gamma, groups)
    d_num = (gn / den).reshape(x.shape)
    d_range = -(gn * _grouped(num, groups)).sum(-1, keepdim=True) / (den * den) * c
    slope = ((u > -3.0) & (u < 3.0)).to(x.dtype) * (1.0 / 6.0)  # hardsigmoid'(v x)
    at_hi, at_lo = (xg == hi).to(x.dtype), (xg == lo).to(x.dtype)
    d_ends = d_range * (at_hi / at_hi.sum(-1, keepdim=True) - at_lo / at_lo.sum(-1, keepdim=True))
    dx = d_num * (s + x * v * slope) + d_ends.reshape(x.shape)
    dv = _channel_sum(d_num * x * x * slope)
    d_gamma = _channel_sum(g * (_grouped(num, groups) / den).reshape(x.shape))
    return dx, dv, d_gamma, _channel_sum(g)


def evonorm_s0_linear(x: Tensor, v: Tensor, gamma: Tensor, beta: Tensor, groups: int, eps: float) -> Tensor:
    """EvoNorm-S0 without its activation (the gate ``sigmoid(v x)`` fixed at 1): ``x / sqrt(Var_g(x) + eps) * gamma +
    beta``, linear in x for given statistics. ``v`` is not read (kept for the Formula signature)."""
    xg = _grouped(x, groups)
    std = (xg.var(-1, unbiased=False, keepdim=True) + eps).sqrt()
    return (xg / std).reshape(x.shape) * gamma + beta


def range_evonorm_linear(x: Tensor, v: Tensor, gamma: Tensor, beta: Tensor, groups: int, eps: float) -> Tensor:
    """Range EvoNorm without its activation (the gate ``hsig(v x)`` fixed at 1): ``x / (C(m) * range_g(x) + eps) *
    gamma + beta``, linear in x for given statistics. ``v`` is not read (kept for the Formula signature)."""
    xg = _grouped(x, groups)
    den = range_constant(xg.shape[-1]) * (xg.amax(-1, keepdim=True) - xg.amin(-1, keepdim=True)) + eps
    return (xg / den).reshape(x.shape) * gamma + beta


def evonorm_s0_linear_backward(x: Tensor, v: Tensor, gamma: Tensor, beta: Tensor, groups: int, eps: float,
                               g: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients of :func:`evonorm_s0_linear` (by hand, as autograd computes them; dL/dv is zero: v is not read)."""
    xg = _grouped(x, groups)
    centred = xg - xg.mean(-1, keepdim=True)
    std = ((centred * centred).mean(-1, keepdim=True) + eps).sqrt()  # [N, G, 1]
    gn = _grouped(g * gamma, groups)
    d_var = -(gn * xg).sum(-1, keepdim=True) / (std * std) / (2.0 * std)
    dx = (gn / std + d_var * (2.0 / xg.shape[-1]) * centred).reshape(x.shape)
    return dx, torch.zeros_like(v), _channel_sum(g * (xg / std).reshape(x.shape)), _channel_sum(g)


def range_evonorm_linear_backward(x: Tensor, v: Tensor, gamma: Tensor, beta: Tensor, groups: int, eps: float,
                                  g: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients of :func:`range_evonorm_linear` (by hand, as autograd computes them: a group's max (min) gradient
    shared equally by the elements tying for it; dL/dv is zero: v is not read)."""
    xg = _grouped(x, groups)
    hi, lo = xg.amax(-1, keepdim=True), xg.amin(-1, keepdim=True)
    c = range_constant(xg.shape[-1])
    den = c * (hi - lo) + eps  # [N, G, 1]
    gn = _grouped(g * gamma, groups)
    d_range = -(gn * xg).sum(-1, keepdim=True) / (den * den) * c
    at_hi, at_lo = (xg == hi).to(x.dtype), (xg == lo).to(x.dtype)
    d_ends = d_range * (at_hi / at_hi.sum(-1, keepdim=True) - at_lo / at_lo.sum(-1, keepdim=True))
    dx = (gn / den + d_ends).reshape(x.shape)
    return dx, torch.zeros_like(v), _channel_sum(g * (xg / den).reshape(x.shape)), _channel_sum(g)


#: Hand-derived backward of each formula (int8 mode recomputes from codes and runs these in one fused pass).
BACKWARDS: dict[Formula, Backward] = {evonorm_s0: evonorm_s0_backward, range_evonorm: range_evonorm_backward,
                                      evonorm_s0_linear: evonorm_s0_linear_backward,
                                      range_evonorm_linear: range_evonorm_linear_backward}


# ---- eager twins (twins.eager_twin): the formulas and backwards above, operation for operation (the same bits),
# in place in a few reused buffers (full-size, or per block of samples) instead of one fresh fp32 temporary per op ----

#: Elements per block of the eager Range EvoNorm backward (whole samples; at least one): 1 MiB per fp32 buffer.
NORM_BLOCK_ELEMENTS = 1 << 18


def _group_view(t: Tensor, groups: int) -> Tensor:
    """[N, C, ...] -> [N, G, C/G*...] as a view (an in-place op on it must reach ``t``: raises where a copy would)."""
    return t.view(t.shape[0], groups, -1)


def _times_param(p: Tensor, x: Tensor) -> Tensor:
    """``p * x`` for a [1, C, 1, 1] parameter, in a fresh contiguous buffer (``x``'s layout otherwise)."""
    return torch.mul(p, x, out=torch.empty(x.shape, dtype=x.dtype, device=x.device))


def range_evonorm_eager(x: Tensor, v: Tensor, gamma: Tensor, beta: Tensor, groups: int, eps: float) -> Tensor:
    """:func:`range_evonorm` in one buffer besides ``x``."""
    xg = _grouped(x, groups)
    den = range_constant(xg.shape[-1]) * (xg.amax(-1, keepdim=True) - xg.amin(-1, keepdim=True)) + eps
    y = F.hardsigmoid(_times_param(v, x), inplace=True).mul_(x)  # x * hsig(v x)
    _group_view(y, groups).div_(den)
    return y.mul_(gamma).add_(beta)


def evonorm_s0_eager(x: Tensor, v: Tensor, gamma: Tensor, beta: Tensor, groups: int, eps: float) -> Tensor:
    """:func:`evonorm_s0` in one buffer besides ``x``."""
    std = (_grouped(x, groups).var(-1, unbiased=False, keepdim=True) + eps).sqrt()
    y = _times_param(v, x).sigmoid_().mul_(x)  # x * sigmoid(v x)
    _group_view(y, groups).div_(std)
    return y.mul_(gamma).add_(beta)


def _code_range(data: Tensor, scale: Tensor, zero_point: Tensor, groups: int) -> tuple[Tensor, ...]:
    """Each group's max and min of the dequantized codes, from the uint8 codes (dequantizing is strictly increasing:
    the same values as ``amax`` / ``amin`` of the fp32 input, from a quarter of the bytes), and the codes' own."""
    codes = _group_view(data, groups)
    code_hi, code_lo = codes.amax(-1, keepdim=True), codes.amin(-1, keepdim=True)
    return (code_hi.float() - zero_point) * scale, (code_lo.float() - zero_point) * scale, code_hi, code_lo


def _range_ends(codes: Tensor, code_hi: Tensor, code_lo: Tensor, d_range: Tensor) -> Tensor:
    """``d_range * (at_hi / #at_hi - at_lo / #at_lo)`` [N, G, m] for the grouped codes, their 0/1 indicators computed
    arithmetically from the integer distance ``t`` to the group's minimum code: at_lo = max(1 - t, 0), at_hi =
    max(t - (r - 1), 0) for r = max - min code (comparisons producing bool tensors were 6x slower than fp32
    arithmetic here)."""
    t = torch.sub(codes, code_lo.float())
    at_lo = torch.neg(t).add_(1.0).clamp_(min=0.0)
    at_hi = t.sub_((code_hi - code_lo).float() - 1.0).clamp_(min=0.0)
    return at_hi.div_(at_hi.sum(-1, keepdim=True)).sub_(at_lo.div_(at_lo.sum(-1, keepdim=True))).mul_(d_range)


def _range_backward_rows(data: Tensor, scale: Tensor, zero_point: Tensor, v: Tensor, gamma: Tensor, groups: int,
                         eps: float, g: Tensor, dx: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`range_evonorm_backward` for a slice of samples (a group never spans two samples): writes the slice's
    dL/dx into ``dx`` and returns its parts of dL/dv and dL/dgamma (sums over these samples). (x v) hardsigmoid'(v x)
    is ``hardsigmoid_backward(v x, v x)``: the same product where the slope is 1/6, 0 where it is 0."""
    x = _dequantized(data, scale, zero_point)
    hi, lo, code_hi, code_lo = _code_range(data, scale, zero_point, groups)
    c = range_constant(x[0].numel() // groups)  # m: elements per group
    den = c * (hi - lo) + eps  # [n, G, 1]
    u = _times_param(v, x)
    s = F.hardsigmoid(u)
    num = torch.mul(x, s)
    d_num = _times_param(gamma, g)  # g * gamma, then / den below
    work = torch.mul(_group_view(d_num, groups), _group_view(num, groups))
    d_range = -work.sum(-1, keepdim=True) / (den * den) * c
    _group_view(d_num, groups).div_(den)
    work = torch.mul(d_num, x, out=work.view(x.shape)).mul_(x)
    dv = _channel_sum(torch.ops.aten.hardsigmoid_backward.grad_input(work, u, grad_input=work))
    torch.ops.aten.hardsigmoid_backward.grad_input(u, u, grad_input=u).add_(s)  # s + x v hardsigmoid'(v x)
    ends = _range_ends(_group_view(data, groups), code_hi, code_lo, d_range)
    torch.add(u.mul_(d_num), ends.view(x.shape), out=dx)
    _group_view(num, groups).div_(den)
    return dv, _channel_sum(num.mul_(g))


def range_evonorm_backward_eager(data: Tensor, scale: Tensor, zero_point: Tensor, v: Tensor, gamma: Tensor,
                                 beta: Tensor, groups: int, eps: float, g: Tensor,
                                 channels_last: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`range_evonorm_backward` at the dequantized codes, dL/dx written channels_last if asked, computed for
    blocks of at most ``NORM_BLOCK_ELEMENTS`` elements (whole samples) in block-sized buffers: besides ``g`` only
    dL/dx is full-size. dL/dx and dL/dbeta are the body's bits; dL/dv and dL/dgamma too where the batch is one
    block, else they are the sums of the blocks' sums (the same terms, summed in another order: fp32 rounding)."""
    dx = _empty_in_layout(data, channels_last)
    step = max(1, NORM_BLOCK_ELEMENTS // max(data[0].numel(), 1))
    parts = [_range_backward_rows(data[rows], scale, zero_point, v, gamma, groups, eps, g[rows], dx[rows])
             for rows in (slice(start, start + step) for start in range(0, data.shape[0], step))]
    dv, d_gamma = (functools.reduce(torch.add, sums) for sums in zip(*parts))
    return dx, dv, d_gamma, _channel_sum(g)


def evonorm_s0_backward_eager(data: Tensor, scale: Tensor, zero_point: Tensor, v: Tensor, gamma: Tensor,
                              beta: Tensor, groups: int, eps: float, g: Tensor,
                              channels_last: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`evonorm_s0_backward` at the dequantized codes, in nine full-size buffers besides ``g``; dL/dx written
    channels_last if asked."""
    x = _dequantized(data, scale, zero_point)
    xg = _grouped(x, groups)
    m = xg.shape[-1]
    centred = xg - xg.mean(-1, keepdim=True)
    work = torch.mul(centred, centred)
    std = (work.mean(-1, keepdim=True) + eps).sqrt()  # [N, G, 1]
    s = _times_param(v, x).sigmoid_()
    num = torch.mul(x, s)
    d_num = _times_param(gamma, g)  # g * gamma, then / std below
    torch.mul(_group_view(d_num, groups), _group_view(num, groups), out=work)
    d_std = -work.sum(-1, keepdim=True) / (std * std)
    d_var = d_std / (2.0 * std)
    _group_view(d_num, groups).div_(std)
    ds = torch.neg(s, out=work.view(x.shape)).add_(1.0).mul_(s)  # sigmoid'(v x) = s (1 - s)
    dv = _channel_sum(torch.mul(d_num, x).mul_(x).mul_(ds))
    inner = torch.mul(x, v).mul_(ds).add_(s).mul_(d_num)  # d_num (s + x v sigmoid'(v x))
    dx = torch.add(inner, centred.mul_(d_var * (2.0 / m)).view(x.shape), out=_empty_in_layout(x, channels_last))
    _group_view(num, groups).div_(std)
    return dx, dv, _channel_sum(num.mul_(g)), _channel_sum(g)


EAGER_FORMULAS: dict[Formula, Formula] = {evonorm_s0: evonorm_s0_eager, range_evonorm: range_evonorm_eager}
EAGER_BACKWARDS: dict[Backward, EagerBackward] = {evonorm_s0_backward: evonorm_s0_backward_eager,
                                                  range_evonorm_backward: range_evonorm_backward_eager}


class _GroupNormAct(nn.Module):
    """Shared parameters (v, gamma, beta, each [1,C,1,1]), grouping and input quantization."""

    formula: Formula
    #: Whether the formula has an activation gate reading ``v``; the linear variants keep ``v`` as a constant,
    #: non-persistent buffer (not a parameter: never trained, saved or averaged) only for the formulas' signature.
    gated = True

    def __init__(self, channels: int, groups: int = 8, eps: float = 1e-5,
                 precision: PrecisionConfig = PrecisionConfig()) -> None:
        super().__init__()
        self.channels = channels
        self.groups = math.gcd(channels, groups)  # largest group count <= groups dividing C
        self.eps = eps
        self.precision = precision
        #: Set by a model whose every use of this layer's output is an 8-bit layer (conv, linear, residual add): in
        #: int8 training the output's batch codes are then computed in the layer's own fused pass and handed on.
        self.output_quantized = False
        if self.gated:
            self.v = nn.Parameter(torch.ones(1, channels, 1, 1))
        else:
            self.register_buffer("v", torch.ones(1, channels, 1, 1), persistent=False)
        self.gamma = nn.Parameter(torch.ones(1, channels, 1, 1))
        self.beta = nn.Parameter(torch.zeros(1, channels, 1, 1))
        if precision.quantized:
            self.input_quant = ActivationQuantizer(precision.bits)

    def forward(self, x: Tensor) -> Tensor:
        params = (self.v, self.gamma, self.beta)
        formula = type(self).formula
        if not self.precision.quantized:
            return formula(x, *params, self.groups, self.eps)
        if self.precision.mode == "int8":
            engine = self.precision.passes
            codes = activation_codes(self.input_quant, x, engine)
            out_bits = self.precision.bits if self.output_quantized and self.training and x.dim() == 4 else None
            return _RecomputeFromCodes.apply(x, codes, formula, self.groups, self.eps, out_bits, engine, *params)
        return formula(fake_quantize(x, self.input_quant.qparams(x)), *params, self.groups, self.eps)

    @torch.no_grad()
    def zero_gamma_(self) -> None:
        """Zero the output scale (second norm of a residual block starts as identity block)."""
        self.gamma.zero_()

    def extra_repr(self) -> str:
        return f"{self.channels}, groups={self.groups}, eps={self.eps}, mode={self.precision.mode}"


class EvoNormS0(_GroupNormAct):
    """EvoNorm-S0: ``y = x * sigmoid(v x) / sqrt(Var_g(x) + eps) * gamma + beta``.

    Var_g is the biased variance per sample over each group of C/G channels and H, W.
    """

    formula = staticmethod(evonorm_s0)


def range_constant(m: int) -> float:
    """C(m) = 1 / sqrt(2 ln m): expected range of m Gaussian samples ~ sigma / C(m) (m >= 2)."""
    return 1.0 / math.sqrt(2.0 * math.log(max(m, 2)))


class RangeEvoNorm(_GroupNormAct):
    """Range EvoNorm: ``y = x * hsig(v x) / (C(m) * range_g(x) + eps) * gamma + beta``.

    ``hsig(u) = clamp((u + 3) / 6, 0, 1)``; ``range_g`` is max - min per sample over each
    group (C/G channels x H x W = m elements) and ``C(m) = 1 / sqrt(2 ln m)`` as in the paper
    (m < 2 is treated as m = 2). Departures of the reference code, not followed here: it
    multiplies C by a further ``0.5 * 0.35 * (1 + sqrt(pi ln 4))`` and averages the range over
    16 chunks of each group instead of taking one range over the whole group.
    """

    formula = staticmethod(range_evonorm)


class EvoNormS0Linear(_GroupNormAct):
    """EvoNorm-S0 without its activation: ``y = x / sqrt(Var_g(x) + eps) * gamma + beta`` (no ``v``).

    For a BatchNorm that no activation follows (a linear bottleneck's projection, a shortcut's norm): the same
    per-sample group statistic as EvoNormS0, and the layer stays linear, as the BatchNorm was.
    """

    formula = staticmethod(evonorm_s0_linear)
    gated = False


class RangeEvoNormLinear(_GroupNormAct):
    """Range EvoNorm without its activation: ``y = x / (C(m) * range_g(x) + eps) * gamma + beta`` (no ``v``).

    For a BatchNorm that no activation follows (see EvoNormS0Linear); statistics as RangeEvoNorm's.
    """

    formula = staticmethod(range_evonorm_linear)
    gated = False


class BatchNormAct(nn.Module):
    """BatchNorm2d + ReLU, for comparison only (uses batch statistics: mixes samples)."""

    def __init__(self, channels: int, precision: PrecisionConfig = PrecisionConfig()) -> None:
        super().__init__()
        self.precision = precision
        self.bn = nn.BatchNorm2d(channels)
        if precision.quantized:
            self.input_quant = ActivationQuantizer(precision.bits)

    def forward(self, x: Tensor) -> Tensor:
        if self.precision.quantized:
            x = self.input_quant(x)
        return F.relu(self.bn(x))

    @torch.no_grad()
    def zero_gamma_(self) -> None:
        """Zero the BatchNorm scale (see _GroupNormAct.zero_gamma_)."""
        self.bn.weight.zero_()


def make_norm_act(kind: str, channels: int, precision: PrecisionConfig = PrecisionConfig(),
                  groups: int = 8) -> nn.Module:
    """Normalisation-activation layer of ``kind`` in NORM_KINDS for ``channels`` channels."""
    if kind == "evonorm":
        return EvoNormS0(channels, groups, precision=precision)
    if kind == "range-evonorm":
        return RangeEvoNorm(channels, groups, precision=precision)
    if kind == "batchnorm":
        return BatchNormAct(channels, precision)
    raise ValueError(f"norm must be one of {NORM_KINDS}, got {kind!r}")
