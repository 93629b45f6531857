"""The quantization math of the int8 mode's fused passes: the pass bodies and their eager twins, as plain tensor
functions (docs/method.md#8-bit-local-training numerics). passes.py runs them compiled or eagerly.

Code formats (what the int8 kernels consume, see kernels.py):

* activations (asymmetric): ``uint8`` codes ``u = c + 128`` where ``c`` is the signed code of quantize.py, with
  zero point ``zp + 128``; value ``(u - zero_point) * scale``.
* layer gradients (symmetric, stochastic rounding): ``uint8`` codes ``u = c + 128``, zero point 128.
* weights (symmetric, nearest): ``int8`` codes ``c``, zero point 0.

Stochastic rounding draws its uniforms from the counter-based generator of counter_rng.py (a 32-bit hash of the
element's position and a per-call seed): compiled, inside the kernel; eagerly, one block of at most ``SR_CHUNK``
elements at a time; the same bits either way, and no full-size random tensor.

Eager twins (twins.py): run eagerly, a body written as a chain of out-of-place ops allocates one full-size fp32
temporary per op, where the compiler fuses the same chain into one kernel; a twin does the same operations in the same
order (the same bits) in place in one buffer. Why and how much: docs/decisions/lowp-passes.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from peer.lowp.counter_rng import BLOCK, hash_uniform, uniform_block_
from peer.lowp.layout import inverse_order, memory_order
from peer.lowp.quantize import batch_range
from peer.lowp.twins import eager_twin

CODE_OFFSET = 128  # uint8 code = signed code + 128
TINY_SCALE = 1e-12  # as quantize.py: all-zero tensors get a tiny positive scale
SR_CHUNK = BLOCK  # eager stochastic rounding: uniforms drawn per block of this many elements (in L2)

@dataclass(frozen=True)
class Codes:
    """A quantized tensor: integer ``data`` plus per-tensor ``scale`` and ``zero_point`` (0-d fp32 tensors).

    Value ``(data - zero_point) * scale``; ``qmin``/``qmax`` bound the signed code (``data - CODE_OFFSET`` for uint8).
    """

    data: Tensor
    scale: Tensor
    zero_point: Tensor
    qmin: int
    qmax: int

    def centered(self) -> Tensor:
        """fp32 integers ``data - zero_point`` (exact: |value| <= 255), eagerly (FusedPasses.centered compiles it)."""
        return centered_eager(self.data, self.zero_point)



def grid(bits: int, symmetric: bool) -> tuple[int, int]:
    """(qmin, qmax) of the signed ``bits``-bit grid: symmetric +-(2^(b-1) - 1), else [-2^(b-1), 2^(b-1) - 1]."""
    half = 2 ** (bits - 1)
    return (-(half - 1), half - 1) if symmetric else (-half, half - 1)



def layout_codes(codes: Tensor, channels_last: bool) -> Tensor:
    """Codes in the layout their consumer wants: channels_last for convolutions (what oneDNN's int8 convolution
    reads fastest), contiguous NCHW for the norms (per-group reductions are slow across channels_last strides)."""
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    return codes.contiguous(memory_format=fmt)


def empty_in_layout(like: Tensor, channels_last: bool, dtype: torch.dtype = torch.float32) -> Tensor:
    """An uninitialised tensor of ``like``'s shape in the layout ``_layout`` gives: an op writing into it (``out=``)
    converts the layout while it computes, instead of a separate transposing copy."""
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    return torch.empty(like.shape, dtype=dtype, device=like.device, memory_format=fmt)


def act_qparams(lo: Tensor, hi: Tensor, qmin: int, qmax: int) -> tuple[Tensor, Tensor]:
    """Step and signed zero point of the asymmetric grid of [lo, hi] widened to contain 0 (quantize.py's formulas)."""
    scale = ((hi.clamp(min=0.0) - lo.clamp(max=0.0)) / (qmax - qmin)).clamp_min(TINY_SCALE)
    zero_point = (qmin - torch.round(lo.clamp(max=0.0) / scale)).clamp(qmin, qmax)
    return scale, zero_point


def act_range_codes(x: Tensor, lo: Tensor, hi: Tensor, qmin: int, qmax: int,
                     channels_last: bool) -> tuple[Tensor, Tensor, Tensor]:
    """uint8 codes of ``x`` on the asymmetric grid of [lo, hi] (widened to contain 0); quantize.py's formulas."""
    scale, zero_point = act_qparams(lo, hi, qmin, qmax)
    codes = (torch.round(x / scale) + zero_point).clamp(qmin, qmax) + CODE_OFFSET
    return layout_codes(codes.to(torch.uint8), channels_last), scale, zero_point + CODE_OFFSET


@eager_twin(act_range_codes)
def act_range_codes_eager(x: Tensor, lo: Tensor, hi: Tensor, qmin: int, qmax: int,
                           channels_last: bool) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`act_range_codes` in one fp32 buffer of the output layout: divide into it, then round, shift and clamp
    in place (zero point and code offset added at once: all integers below 2^24, so exact) and cast straight to
    uint8 (integers in [0, 255] after the clamp: the cast is exact, no int32 step)."""
    scale, zero_point = act_qparams(lo, hi, qmin, qmax)
    offset = zero_point + CODE_OFFSET
    codes = torch.div(x, scale, out=empty_in_layout(x, channels_last))
    codes.round_().add_(offset).clamp_(qmin + CODE_OFFSET, qmax + CODE_OFFSET)
    return codes.to(torch.uint8), scale, offset


def batch_codes_with(range_codes: Callable, x: Tensor, qmin: int, qmax: int,
                      channels_last: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Range = batch mean of per-sample min and max (docs/method.md#8-bit-local-training), then ``range_codes`` on it;
    also the range."""
    lo, hi = batch_range(x)
    codes, scale, zero_point = range_codes(x, lo, hi, qmin, qmax, channels_last)
    return codes, scale, zero_point, lo, hi


def act_batch_codes(x: Tensor, qmin: int, qmax: int,
                     channels_last: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Training: the codes of ``x`` on its batch range (docs/method.md#8-bit-local-training); also returns the range."""
    return batch_codes_with(act_range_codes, x, qmin, qmax, channels_last)


@eager_twin(act_batch_codes)
def act_batch_codes_eager(x: Tensor, qmin: int, qmax: int,
                           channels_last: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """:func:`act_batch_codes` with the codes of :func:`act_range_codes_eager`."""
    return batch_codes_with(act_range_codes_eager, x, qmin, qmax, channels_last)


def grad_codes_hashed(g: Tensor, seed: Tensor, qmax: int, channels_last: bool) -> tuple[Tensor, Tensor]:
    """Symmetric stochastic-rounding codes of ``g`` (uint8, zero point 128), uniform draws from ``hash_uniform``."""
    scale = (g.abs().amax() / qmax).clamp_min(TINY_SCALE)
    codes = torch.floor(g / scale + hash_uniform(g, seed)).clamp(-qmax, qmax) + CODE_OFFSET
    return layout_codes(codes.to(torch.uint8), channels_last), scale


def _blocks(shape: tuple[int, ...], limit: int) -> Iterator[tuple[slice, ...]]:
    """Index tuples of consecutive blocks of a tensor of ``shape``, in its logical (row-major) order, each of at
    most ``limit`` elements where one innermost row fits (whole leading-dim slices where they fit, else recursing
    into a slice's own leading dim), so a block of any layout is a view."""
    if not shape:
        yield ()
        return
    inner = math.prod(shape[1:])
    if inner <= limit:
        step = max(1, limit // max(inner, 1))
        for start in range(0, shape[0], step):
            yield (slice(start, start + step),)
        return
    for i in range(shape[0]):
        for rest in _blocks(shape[1:], limit):
            yield (slice(i, i + 1), *rest)


def _abs_max(t: Tensor) -> Tensor:
    """``t.abs().amax()`` without the full-size ``abs`` temporary: max(max, -min), exact (two reductions:
    ``torch.aminmax`` over a whole tensor is far slower than ``amax``)."""
    return torch.maximum(t.amax(), -t.amin())


@eager_twin(grad_codes_hashed)
def grad_codes_hashed_eager(g: Tensor, seed: Tensor, qmax: int, channels_last: bool) -> tuple[Tensor, Tensor]:
    """:func:`grad_codes_hashed` block by block in ``g``'s memory order (at most ``SR_CHUNK`` elements each, in one
    reused fp32 and two int32 buffers: no full-size random or fp32 tensor), each block written into the output in
    its layout. The draws cost about half of mt19937's ``torch.rand`` (docs/decisions/lowp-passes.md)."""
    scale = (_abs_max(g) / qmax).clamp_min(TINY_SCALE)
    out = empty_in_layout(g, channels_last and g.dim() == 4, torch.uint8)
    order = memory_order(g)
    g = g.permute(order).contiguous()  # a view unless g is neither contiguous nor channels_last
    out = out.permute(order)
    size = min(g.numel(), SR_CHUNK)
    y = torch.empty(size, device=g.device)
    h, tmp = (torch.empty(size, dtype=torch.int32, device=g.device) for _ in range(2))
    seed = seed.to(g.device)
    start = torch.zeros((), dtype=torch.int32, device=g.device)
    for index in _blocks(tuple(g.shape), SR_CHUNK):
        part = g[index]
        n = part.numel()
        u = uniform_block_(y[:n], start, seed, h[:n], tmp[:n]).view(part.shape)
        u.addcdiv_(part, scale).floor_().clamp_(-qmax, qmax).add_(CODE_OFFSET)  # floor(g / scale + U[0, 1))
        out[index].copy_(u)
        start += n
    return out.permute(inverse_order(order)), scale


def gradient_codes_of(data: Tensor, scale: Tensor, bits: int) -> Codes:
    """The Codes of symmetric gradient codes ``data`` (uint8, zero point 128) with step ``scale``."""
    qmin, qmax = grid(bits, symmetric=True)
    return Codes(data, scale, torch.full_like(scale, CODE_OFFSET), qmin, qmax)


def gradient_grid_max(bits: int) -> int:
    """Largest symmetric code of ``bits`` (127 for 8 bits)."""
    return grid(bits, symmetric=True)[1]


def centered(data: Tensor, zero_point: Tensor) -> Tensor:
    """fp32 integers ``data - zero_point`` in one pass (the weight gradient's operand), layout kept."""
    return data.float() - zero_point


@eager_twin(centered, same_as_compiled=True)
def centered_eager(data: Tensor, zero_point: Tensor) -> Tensor:
    """:func:`centered` as one op: uint8 minus a 0-d fp32 tensor promotes to fp32 inside the subtraction."""
    return torch.sub(data, zero_point)


def to_channels_last(t: Tensor) -> Tensor:
    """``t`` in channels_last layout: compiled on its own, the copy is a tiled transpose (2-3x faster than aten's)."""
    return t.contiguous(memory_format=torch.channels_last)


def dequant_sum(a: Tensor, a_scale: Tensor, a_zp: Tensor, b: Tensor, b_scale: Tensor, b_zp: Tensor) -> Tensor:
    """``(a - a_zp) * a_scale + (b - b_zp) * b_scale`` in one pass (the 8-bit residual add)."""
    return (a.float() - a_zp) * a_scale + (b.float() - b_zp) * b_scale


@eager_twin(dequant_sum)
def dequant_sum_eager(a: Tensor, a_scale: Tensor, a_zp: Tensor, b: Tensor, b_scale: Tensor,
                       b_zp: Tensor) -> Tensor:
    """:func:`dequant_sum` in two fp32 buffers, in place (the first one returned)."""
    return torch.sub(a, a_zp).mul_(a_scale).add_(torch.sub(b, b_zp).mul_(b_scale))



def weight_codes_of(w: Tensor, qmin: int, qmax: int) -> tuple[Tensor, Tensor]:
    """Symmetric nearest-rounding int8 codes of a weight and their step."""
    scale = (w.abs().amax() / qmax).clamp_min(TINY_SCALE)
    return torch.round(w / scale).clamp(qmin, qmax).to(torch.int8), scale

