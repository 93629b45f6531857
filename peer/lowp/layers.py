"""Quantized layers: QLinear, QConv2d (8-bit weights, inputs and layer gradients) and QAdd.

Numerics (METHOD.md 5), identical in sim8 and int8 up to fp32 accumulation order:

* forward ``y = op(Q(x), Q(W)) + b``: input codes asymmetric (batch range, nearest),
  weight codes symmetric ``+-max|W|`` (nearest); the fp32 master weight is kept.
* backward, gradient bifurcation:
  ``dL/dx = op_input_grad(Qs(dL/dy), Q(W))`` with ``Qs`` symmetric 8-bit *stochastic*
  rounding of the output gradient; ``dL/dW = op_weight_grad(Q(x), dL/dy)`` from the
  UNQUANTIZED fp32 output gradient. Straight-through: these are the gradients returned for
  the fp32 ``x`` and master ``W``.

sim8 computes the products in fp32 on dequantized values and saves them for backward.
int8 computes ``Q(x) Q(W)`` and ``Qs(dy) Q(W)`` with int8 x int8 -> int32 kernels
(``torch._int_mm``, conv through im2col) and saves only the int8 codes (+ scale) of the
input and weight for backward (4x less memory than fp32). Convolutions the int8 path does
not cover (groups > 1, dilation > 1) use the sim8 computation per call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.grad import conv2d_input, conv2d_weight

from peer.lowp.kernels import col2im, im2col_int8, int8_mm
from peer.lowp.precision import PrecisionConfig
from peer.lowp.quantize import (
    ActivationQuantizer,
    QParams,
    dequantize,
    fake_quantize,
    quantize_codes,
    quantize_int8,
    tensor_qparams,
)


class _LinearOp:
    """Products of a linear layer on [..., in] inputs; weight [out, in]."""

    int8_supported = True
    bias_dims: tuple[int, ...] | None = None  # all but the last

    def forward(self, x: Tensor, w: Tensor) -> Tensor:
        return F.linear(x, w)

    def grad_input(self, g: Tensor, w: Tensor, x_shape: torch.Size) -> Tensor:
        return g @ w

    def grad_weight(self, x: Tensor, g: Tensor, w_shape: torch.Size) -> Tensor:
        return g.reshape(-1, g.shape[-1]).t() @ x.reshape(-1, x.shape[-1])

    def int8_forward(self, xc: Tensor, xq: QParams, wc: Tensor, wq: QParams) -> Tensor:
        acc = int8_mm(xc.reshape(-1, xc.shape[-1]), wc.t())
        acc -= xq.zero_point.to(torch.int32) * wc.sum(1, dtype=torch.int32)
        return (acc.float() * (xq.scale * wq.scale)).reshape(*xc.shape[:-1], wc.shape[0])

    def int8_grad_input(self, gc: Tensor, gq: QParams, wc: Tensor, wq: QParams,
                        x_shape: torch.Size) -> Tensor:
        acc = int8_mm(gc.reshape(-1, gc.shape[-1]), wc)
        return (acc.float() * (gq.scale * wq.scale)).reshape(x_shape)


class _Conv2dOp:
    """Products of a 2-D convolution (NCHW, zero padding)."""

    bias_dims = (0, 2, 3)

    def __init__(self, conv: nn.Conv2d) -> None:
        self.kernel = conv.kernel_size
        self.stride, self.padding = conv.stride, conv.padding
        self.dilation, self.groups = conv.dilation, conv.groups
        self.int8_supported = self.groups == 1 and self.dilation == (1, 1)

    def _args(self) -> tuple:
        return self.stride, self.padding, self.dilation, self.groups

    def forward(self, x: Tensor, w: Tensor) -> Tensor:
        return F.conv2d(x, w, None, *self._args())

    def grad_input(self, g: Tensor, w: Tensor, x_shape: torch.Size) -> Tensor:
        return conv2d_input(x_shape, w, g, *self._args())

    def grad_weight(self, x: Tensor, g: Tensor, w_shape: torch.Size) -> Tensor:
        return conv2d_weight(x, w_shape, g, *self._args())

    def int8_forward(self, xc: Tensor, xq: QParams, wc: Tensor, wq: QParams) -> Tensor:
        n, c_out = xc.shape[0], wc.shape[0]
        cols = im2col_int8(xc, self.kernel, self.stride, self.padding, int(xq.zero_point))
        w2 = wc.reshape(c_out, -1)
        acc = int8_mm(cols, w2.t())
        acc -= xq.zero_point.to(torch.int32) * w2.sum(1, dtype=torch.int32)
        y = acc.float() * (xq.scale * wq.scale)
        ho, wo = self._out_hw(xc.shape[2:])
        return y.reshape(n, ho, wo, c_out).permute(0, 3, 1, 2)

    def int8_grad_input(self, gc: Tensor, gq: QParams, wc: Tensor, wq: QParams,
                        x_shape: torch.Size) -> Tensor:
        c_out = wc.shape[0]
        rows = gc.permute(0, 2, 3, 1).reshape(-1, c_out)
        cols = int8_mm(rows, wc.reshape(c_out, -1)).float() * (gq.scale * wq.scale)
        return col2im(cols, x_shape[0], tuple(x_shape[2:]), self.kernel, self.stride, self.padding)

    def _out_hw(self, hw: torch.Size) -> tuple[int, int]:
        return tuple((s + 2 * p - k) // st + 1
                     for s, p, k, st in zip(hw, self.padding, self.kernel, self.stride))


class _QProductFn(torch.autograd.Function):
    """8-bit product layer with gradient bifurcation (see module docstring)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, xq: QParams,
                op: _LinearOp | _Conv2dOp, bits: int, use_int8: bool) -> Tensor:
        wq = tensor_qparams(weight, bits, symmetric=True)
        if use_int8:
            xc, wc = quantize_int8(x, xq, False), quantize_int8(weight, wq, False)
            y = op.int8_forward(xc, xq, wc, wq)
        else:
            xc = dequantize(quantize_codes(x, xq, False), xq)
            wc = dequantize(quantize_codes(weight, wq, False), wq)
            y = op.forward(xc, wc)
        ctx.save_for_backward(xc, wc)
        ctx.xq, ctx.wq, ctx.op, ctx.bits, ctx.use_int8 = xq, wq, op, bits, use_int8
        ctx.x_shape, ctx.has_bias = x.shape, bias is not None
        return y if bias is None else y + (bias if op.bias_dims is None else bias[:, None, None])

    @staticmethod
    def backward(ctx, g: Tensor):
        xc, wc = ctx.saved_tensors
        op, xq, wq = ctx.op, ctx.xq, ctx.wq
        g = g.contiguous()
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            gq = tensor_qparams(g, ctx.bits, symmetric=True)
            if ctx.use_int8:
                dx = op.int8_grad_input(quantize_int8(g, gq, True), gq, wc, wq, ctx.x_shape)
            else:
                dx = op.grad_input(dequantize(quantize_codes(g, gq, True), gq), wc, ctx.x_shape)
        if ctx.needs_input_grad[1]:
            x_hat = dequantize(xc, xq) if ctx.use_int8 else xc
            dw = op.grad_weight(x_hat, g, wc.shape)  # fp32 dL/dy: gradient bifurcation
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = g.sum(op.bias_dims) if op.bias_dims else g.reshape(-1, g.shape[-1]).sum(0)
        return dx, dw, db, None, None, None, None


