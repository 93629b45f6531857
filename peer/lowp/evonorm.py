"""Batch-independent normalisation-activation layers (METHOD.md 6) and their factory.

EvoNorm-S0 and Range EvoNorm compute statistics per sample and per channel group only, so a
sample's output never depends on the other samples of the batch (which is what makes them
work on non-IID peers). In sim8/int8 the layer input is quantized to 8 bits; in int8 only
its int8 codes are saved for backward and the (cheap, elementwise) layer is recomputed
from them in the backward pass, instead of saving several fp32 intermediates.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from peer.lowp.kinds import NORM_KINDS
from peer.lowp.precision import PrecisionConfig
from peer.lowp.quantize import ActivationQuantizer, QParams, dequantize, fake_quantize, quantize_int8


class _RecomputeFromInt8(torch.autograd.Function):
    """``fn(Q(x), *params)`` saving only int8 codes of x; recomputes ``fn`` in backward (STE on x)."""

    @staticmethod
    def forward(ctx, x: Tensor, qp: QParams, fn: Callable[..., Tensor], *params: Tensor) -> Tensor:
        codes = quantize_int8(x, qp, stochastic=False)
        ctx.save_for_backward(codes, *params)
        ctx.qp, ctx.fn = qp, fn
        return fn(dequantize(codes, ctx.qp), *params)

    @staticmethod
    def backward(ctx, g: Tensor):
        codes, *params = ctx.saved_tensors
        with torch.enable_grad():
            x_hat = dequantize(codes, ctx.qp).requires_grad_()
            leaves = [p.detach().requires_grad_() for p in params]
            y = ctx.fn(x_hat, *leaves)
            # the gradient of the scalar <y, g> equals grad(y, ..., grad_outputs=g) bit for bit, and unlike it does
            # not make torch import sympy (~490 modules, ~35 MiB per daemon) on first use
            grads = torch.autograd.grad((y * g).sum(), [x_hat, *leaves])
        return (grads[0], None, None, *grads[1:])


def _grouped(x: Tensor, groups: int) -> Tensor:
    """[N, C, H, W] -> [N, G, C/G*H*W] (a view: per-sample, per-group statistics)."""
    return x.reshape(x.shape[0], groups, -1)


class _GroupNormAct(nn.Module):
    """Shared parameters (v, gamma, beta, each [1,C,1,1]), grouping and input quantization."""

    def __init__(self, channels: int, groups: int = 8, eps: float = 1e-5,
                 precision: PrecisionConfig = PrecisionConfig()) -> None:
        super().__init__()
        self.channels = channels
        self.groups = math.gcd(channels, groups)  # largest group count <= groups dividing C
        self.eps = eps
        self.precision = precision
        self.v = nn.Parameter(torch.ones(1, channels, 1, 1))
        self.gamma = nn.Parameter(torch.ones(1, channels, 1, 1))
        self.beta = nn.Parameter(torch.zeros(1, channels, 1, 1))
        if precision.quantized:
            self.input_quant = ActivationQuantizer(precision.bits)

    def formula(self, x: Tensor, v: Tensor, gamma: Tensor, beta: Tensor) -> Tensor:
        """The layer on an fp32 (possibly already dequantized) input [N, C, H, W]."""
        raise NotImplementedError

    def forward(self, x: Tensor) -> Tensor:
        params = (self.v, self.gamma, self.beta)
        if not self.precision.quantized:
            return self.formula(x, *params)
        qp = self.input_quant.qparams(x)
        if self.precision.mode == "int8":
            return _RecomputeFromInt8.apply(x, qp, self.formula, *params)
        return self.formula(fake_quantize(x, qp), *params)

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

    def formula(self, x: Tensor, v: Tensor, gamma: Tensor, beta: Tensor) -> Tensor:
        std = (_grouped(x, self.groups).var(-1, unbiased=False, keepdim=True) + self.eps).sqrt()
        num = _grouped(x * torch.sigmoid(v * x), self.groups)
        return (num / std).reshape(x.shape) * gamma + beta


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

    def formula(self, x: Tensor, v: Tensor, gamma: Tensor, beta: Tensor) -> Tensor:
        xg = _grouped(x, self.groups)
        lo, hi = torch.aminmax(xg, dim=-1, keepdim=True)
        den = range_constant(xg.shape[-1]) * (hi - lo) + self.eps
        num = _grouped(x * F.hardsigmoid(v * x), self.groups)
        return (num / den).reshape(x.shape) * gamma + beta


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
