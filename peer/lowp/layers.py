"""Quantized layers: QLinear, QConv2d (8-bit weights, inputs and layer gradients) and QAdd.

Numerics (docs/method.md#8-bit-local-training), identical in sim8 and int8 up to fp32 rounding:

* forward ``y = op(Q(x), Q(W)) + b``: input codes asymmetric (batch range, nearest),
  weight codes symmetric ``+-max|W|`` (nearest); the fp32 master weight is kept.
* backward, gradient bifurcation:
  ``dL/dx = op_input_grad(Qs(dL/dy), Q(W))`` with ``Qs`` symmetric 8-bit *stochastic*
  rounding of the output gradient; ``dL/dW = op_weight_grad(Q(x), dL/dy)`` from the
  UNQUANTIZED fp32 output gradient. Straight-through: these are the gradients returned for
  the fp32 ``x`` and master ``W`` - except that ``dL/dx`` is 0 where ``x``'s code sits at an end of the grid (other
  than the zero point): the range clipped that input, so the forward did not depend on it (a clipped
  straight-through estimator; docs/method.md#departures-from-the-paper). The paper's plain straight-through kept
  pushing on inputs the forward had capped: MobileNetV3-Small at 32x32, whose batch-mean-of-extremes range clips
  1.6% of inputs carrying 10-27% of the signal, diverged in sim8 (loss 2.36 after 240 steps on 1,300 digits, fp32
  0.29) and trained as fp32 with the mask (0.27-0.30); the registry's models were not affected.

sim8 (the reference) computes the products in fp32 on dequantized values and saves them for backward.
int8 quantizes in fused passes (passes.py), hands codes between layers (handoff.py), computes ``Q(x) Q(W)`` and
``Qs(dy) Q(W)`` as exact integer products with the kernel the probe chose for the op kind and shape (plan.py), and
saves only the 1-byte codes (+ scale) of the input and weight for backward (4x less than fp32).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.grad import conv2d_input, conv2d_weight

from peer.lowp.handoff import activation_codes, gradient_codes
from peer.lowp.kernels import ConvGeometry
from peer.lowp.passes import Codes, FusedPasses, weight_codes
from peer.lowp.qmath import CODE_OFFSET
from peer.lowp.plan import KernelPlan, default_plan
from peer.lowp.precision import PrecisionConfig
from peer.lowp.quantize import (
    ActivationQuantizer,
    QParams,
    dequantize,
    fake_quantize,
    quantize_codes,
    tensor_qparams,
)


class _LinearOp:
    """Products of a linear layer on [..., in] inputs; weight [out, in]."""

    def forward(self, x: Tensor, w: Tensor) -> Tensor:
        return F.linear(x, w)

    def grad_input(self, g: Tensor, w: Tensor, x_shape: torch.Size) -> Tensor:
        return g @ w

    def grad_weight(self, x: Tensor, g: Tensor, w_shape: torch.Size) -> Tensor:
        return g.reshape(-1, g.shape[-1]).t() @ x.reshape(-1, x.shape[-1])

    def add_bias(self, y: Tensor, bias: Tensor) -> Tensor:
        return y + bias

    def bias_grad(self, g: Tensor) -> Tensor:
        return g.reshape(-1, g.shape[-1]).sum(0)

    # int8: codes in, exact integer products by the plan's kernels
    def int8_forward(self, plan: KernelPlan, xc: Codes, wc: Codes) -> Tensor:
        lead = xc.data.shape[:-1]
        y = plan.linear_fwd(_reshaped(xc, (-1, xc.data.shape[-1])), wc)
        return y.reshape(*lead, wc.data.shape[0])

    def int8_grad_input(self, plan: KernelPlan, gc: Codes, wc: Codes, x_shape: torch.Size) -> Tensor:
        return plan.linear_dgrad(_reshaped(gc, (-1, gc.data.shape[-1])), wc).reshape(x_shape)

    def int8_grad_weight(self, plan: KernelPlan, xc: Codes, g: Tensor, w_shape: torch.Size,
                         engine: FusedPasses) -> Tensor:
        return plan.linear_wgrad(_reshaped(xc, (-1, xc.data.shape[-1])), g.reshape(-1, g.shape[-1]))


def _two(v: tuple[int, ...]) -> tuple[int, int]:
    """A 2-D convolution's (height, width) setting, which torch types as a tuple of any length."""
    return v[0], v[1]