class _QProductMixin:
    """Shared quantized forward of QLinear / QConv2d."""

    precision: PrecisionConfig
    _op: _LinearOp | _Conv2dOp

    def _init_quant(self, precision: PrecisionConfig) -> None:
        self.precision = precision
        if precision.quantized:
            self.input_quant = ActivationQuantizer(precision.bits)

    def _qforward(self, x: Tensor) -> Tensor:
        use_int8 = self.precision.mode == "int8" and self._op.int8_supported
        return _QProductFn.apply(x, self.weight, self.bias, self.input_quant.qparams(x),
                                 self._op, self.precision.bits, use_int8)


class QLinear(_QProductMixin, nn.Linear):
    """nn.Linear computing in ``precision`` (already resolved, see resolve_precision)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 precision: PrecisionConfig = PrecisionConfig()) -> None:
        super().__init__(in_features, out_features, bias)
        self._init_quant(precision)
        self._op = _LinearOp()

    def forward(self, x: Tensor) -> Tensor:
        return self._qforward(x) if self.precision.quantized else super().forward(x)


class QConv2d(_QProductMixin, nn.Conv2d):
    """nn.Conv2d (zero padding, numeric padding in 8-bit modes) computing in ``precision``."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int | tuple[int, int],
                 stride: int | tuple[int, int] = 1, padding: int | tuple[int, int] = 0,
                 dilation: int | tuple[int, int] = 1, groups: int = 1, bias: bool = True, *,
                 precision: PrecisionConfig = PrecisionConfig()) -> None:
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation,
                         groups, bias)
        if precision.quantized and isinstance(self.padding, str):
            raise ValueError(f"padding must be numeric in {precision.mode} mode, "
                             f"got {padding!r}")
        self._init_quant(precision)
        self._op = _Conv2dOp(self)

    def forward(self, x: Tensor) -> Tensor:
        return self._qforward(x) if self.precision.quantized else super().forward(x)


class QAdd(nn.Module):
    """Residual add; in 8-bit modes both inputs are quantized first (METHOD.md 5)."""

    def __init__(self, precision: PrecisionConfig = PrecisionConfig()) -> None:
        super().__init__()
        self.precision = precision
        if precision.quantized:
            self.quant_a = ActivationQuantizer(precision.bits)
            self.quant_b = ActivationQuantizer(precision.bits)

    def forward(self, a: Tensor, b: Tensor) -> Tensor:
        if not self.precision.quantized:
            return a + b
        return (fake_quantize(a, self.quant_a.qparams(a))
                + fake_quantize(b, self.quant_b.qparams(b)))
