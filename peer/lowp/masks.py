"""fp32 layers of the 8-bit models that save 1-byte masks for backward instead of fp32 tensors (int8 mode).

The method (docs/method.md#8-bit-local-training) keeps pooling, ReLU outside the norms and dropout in fp32: their outputs are the same in every mode.
What PyTorch saves for their backward is not small, though: max pooling keeps its fp32 input and int64 indices
(12 bytes per input element), ReLU its fp32 output, dropout an fp32-sized mask. In int8 mode these layers save only
what their gradient needs, one byte per element:

* max pooling (dilation 1, floor mode, windows of at most 256 taps): the position of each window's maximum inside
  the window (uint8, one byte per OUTPUT element); backward scatters the gradient there (a one-hot over the window).
  Non-overlapping windows (kernel == stride, no padding) in one fused pass; overlapping or padded ones (ResNet's 3x3
  stride-2 stem pooling) eagerly, tap by tap over strided views;
* ReLU: the boolean mask ``x > 0``; ReLU6 ``0 < x < 6``; hardsigmoid ``-3 < x < 3`` (its slope 1/6 there):
  exactly torch's gradients;
* hardswish: a 1-byte code of its input (:class:`MaskHardswish`): its slope is not piecewise constant, so the
  gradient is within ``|dL/dy| / 254`` of torch's inside (-3, 3) and exact outside;
* dropout: the boolean keep-mask.

In fp32 and sim8 modes, and for pooling geometries not covered above, they are the plain torch modules (``inplace``
honoured as torch does) - except max pooling without a gradient on CPU (evaluation): the same values, rows first for
non-overlapping windows (about 9x faster than torch's NCHW pooling), in channels-last layout otherwise (about 3x).
In int8 training they return a new tensor whatever ``inplace`` says: an autograd Function overwriting its input
would have to mark it dirty, which torch refuses for leaves and some views that the in-place torch op accepts; the
input is not kept for backward anyway.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from peer.lowp.passes import FusedPasses
from peer.lowp.twins import eager_twin
from peer.lowp.precision import PrecisionConfig


def _windows(x: Tensor, kernel: tuple[int, int]) -> Tensor:
    """[N, C, H, W] -> [N, C, Ho, Wo, kh*kw]: each pooling window's taps in one row (a copy; rows/columns beyond the
    last whole window are dropped, as max_pool2d does)."""
    kh, kw = kernel
    n, c, h, w = x.shape
    ho, wo = h // kh, w // kw
    x = x[:, :, :ho * kh, :wo * kw].reshape(n, c, ho, kh, wo, kw)
    return x.permute(0, 1, 2, 4, 3, 5).reshape(n, c, ho, wo, kh * kw)


class _WindowMaxPool(torch.autograd.Function):
    """Non-overlapping max pooling saving each maximum's position inside its window (uint8, window <= 256 taps).

    One pass finds the maxima and their positions (max over each window's taps); backward scatters the gradient to
    those positions with a one-hot over the window, no int64 indices at all."""

    @staticmethod
    def forward(ctx, x: Tensor, kernel: tuple[int, int], engine: FusedPasses) -> Tensor:
        y, offset = engine.run("window_max", _window_max, x, kernel)
        ctx.save_for_backward(offset)
        ctx.kernel, ctx.in_hw, ctx.engine = kernel, tuple(x.shape[-2:]), engine
        return y

    @staticmethod
    def backward(ctx, g: Tensor):
        (offset,) = ctx.saved_tensors
        return ctx.engine.run("window_scatter", _window_scatter, g, offset, ctx.kernel, ctx.in_hw), None, None


def _window_max(x: Tensor, kernel: tuple[int, int]) -> tuple[Tensor, Tensor]:
    """Each window's maximum and its tap (uint8); one fused pass when compiled (passes.py)."""
    y, offset = _windows(x, kernel).max(-1)
    return y, offset.to(torch.uint8)


def _window_scatter(g: Tensor, offset: Tensor, kernel: tuple[int, int], in_hw: tuple[int, int]) -> Tensor:
    """The input gradient of window max pooling: ``g`` at each window's maximum tap, zero elsewhere."""
    (kh, kw), (h, w) = kernel, in_hw
    n, c, ho, wo = offset.shape
    # compared as int32: inductor's AVX2 code compares uint8 lanes 4x slower (11 vs 3 ms at 64x32x14x14 windows)
    taps = torch.arange(kh * kw, device=g.device, dtype=torch.int32)
    dx = g.unsqueeze(-1) * (offset.unsqueeze(-1).to(torch.int32) == taps)  # [N, C, Ho, Wo, kh*kw]
    dx = dx.reshape(n, c, ho, wo, kh, kw).permute(0, 1, 2, 4, 3, 5).reshape(n, c, ho * kh, wo * kw)
    return F.pad(dx, (0, w - wo * kw, 0, h - ho * kh))


def _taps(t: Tensor, kernel: tuple[int, int], out_hw: tuple[int, int]) -> list[Tensor]:
    """Views of ``t`` [N, C, H, W], one per window tap in tap order (row-major in the window): tap (i, j) holds each
    window's element (i, j), shape [N, C, Ho, Wo]."""
    (kh, kw), (ho, wo) = kernel, out_hw
    return [t[:, :, i:ho * kh:kh, j:wo * kw:kw] for i in range(kh) for j in range(kw)]


def _max_and_first_tap(taps: list[Tensor]) -> tuple[Tensor, Tensor]:
    """The elementwise maximum over ``taps`` and, as uint8, the index of the FIRST tap equal to it (see
    :func:`_first_tap`)."""
    y = taps[0].clone(memory_format=torch.contiguous_format)
    for tap in taps[1:]:
        torch.maximum(y, tap, out=y)
    return y, _first_tap(taps, y)


def _first_tap(taps: list[Tensor], y: Tensor) -> Tensor:
    """As uint8, the index of the FIRST of ``taps`` equal to ``y`` (``max(-1)``'s and max_pool2d's choice among ties
    when ``y`` is their maximum), counted as the number of leading taps not equal to it (NaN-free windows; uint8 and
    bool ops only: ``masked_fill_`` / ``where`` were 4x slower)."""
    leading = taps[0] != y  # all taps so far differ from the maximum
    offset = leading.to(torch.uint8)
    for tap in taps[1:-1]:
        torch.logical_and(leading, tap != y, out=leading)
        offset += leading
    return offset


def _window_values(x: Tensor, kernel: tuple[int, int]) -> Tensor:
    """Max pooling of NCHW ``x`` over non-overlapping ``kernel`` windows (floor mode), a new NCHW tensor: the maximum
    of each window's rows first - whole rows at a time, contiguous - then of that row's columns, strided. max_pool2d's
    values (a window whose maximum is a zero may give the other zero's sign; a NaN in a window gives a NaN). Why:
    torch's CPU max pooling walks an NCHW tensor one plane at a time, scalar, and a tap-by-tap maximum reads every
    tap strided; rows first reads half the data strided. MNIST CNN, batch 32, 1 thread, AMD EPYC Zen 4
    (bench/pool.py, the layer): 32x32x28x28 in 0.48 ms, against torch's 4.40 ms (a channels-last copy: 1.66 ms)."""
    (kh, kw), (n, c, h, w) = kernel, x.shape
    ho, wo = h // kh, w // kw
    rows = x[:, :, :ho * kh].reshape(n, c, ho, kh, w)  # a view for contiguous x
    m = rows[:, :, :, 0]
    if kh > 1:
        m = torch.maximum(m, rows[:, :, :, 1])
        for i in range(2, kh):
            torch.maximum(m, rows[:, :, :, i], out=m)
    y = m[..., 0:wo * kw:kw]
    if kw > 1:
        y = torch.maximum(y, m[..., 1:wo * kw:kw])
        for j in range(2, kw):
            torch.maximum(y, m[..., j:wo * kw:kw], out=y)
    return y.clone(memory_format=torch.contiguous_format) if kh == kw == 1 else y.contiguous()  # 1x1: a view of x


@eager_twin(_window_max, same_as_compiled=True)
def _window_max_eager(x: Tensor, kernel: tuple[int, int]) -> tuple[Tensor, Tensor]:
    """:func:`_window_max` without a copy of its windows: each window's maximum by :func:`_window_values`, then its
    FIRST tap equal to it (:func:`_first_tap`) over strided views of ``x``. 0.79 / 0.51 ms for MNIST CNN's two
    poolings (batch 32, AMD EPYC Zen 4), 1.15 / 0.64 ms with a running maximum over the strided taps."""
    taps = _taps(x, kernel, (x.shape[-2] // kernel[0], x.shape[-1] // kernel[1]))
    if not x.is_contiguous():
        return _max_and_first_tap(taps)
    y = _window_values(x, kernel)
    return y, _first_tap(taps, y)


@eager_twin(_window_scatter, same_as_compiled=True)
def _window_scatter_eager(g: Tensor, offset: Tensor, kernel: tuple[int, int], in_hw: tuple[int, int]) -> Tensor:
    """:func:`_window_scatter` written tap by tap into strided views of the output: ``g`` where the tap is the
    window's maximum, 0 elsewhere (and in the rows / columns no whole window covers)."""
    (kh, kw), (h, w) = kernel, in_hw
    n, c, ho, wo = offset.shape
    dx = torch.empty((n, c, h, w), dtype=g.dtype, device=g.device)
    dx[:, :, ho * kh:].zero_()
    dx[:, :, :, wo * kw:].zero_()
    for index, tap in enumerate(_taps(dx, kernel, (ho, wo))):
        torch.mul(g, offset == index, out=tap)
    return dx


def _strided_taps(t: Tensor, kernel: tuple[int, int], stride: tuple[int, int],
                  out_hw: tuple[int, int]) -> list[Tensor]:
    """Views of a (padded) ``t`` [N, C, H, W], one per window tap in row-major order: tap (i, j) holds element (i, j)
    of every window, shape [N, C, Ho, Wo] (any stride: windows may overlap or leave gaps)."""
    (kh, kw), (sh, sw), (ho, wo) = kernel, stride, out_hw
    return [t[:, :, i:i + sh * (ho - 1) + 1:sh, j:j + sw * (wo - 1) + 1:sw] for i in range(kh) for j in range(kw)]


def _strided_window_max(x: Tensor, kernel: tuple[int, int], stride: tuple[int, int],
                        padding: tuple[int, int]) -> tuple[Tensor, Tensor]:
    """Max pooling of ``x`` and each maximum's tap (uint8): the first tap equal to the maximum in row-major order,
    max_pool2d's choice; padding is -inf, so it never wins over an input element."""
    (ph, pw) = padding
    if ph or pw:
        x = F.pad(x, (pw, pw, ph, ph), value=float("-inf"))
    out_hw = ((x.shape[2] - kernel[0]) // stride[0] + 1, (x.shape[3] - kernel[1]) // stride[1] + 1)
    taps = _strided_taps(x, kernel, stride, out_hw)
    return _max_and_first_tap(taps)


def _strided_window_scatter(g: Tensor, offset: Tensor, kernel: tuple[int, int], stride: tuple[int, int],
                            padding: tuple[int, int], in_hw: tuple[int, int]) -> Tensor:
    """The input gradient of :func:`_strided_window_max`: each window's ``g`` added at its maximum. Taps are added
    last to first: for every input element that is the order of its windows in row-major output order, the order
    torch's max_pool2d backward adds them in - the same fp32 sums, bit for bit."""
    (ph, pw), (h, w) = padding, in_hw
    dx = g.new_zeros((g.shape[0], g.shape[1], h + 2 * ph, w + 2 * pw))
    taps = _strided_taps(dx, kernel, stride, (offset.shape[2], offset.shape[3]))
    for index in reversed(range(len(taps))):
        taps[index].add_(torch.where(offset == index, g, 0.0))
    return dx[:, :, ph:ph + h, pw:pw + w]


class _StridedWindowMaxPool(torch.autograd.Function):
    """Max pooling with any stride and padding saving each maximum's tap inside its window (uint8, window <= 256
    taps): overlapping windows included. Eager, tap by tap over strided views (see _strided_window_max)."""

    @staticmethod
    def forward(ctx, x: Tensor, kernel: tuple[int, int], stride: tuple[int, int], padding: tuple[int, int]) -> Tensor:
        y, offset = _strided_window_max(x, kernel, stride, padding)
        ctx.save_for_backward(offset)
        ctx.geometry = (kernel, stride, padding, tuple(x.shape[-2:]))
        return y

    @staticmethod
    def backward(ctx, g: Tensor):
        (offset,) = ctx.saved_tensors
        return _strided_window_scatter(g, offset, *ctx.geometry), None, None, None


class _MaskedScale(torch.autograd.Function):
    """``x * mask * scale`` saving only the boolean mask (ReLU: mask x > 0, scale 1; dropout: keep-mask, 1/(1-p))."""

    @staticmethod
    def forward(ctx, x: Tensor, mask: Tensor, scale: float) -> Tensor:
        ctx.save_for_backward(mask)
        ctx.scale = scale
        return x * mask * scale if scale != 1.0 else x * mask

    @staticmethod
    def backward(ctx, g: Tensor):
        (mask,) = ctx.saved_tensors
        return (g * mask * ctx.scale if ctx.scale != 1.0 else g * mask), None, None


def _saves_masks(precision: PrecisionConfig, x: Tensor) -> bool:
    return precision.mode == "int8" and torch.is_grad_enabled() and x.requires_grad


def _inference_on_cpu(x: Tensor) -> bool:
    """A 4-D CPU tensor in NCHW layout pooled with no gradient to record (an evaluation, an export's check)."""
    return (x.device.type == "cpu" and x.dim() == 4 and x.is_contiguous()
            and not (torch.is_grad_enabled() and x.requires_grad))


def _channels_last_max_pool(x: Tensor, kernel: int | tuple[int, int], stride: int | tuple[int, int],
                            padding: int | tuple[int, int]) -> Tensor:
    """``F.max_pool2d(x, ...)`` computed in channels-last layout and returned in NCHW: the same values, faster on CPU.

    Why: torch's CPU max pooling walks an NCHW tensor one plane at a time, scalar, while its channels-last kernel is
    vectorised across channels. MNIST CNN, batch 32, 1 thread, AMD EPYC Zen 4: 5.3 ms -> 1.9 ms for the first
    pooling (32x32x28x28) including both layout copies; the README fleet daemon's test evaluation lost about a third
    of its time (bench/pool.py prints both side by side). Training keeps torch's own pooling (its backward through
    the layout copies is slower than what the forward saves) or the int8 mask-saving pass."""
    pooled = F.max_pool2d(x.contiguous(memory_format=torch.channels_last), kernel, stride, padding)
    return pooled.contiguous()


def _pair(v: int | tuple[int, int]) -> tuple[int, int]:
    return (v, v) if isinstance(v, int) else (v[0], v[1])


class MaskMaxPool2d(nn.MaxPool2d):
    """nn.MaxPool2d (dilation 1, floor mode; stride defaults to the kernel); in int8 mode windows of at most 256 taps
    save uint8 window offsets for backward (non-overlapping ones by a fused pass, others eagerly)."""

    def __init__(self, kernel_size: int | tuple[int, int], precision: PrecisionConfig = PrecisionConfig(), *,
                 stride: int | tuple[int, int] | None = None, padding: int | tuple[int, int] = 0) -> None:
        super().__init__(kernel_size, stride, padding)
        self.precision = precision
        kernel, stride, padding = _pair(kernel_size), _pair(stride or kernel_size), _pair(padding)
        fits = kernel[0] * kernel[1] <= 256  # offsets fit one byte
        self._window = kernel if fits and stride == kernel and padding == (0, 0) else None
        self._strided = (kernel, stride, padding) if fits and self._window is None else None

    def forward(self, x: Tensor) -> Tensor:
        if _saves_masks(self.precision, x):
            if self._window is not None:
                return _WindowMaxPool.apply(x, self._window, self.precision.passes)
            if self._strided is not None:
                return _StridedWindowMaxPool.apply(x, *self._strided)
        if _inference_on_cpu(x):
            if self._window is not None:
                return _window_values(x, self._window)
            return _channels_last_max_pool(x, self.kernel_size, self.stride, self.padding)
        return super().forward(x)


class MaskReLU(nn.Module):
    """ReLU; in int8 mode saves the boolean mask ``x > 0`` for backward instead of the fp32 output."""

    def __init__(self, precision: PrecisionConfig = PrecisionConfig(), *, inplace: bool = False) -> None:
        super().__init__()
        self.precision = precision
        self.inplace = inplace

    def forward(self, x: Tensor) -> Tensor:
        if _saves_masks(self.precision, x):
            return _MaskedScale.apply(x, x > 0, 1.0)
        return F.relu(x, inplace=self.inplace)


class _MaskedSlope(torch.autograd.Function):
    """``act(x)`` for an activation whose slope is ``slope`` where ``inside(x)`` and 0 elsewhere, saving only that
    boolean mask; the gradient is ``where(mask, g * slope, 0)``, torch's own formula for ReLU6 and hardsigmoid."""

    @staticmethod
    def forward(ctx, x: Tensor, act: Callable[[Tensor], Tensor], inside: Callable[[Tensor], Tensor],
                slope: float) -> Tensor:
        ctx.save_for_backward(inside(x))
        ctx.slope = slope
        return act(x)

    @staticmethod
    def backward(ctx, g: Tensor):
        (mask,) = ctx.saved_tensors
        return torch.where(mask, g * ctx.slope if ctx.slope != 1.0 else g, 0.0), None, None, None


def _inside_relu6(x: Tensor) -> Tensor:
    return (x > 0.0) & (x < 6.0)


def _inside_hardsigmoid(x: Tensor) -> Tensor:
    return (x > -3.0) & (x < 3.0)


class MaskReLU6(nn.ReLU6):
    """nn.ReLU6; in int8 mode saves the boolean mask ``0 < x < 6`` for backward instead of the fp32 input."""

    def __init__(self, precision: PrecisionConfig = PrecisionConfig(), *, inplace: bool = False) -> None:
        super().__init__(inplace)
        self.precision = precision

    def forward(self, x: Tensor) -> Tensor:
        if _saves_masks(self.precision, x):
            return _MaskedSlope.apply(x, F.relu6, _inside_relu6, 1.0)
        return super().forward(x)


class MaskHardsigmoid(nn.Hardsigmoid):
    """nn.Hardsigmoid; in int8 mode saves the boolean mask ``-3 < x < 3`` (slope 1/6 there) instead of the input."""

    def __init__(self, precision: PrecisionConfig = PrecisionConfig(), *, inplace: bool = False) -> None:
        super().__init__(inplace)
        self.precision = precision

    def forward(self, x: Tensor) -> Tensor:
        if _saves_masks(self.precision, x):
            return _MaskedSlope.apply(x, F.hardsigmoid, _inside_hardsigmoid, 1.0 / 6.0)
        return super().forward(x)


#: Hardswish slope codes: 0 for x <= -3 (slope 0), 255 for x >= 3 (slope 1) - torch's backward's own cases -, and
#: 1..254 the 254 equal bins of (-3, 3).
HARDSWISH_BINS = 254


def hardswish_codes(x: Tensor) -> Tensor:
    """uint8 code of ``x`` for hardswish's slope (see HARDSWISH_BINS)."""
    code = torch.floor((x + 3.0) * (HARDSWISH_BINS / 6.0)).clamp_(0.0, HARDSWISH_BINS - 1.0).add_(1.0)
    return code.masked_fill_(x <= -3.0, 0.0).masked_fill_(x >= 3.0, 255.0).to(torch.uint8)


def _hardswish_slopes() -> Tensor:
    """Slope of hardswish per code: 0, then ``x / 3 + 1/2`` at each bin's centre ``x = -3 + (c - 1/2) 6 / 254``
    (so ``(c - 1/2) / 127 - 1/2``), then 1. The bins are 6/254 wide: the slope is within 1/254 of the true one."""
    codes = torch.arange(256, dtype=torch.float64)
    slopes = (codes - 0.5) * (2.0 / HARDSWISH_BINS) - 0.5
    slopes[0], slopes[255] = 0.0, 1.0
    return slopes.float()


_HARDSWISH_SLOPES = _hardswish_slopes()


class _HardswishFromCodes(torch.autograd.Function):
    """hardswish saving the 1-byte slope code of its input (hardswish_codes); backward ``g * slope(code)``."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        ctx.save_for_backward(hardswish_codes(x))
        return F.hardswish(x)

    @staticmethod
    def backward(ctx, g: Tensor):
        (codes,) = ctx.saved_tensors
        slopes = _HARDSWISH_SLOPES.to(g.device)[codes.int()]
        return torch.where(codes == 0, 0.0, g * slopes)


class MaskHardswish(nn.Hardswish):
    """nn.Hardswish; in int8 mode saves a 1-byte code of the input (hardswish_codes) instead of the fp32 input.

    Gradient: exactly torch's for x <= -3 (0) and x >= 3 (dL/dy); inside (-3, 3) the slope ``x / 3 + 1/2`` is taken
    at the centre of the input's 6/254-wide bin, so ``|dL/dx - torch's| <= |dL/dy| / 254`` (plus fp32 rounding).
    """

    def __init__(self, precision: PrecisionConfig = PrecisionConfig(), *, inplace: bool = False) -> None:
        super().__init__(inplace)
        self.precision = precision

    def forward(self, x: Tensor) -> Tensor:
        if _saves_masks(self.precision, x):
            return _HardswishFromCodes.apply(x)
        return super().forward(x)


class MaskDropout(nn.Dropout):
    """nn.Dropout; in int8 mode (training) saves the boolean keep-mask for backward."""

    def __init__(self, p: float, precision: PrecisionConfig = PrecisionConfig(), *, inplace: bool = False) -> None:
        super().__init__(p, inplace)
        self.precision = precision

    def forward(self, x: Tensor) -> Tensor:
        if self.training and 0.0 < self.p < 1.0 and _saves_masks(self.precision, x):
            keep = torch.rand_like(x) >= self.p
            return _MaskedScale.apply(x, keep, 1.0 / (1.0 - self.p))
        return super().forward(x)