class _Conv2dOp:
    """Products of a 2-D convolution (NCHW, zero padding)."""

    def __init__(self, conv: nn.Conv2d) -> None:
        if isinstance(conv.padding, str):
            raise ValueError(f"padding {conv.padding!r}: 8-bit convolutions take numeric padding")
        self.geom = ConvGeometry(_two(conv.kernel_size), _two(conv.stride), _two(conv.padding),
                                 _two(conv.dilation), conv.groups)

    def _args(self) -> tuple:
        g = self.geom
        return g.stride, g.padding, g.dilation, g.groups

    def forward(self, x: Tensor, w: Tensor) -> Tensor:
        return F.conv2d(x, w, None, *self._args())

    def grad_input(self, g: Tensor, w: Tensor, x_shape: torch.Size) -> Tensor:
        return conv2d_input(x_shape, w, g, *self._args())

    def grad_weight(self, x: Tensor, g: Tensor, w_shape: torch.Size) -> Tensor:
        return conv2d_weight(x, w_shape, g, *self._args())

    def add_bias(self, y: Tensor, bias: Tensor) -> Tensor:
        return y + bias[:, None, None]

    def bias_grad(self, g: Tensor) -> Tensor:
        return g.sum((0, 2, 3))

    def int8_forward(self, plan: KernelPlan, xc: Codes, wc: Codes) -> Tensor:
        return plan.conv_fwd(xc, wc, self.geom)

    def int8_grad_input(self, plan: KernelPlan, gc: Codes, wc: Codes, x_shape: torch.Size) -> Tensor:
        return plan.conv_dgrad(gc, wc, self.geom, x_shape)

    def int8_grad_weight(self, plan: KernelPlan, xc: Codes, g: Tensor, w_shape: torch.Size,
                         engine: FusedPasses) -> Tensor:
        return plan.conv_wgrad(xc, g, w_shape, self.geom, engine)


def _reshaped(c: Codes, shape: tuple[int, ...]) -> Codes:
    return dataclasses.replace(c, data=c.data.reshape(shape))


def _clipped(codes: Tensor, zero_point: Tensor, low: int, high: int) -> Tensor:
    """Where an input's code is an end of the grid ``low`` / ``high`` and not the zero point: the range clipped that
    input (or it lies exactly on the end), so its input gradient is dropped (module docstring).

    The int8 mode's uint8 codes on the CPU (ends 0 and 255) take one comparison instead of three and two logical
    ops: comparisons that make bool tensors are slow in this torch build, and this mask took 0.40 ms for the MNIST
    CNN's second convolution's input at batch 32, 0.12 ms as ``codes + 1 <= 1`` (uint8 wraps 255 to 0), one AMD
    EPYC Zen 4 core - 2% of an int8 training step over its three layers."""
    if codes.dtype == torch.uint8 and (low, high) == (0, 255) and codes.device.type == "cpu":
        zp = float(zero_point)
        if zp == 0.0:
            return codes == 255
        if zp == 255.0:
            return codes == 0
        return (codes + 1) <= 1
    return ((codes == low) | (codes == high)) & (codes != zero_point)


class _Sim8ProductFn(torch.autograd.Function):
    """8-bit product layer simulated in fp32 (the reference; see module docstring)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, xq: QParams,
                op: _LinearOp | _Conv2dOp, bits: int) -> Tensor:
        wq = tensor_qparams(weight, bits, symmetric=True)
        x_codes = quantize_codes(x, xq, False)
        x_hat = dequantize(x_codes, xq)
        w_hat = dequantize(quantize_codes(weight, wq, False), wq)
        ctx.save_for_backward(x_hat, w_hat, _clipped(x_codes, xq.zero_point, xq.qmin, xq.qmax))
        ctx.op, ctx.bits, ctx.x_shape, ctx.has_bias = op, bits, x.shape, bias is not None
        y = op.forward(x_hat, w_hat)
        return y if bias is None else op.add_bias(y, bias)

    @staticmethod
    def backward(ctx, g: Tensor):
        x_hat, w_hat, clipped = ctx.saved_tensors
        op = ctx.op
        g = g.contiguous()
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            gq = tensor_qparams(g, ctx.bits, symmetric=True)
            dx = op.grad_input(dequantize(quantize_codes(g, gq, True), gq), w_hat, ctx.x_shape).masked_fill_(
                clipped, 0.0)
        if ctx.needs_input_grad[1]:
            dw = op.grad_weight(x_hat, g, w_hat.shape)  # fp32 dL/dy: gradient bifurcation
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = op.bias_grad(g)
        return dx, dw, db, None, None, None


class _Int8ProductFn(torch.autograd.Function):
    """8-bit product layer on integer codes; saves only the 1-byte codes (see module docstring)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, xc: Codes,
                op: _LinearOp | _Conv2dOp, plan: KernelPlan, bits: int, engine: FusedPasses) -> Tensor:
        wc = weight_codes(weight, bits, engine)
        y = op.int8_forward(plan, xc, wc)
        ctx.save_for_backward(xc.data, wc.data)
        ctx.x_meta = (xc.scale, xc.zero_point, xc.qmin, xc.qmax)
        ctx.w_meta = (wc.scale, wc.zero_point, wc.qmin, wc.qmax)
        ctx.op, ctx.plan, ctx.bits, ctx.engine = op, plan, bits, engine
        ctx.x_shape, ctx.w_shape, ctx.has_bias = x.shape, weight.shape, bias is not None
        return y if bias is None else op.add_bias(y, bias)

    @staticmethod
    def backward(ctx, g: Tensor):
        x_data, w_data = ctx.saved_tensors
        xc, wc = Codes(x_data, *ctx.x_meta), Codes(w_data, *ctx.w_meta)
        op, plan = ctx.op, ctx.plan
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            gc = gradient_codes(g, ctx.bits, g.dim() == 4, ctx.engine)
            clipped = _clipped(xc.data, xc.zero_point, xc.qmin + CODE_OFFSET, xc.qmax + CODE_OFFSET)
            dx = op.int8_grad_input(plan, gc, wc, ctx.x_shape).masked_fill_(clipped, 0.0)
        if ctx.needs_input_grad[1]:
            dw = op.int8_grad_weight(plan, xc, g, ctx.w_shape, ctx.engine)  # fp32 dL/dy: gradient bifurcation
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = op.bias_grad(g)
        return dx, dw, db, None, None, None, None, None


