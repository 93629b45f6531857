"""Uniform per-tensor k-bit quantizers (docs/method.md#8-bit-local-training, Banner et al. 2018).

Every quantized tensor is represented by *codes*: integers on the signed grid
``[qmin, qmax]`` (int8-storable for ``bits <= 8``) plus a per-tensor ``scale`` and an
integer ``zero_point``, so that ``x ~= (code - zero_point) * scale``.

* Asymmetric ("[min, max]") ranges are widened to contain 0 so that 0.0 (conv zero
  padding, ReLU-like zeros, zero-initialised norm outputs) is exactly representable.
* Symmetric ranges use ``+-max|x|`` on the grid ``[-(2^(b-1)-1), 2^(b-1)-1]`` with
  ``zero_point == 0`` (used for weights and gradients, whose sign matters).
* Rounding is to nearest or stochastic (``floor(x/scale + U[0,1))``, unbiased; U from counter_rng.py, the int8
  passes' generator: the same seed gives sim8 and int8 the same codes).
* All rounding uses the straight-through estimator: the gradient of ``fake_quantize``
  is the identity (the reference code's convention; no clipping mask).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from peer.lowp.counter_rng import hash_uniform, sr_seed

MIN_BITS, MAX_BITS = 2, 8
_TINY_SCALE = 1e-12  # keeps all-zero tensors (zero-init gamma) from dividing by zero


def check_bits(bits: int) -> int:
    """Return ``bits`` if it is an int in [2, 8], else raise ValueError naming the field."""
    if isinstance(bits, bool) or not isinstance(bits, int) or not MIN_BITS <= bits <= MAX_BITS:
        raise ValueError(f"bits must be an integer in {MIN_BITS}..{MAX_BITS}, got {bits!r}")
    return bits


@dataclass(frozen=True)
class QParams:
    """Per-tensor quantization parameters; ``scale`` and ``zero_point`` are 0-d float tensors."""

    scale: Tensor
    zero_point: Tensor
    qmin: int
    qmax: int


def qparams_from_range(lo: Tensor, hi: Tensor, bits: int, symmetric: bool) -> QParams:
    """Quantization parameters for the real range [lo, hi] (0-d tensors).

    Symmetric: scale = max(|lo|, |hi|) / (2^(b-1) - 1), zero point 0.
    Asymmetric: the range is widened to include 0, scale = (hi - lo) / (2^b - 1) and the
    zero point is the (integer) code of 0.0.
    """
    half = 2 ** (bits - 1)
    if symmetric:
        amax = torch.maximum(lo.abs(), hi.abs())
        scale = (amax / (half - 1)).clamp_min(_TINY_SCALE)
        return QParams(scale, torch.zeros_like(scale), -(half - 1), half - 1)
    lo = lo.clamp(max=0.0)
    hi = hi.clamp(min=0.0)
    scale = ((hi - lo) / (2 * half - 1)).clamp_min(_TINY_SCALE)
    zero_point = (-half - torch.round(lo / scale)).clamp(-half, half - 1)
    return QParams(scale, zero_point, -half, half - 1)


def tensor_qparams(x: Tensor, bits: int, symmetric: bool) -> QParams:
    """Quantization parameters from the [min, max] of the whole tensor (weights, gradients)."""
    x = x.detach()
    if symmetric:
        amax = x.abs().amax()
        return qparams_from_range(-amax, amax, bits, True)
    lo, hi = torch.aminmax(x)
    return qparams_from_range(lo, hi, bits, False)


def batch_range(x: Tensor) -> tuple[Tensor, Tensor]:
    """Activation range: the batch mean of the per-sample min and of the per-sample max."""
    x = x.detach()
    dims = tuple(range(1, x.dim()))  # amin/amax over dims: no copy for channels_last, ~20x faster than aminmax(dim)
    lo, hi = fixed_order_mean(torch.stack([x.amin(dims), x.amax(dims)], 1))  # both means in the same few ops
    return lo, hi


def fixed_order_mean(v: Tensor) -> Tensor:
    """Mean of ``v`` over its first dim, summed in one fixed order (pairwise: halves added elementwise, an odd last
    element carried), then divided by its length: the same bits eagerly (sim8, the eager passes) and compiled
    (inductor), where ``v.mean()`` leaves the order to the library (ATen and inductor summed 8 per-sample minima 1 ulp
    apart). Each column of a 2-D ``v`` is summed in exactly the order a 1-D ``v`` would be."""
    n = v.shape[0]
    while v.shape[0] > 1:
        half = v.shape[0] // 2
        pairs = v[:half] + v[half:2 * half]
        v = torch.cat([pairs, v[2 * half:]]) if v.shape[0] % 2 else pairs
    return v[0] / n


def quantize_codes(x: Tensor, qp: QParams, stochastic: bool) -> Tensor:
    """Integer codes of ``x`` as a float tensor, clamped to [qmin, qmax]."""
    y = x / qp.scale
    y = torch.floor(y + hash_uniform(y, sr_seed(y.device))) if stochastic else torch.round(y)
    return (y + qp.zero_point).clamp_(qp.qmin, qp.qmax)


def dequantize(codes: Tensor, qp: QParams) -> Tensor:
    """fp32 values ``(codes - zero_point) * scale`` of float or int8 codes."""
    return (codes.float() - qp.zero_point) * qp.scale


class _FakeQuantSTE(torch.autograd.Function):
    """Quantize-dequantize whose backward is the identity (straight-through estimator)."""

    @staticmethod
    def forward(ctx, x: Tensor, scale: Tensor, zero_point: Tensor, qmin: int, qmax: int,
                stochastic: bool) -> Tensor:
        qp = QParams(scale, zero_point, qmin, qmax)
        return dequantize(quantize_codes(x, qp, stochastic), qp)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None, None, None, None, None


def fake_quantize(x: Tensor, qp: QParams, stochastic: bool = False) -> Tensor:
    """``x`` rounded to the quantization grid (fp32 out), gradient passed straight through."""
    return _FakeQuantSTE.apply(x, qp.scale, qp.zero_point, qp.qmin, qp.qmax, stochastic)


class ActivationQuantizer(nn.Module):
    """Range tracker for one activation tensor (a layer input, a norm input, an add input).

    Training: the range is the batch mean of per-sample min and max (docs/method.md#8-bit-local-training) and an
    exponential moving average of it is kept in the ``running_lo`` / ``running_hi``
    buffers. Eval: the running range is used (or the batch range if no training step was
    ever seen), always with round-to-nearest: unlike the reference code we never round
    stochastically at evaluation time, so eval is deterministic.
    """

    running_lo: Tensor  # buffers, 0-d fp32
    running_hi: Tensor
    initialized: Tensor  # 0-d bool: a training batch has set the running range

    def __init__(self, bits: int = 8, symmetric: bool = False, momentum: float = 0.1) -> None:
        super().__init__()
        self.bits = check_bits(bits)
        self.symmetric = symmetric
        self.momentum = momentum
        self.register_buffer("running_lo", torch.zeros(()))
        self.register_buffer("running_hi", torch.zeros(()))
        self.register_buffer("initialized", torch.zeros((), dtype=torch.bool))

    def qparams(self, x: Tensor) -> QParams:
        """Quantization parameters for ``x``; updates the running range in training mode."""
        if self.training or not bool(self.initialized):
            lo, hi = batch_range(x)
            if self.training:
                self.observe(lo, hi)
        else:
            lo, hi = self.running_lo, self.running_hi
        return qparams_from_range(lo, hi, self.bits, self.symmetric)

    @torch.no_grad()
    def observe(self, lo: Tensor, hi: Tensor) -> None:
        """Fold a batch range into the running range (the first one initialises it)."""
        if bool(self.initialized):
            self.running_lo.lerp_(lo, self.momentum)
            self.running_hi.lerp_(hi, self.momentum)
        else:
            self.running_lo.copy_(lo)
            self.running_hi.copy_(hi)
            self.initialized.fill_(True)

    def forward(self, x: Tensor) -> Tensor:
        """Fake-quantized ``x`` (nearest rounding, STE gradient)."""
        return fake_quantize(x, self.qparams(x), stochastic=False)

    def extra_repr(self) -> str:
        return f"bits={self.bits}, symmetric={self.symmetric}, momentum={self.momentum}"