class _QProductMixin:
    """Shared quantized state of QLinear / QConv2d (their forward: :func:`_quantized_forward`)."""

    precision: PrecisionConfig
    _op: _LinearOp | _Conv2dOp | None  # None: not quantized (the fp32 forward of the base class runs)

    def _init_quant(self, precision: PrecisionConfig) -> None:
        self.precision = precision
        if precision.quantized:
            self.input_quant = ActivationQuantizer(precision.bits)



def _quantized_forward(layer: QLinear | QConv2d, x: Tensor) -> Tensor:
    bits = layer.precision.bits
    if layer.precision.mode == "int8":
        plan = layer.precision.plan or default_plan(x.device)
        engine = layer.precision.passes
        xc = activation_codes(layer.input_quant, x, engine, channels_last=x.dim() == 4)
        return _Int8ProductFn.apply(x, layer.weight, layer.bias, xc, layer._op, plan, bits, engine)
    return _Sim8ProductFn.apply(x, layer.weight, layer.bias, layer.input_quant.qparams(x), layer._op, bits)


class QLinear(_QProductMixin, nn.Linear):
    """nn.Linear computing in ``precision`` (already resolved, see resolve_precision)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 precision: PrecisionConfig = PrecisionConfig()) -> None:
        super().__init__(in_features, out_features, bias)
        self._init_quant(precision)
        self._op = _LinearOp()

    def forward(self, x: Tensor) -> Tensor:
        return _quantized_forward(self, x) if self.precision.quantized else super().forward(x)


class QConv2d(_QProductMixin, nn.Conv2d):
    """nn.Conv2d (zero padding, numeric padding in 8-bit modes) computing in ``precision``."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int | tuple[int, int],
                 stride: int | tuple[int, int] = 1, padding: int | tuple[int, int] | str = 0,
                 dilation: int | tuple[int, int] = 1, groups: int = 1, bias: bool = True, *,
                 precision: PrecisionConfig = PrecisionConfig()) -> None:
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation,
                         groups, bias)
        if precision.quantized and isinstance(self.padding, str):
            raise ValueError(f"padding must be numeric in {precision.mode} mode, "
                             f"got {padding!r}")
        self._init_quant(precision)
        self._op = _Conv2dOp(self) if precision.quantized else None

    def forward(self, x: Tensor) -> Tensor:
        return _quantized_forward(self, x) if self.precision.quantized else super().forward(x)


class QAdd(nn.Module):
    """Residual add; in 8-bit modes both inputs are quantized first (docs/method.md#8-bit-local-training)."""

    def __init__(self, precision: PrecisionConfig = PrecisionConfig()) -> None:
        super().__init__()
        self.precision = precision
        if precision.quantized:
            self.quant_a = ActivationQuantizer(precision.bits)
            self.quant_b = ActivationQuantizer(precision.bits)

    def forward(self, a: Tensor, b: Tensor) -> Tensor:
        if not self.precision.quantized:
            return a + b
        if self.precision.mode == "int8":
            engine = self.precision.passes
            return _SteSum.apply(a, b, activation_codes(self.quant_a, a, engine, None),
                                 activation_codes(self.quant_b, b, engine, None), engine)
        return (fake_quantize(a, self.quant_a.qparams(a))
                + fake_quantize(b, self.quant_b.qparams(b)))


class _SteSum(torch.autograd.Function):
    """Sum of two tensors' 8-bit values (from their codes, one fused pass); straight-through, saves nothing."""

    @staticmethod
    def forward(ctx, a: Tensor, b: Tensor, ac: Codes, bc: Codes, engine: FusedPasses) -> Tensor:
        return engine.dequant_sum(ac, bc)

    @staticmethod
    def backward(ctx, g: Tensor):
        return g, g, None, None, None
