"""Exact integer product kernels of the int8 mode, one interface, several implementations (docs/design.md#int8-kernels).

Every kernel computes an integer product of codes and returns it as fp32 times a ``scale`` (the product of the two
operands' quantization steps; 1.0 to read the integer itself). "Exact" means: with ``scale`` 1.0 the result equals
``float32(p)`` where ``p`` is the exact (int64) product, i.e. the int32 accumulator cast once to fp32, bit for bit.
Which kernel is exact and fast on a machine is decided by the probe (probe.py), per op kind and shape.

Operands (see qmath.py): activations and layer gradients are ``uint8`` codes ``u`` with an integer zero point
``zp`` (value ``u - zp``, 0..255 apart); weights are ``int8`` codes (zero point 0). Convolution zero padding means
value 0, i.e. code ``zp``.

Kernels:

* ``onednn``: oneDNN's u8 x s8 quantized convolution / linear with an fp32 output (CPU). Integer accumulation in
  int32; on CPUs without VNNI the u8 x s8 instruction adds pairs in saturating int16 and is NOT exact on full-range
  operands - the probe's full-range check rejects it there. The convolution's input gradient is a convolution with
  the flipped, transposed weight; for strided convolutions one per stride phase (sub-kernel of the taps that reach
  the phase's input pixels, see ``OneDNNKernel.conv_dgrad``). Weights are re-packed on every call (they change every
  step).
* ``int_mm``: ``torch._int_mm`` (int32 accumulation; VNNI/AMX CPUs, CUDA int8 tensor cores), convolutions through
  an im2col of the uint8 codes (4x smaller than an fp32 im2col) and a col2im for the input gradient.
* ``fp32``: the fp32 GEMM / convolution on the codes cast to float, exact while every partial sum is an integer
  of at most 2^24: with values ``u - zp`` of magnitude at most A = max(zp, 255 - zp) and weights at most 128, a
  reduction of K terms is exact while K * A * 128 <= 2^24 (K <= 1024 at zero point 128: every layer of ResNet-20;
  K <= 514 at zero point 0 or 255); longer ones are split into chunks that are, and the chunks summed in fp64
  (rounded once). Any CPU or GPU (TF32 disabled on CUDA). Same speed as fp32, same memory as int8. (The input
  gradient is not a transposed convolution: the same operands crashed the aarch64 torch 2.9.1 build with an illegal
  instruction under qemu, while the convolution backward it uses runs there.)
* ``fp64``: the same in fp64 without splitting; exact everywhere, slow; last resort only.
bf16 is not a candidate: bf16 GEMMs and convolutions on CPU write bf16 results (8 significant bits), which cannot
hold an integer product exactly, and PyTorch has no bf16-in / fp32-out GEMM on CPU.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.grad import conv2d_input

from peer.lowp.layout import is_channels_last

#: Largest reduction length for which an fp32 sum of products of values |a| <= 255, |b| <= 128 stays within 2^24
#: (any zero point; a zero point near the middle allows about twice as long: ``FloatCodesKernel.max_k``).
FP32_EXACT_K = (1 << 24) // (255 * 128)
_FP32_EXACT_TOTAL = 1 << 24  # every integer of at most this magnitude is an fp32 value
_MAX_WEIGHT_CODE = 128  # |int8 weight code| (symmetric weights use 127; the probe's operands reach -128)
OPS = ("conv.fwd", "conv.dgrad", "linear.fwd", "linear.dgrad")
CODE_SHIFT = 128  # uint8 code - CODE_SHIFT = int8 code (same centred value with the zero point shifted too)

_CUDA_MIN_ROWS = 17
_CUDA_MULTIPLE = 8


@dataclass(frozen=True)
class ConvGeometry:
    """A 2-D convolution's hyper-parameters (zero padding)."""

    kernel: tuple[int, int]
    stride: tuple[int, int] = (1, 1)
    padding: tuple[int, int] = (0, 0)
    dilation: tuple[int, int] = (1, 1)
    groups: int = 1

    def out_hw(self, hw: tuple[int, int]) -> tuple[int, int]:
        """Output height and width for input ``hw``."""
        h, w = ((s + 2 * p - d * (k - 1) - 1) // st + 1
                for s, p, d, k, st in zip(hw, self.padding, self.dilation, self.kernel, self.stride))
        return h, w

    @property
    def plain(self) -> bool:
        """No groups, no dilation (what the im2col kernels cover)."""
        return self.groups == 1 and self.dilation == (1, 1)


# ---- references (exact, slow): what every kernel is checked against ----------------------------------------------

def reference_conv(x: Tensor, zp: int, w: Tensor, geom: ConvGeometry) -> Tensor:
    """Exact ``conv(x - zp, w)`` in fp64 (integers far below 2^53)."""
    return F.conv2d(x.double() - zp, w.double(), None, geom.stride, geom.padding, geom.dilation, geom.groups)


def reference_conv_dgrad(g: Tensor, zp: int, w: Tensor, geom: ConvGeometry, x_shape: torch.Size) -> Tensor:
    """Exact input gradient ``conv_transpose(g - zp, w)`` in fp64."""
    return conv2d_input(x_shape, w.double(), g.double() - zp, geom.stride, geom.padding, geom.dilation, geom.groups)


def reference_linear(x: Tensor, zp: int, w: Tensor) -> Tensor:
    """Exact ``(x - zp) @ w.T`` in int64, as fp64."""
    return ((x.long() - zp) @ w.long().t()).double()


# ---- kernels -------------------------------------------------------------------------------------------------------

class ProductKernel:
    """Base: one implementation of the four integer products. ``scale`` multiplies the exact product.

    ``last_resort`` kernels are exact everywhere but slow: the plan uses them only where no other kernel is exact.
    """

    name = "base"
    last_resort = False

    def unavailable(self, device: torch.device) -> str | None:
        """None if this kernel can run on ``device``, else why not."""
        return None

    def supports(self, op: str, geom: ConvGeometry | None) -> bool:
        """Whether this kernel implements ``op`` for convolutions of ``geom``."""
        return True

    def conv_fwd(self, x: Tensor, zp: int, w: Tensor, geom: ConvGeometry, scale: float) -> Tensor:
        raise NotImplementedError

    def conv_dgrad(self, g: Tensor, zp: int, w: Tensor, geom: ConvGeometry, x_shape: torch.Size,
                   scale: float) -> Tensor:
        raise NotImplementedError

    def linear(self, x: Tensor, zp: int, w: Tensor, scale: float) -> Tensor:
        """``(x - zp) @ w.T * scale`` for x [M, K] uint8, w [N, K] int8 (the input gradient passes ``w.T``)."""
        raise NotImplementedError


@contextlib.contextmanager
def _exact_float_products(device: torch.device) -> Iterator[None]:
    """fp32 products of integer codes must stay exact on CUDA: no TF32 (10-bit significand), and no cuDNN, whose
    convolution algorithms (Winograd, FFT) transform the operands into non-integers (a 64-channel 3x3 convolution
    came out wrong in 72 of 200 entries on an H200); PyTorch's own CUDA convolution is an im2col and a GEMM."""
    if device.type != "cuda":
        yield
        return
    matmul = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with torch.backends.cudnn.flags(enabled=False):
            yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = matmul


def _chunks(n: int, per_chunk: int) -> list[slice]:
    step = max(1, per_chunk)
    return [slice(i, min(i + step, n)) for i in range(0, n, step)]


def _sum_exact(parts: list[Tensor]) -> Tensor:
    """Sum of exact fp integer tensors, rounded once to fp32 (fp64 accumulation when there are several)."""
    if len(parts) == 1:
        return parts[0].float()
    total = parts[0].double()
    for part in parts[1:]:
        total += part
    return total.float()


def _stand_in_input(g: Tensor, x_shape: torch.Size) -> Tensor:
    """An uninitialised input-shaped tensor in ``g``'s memory format, for :func:`_input_gradient` (never read):
    ``conv2d_input``'s zero-stride stand-in was copied by oneDNN into the gradient's channels_last layout, a
    full-size fp32 copy (3.0 vs 1.4 ms at 32x16x32x32)."""
    layout = torch.channels_last if is_channels_last(g) else torch.contiguous_format
    return torch.empty(x_shape, dtype=g.dtype, device=g.device, memory_format=layout)


def _input_gradient(g: Tensor, w: Tensor, geom: ConvGeometry, stand_in: Tensor) -> Tensor:
    """A convolution's input gradient for output gradient ``g``, as ``conv2d_input`` computes it."""
    return torch.ops.aten.convolution_backward(
        g, stand_in, w, None, list(geom.stride), list(geom.padding), list(geom.dilation), False, [0, 0],
        geom.groups, [True, False, False])[0]


class FloatCodesKernel(ProductKernel):
    """fp32 (or fp64) GEMM / convolution on codes cast to float, reduction split to stay exact (module doc)."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        self.dtype = dtype
        self.name = "fp32" if dtype == torch.float32 else "fp64"
        self.last_resort = dtype == torch.float64

    def max_k(self, zp: int) -> int:
        """Longest exact reduction for codes of zero point ``zp`` (module doc); fp64: unbounded in practice."""
        if self.dtype != torch.float32:
            return 1 << 30
        return _FP32_EXACT_TOTAL // (max(zp, 255 - zp, 1) * _MAX_WEIGHT_CODE)

    def _centered(self, codes: Tensor, zp: int) -> Tensor:
        return codes.to(self.dtype).sub_(zp)

    def conv_fwd(self, x: Tensor, zp: int, w: Tensor, geom: ConvGeometry, scale: float) -> Tensor:
        taps = geom.kernel[0] * geom.kernel[1]
        xf, wf = self._centered(x, zp), w.to(self.dtype)
        args = (None, geom.stride, geom.padding, geom.dilation)
        with _exact_float_products(x.device):
            if geom.groups > 1:  # one reduction per group: fp64 if a group's is too long for fp32
                dtype = torch.float64 if wf.shape[1] * taps > self.max_k(zp) else self.dtype
                return F.conv2d(xf.to(dtype), wf.to(dtype), *args, geom.groups).float().mul_(scale)
            parts = [F.conv2d(xf[:, c], wf[:, c], *args, 1) for c in _chunks(wf.shape[1], self.max_k(zp) // taps)]
        return _sum_exact(parts).mul_(scale)

    def conv_dgrad(self, g: Tensor, zp: int, w: Tensor, geom: ConvGeometry, x_shape: torch.Size,
                   scale: float) -> Tensor:
        taps = geom.kernel[0] * geom.kernel[1]
        gf, wf = self._centered(g, zp), w.to(self.dtype)
        with _exact_float_products(g.device):
            if geom.groups > 1:
                dtype = torch.float64 if (w.shape[0] // geom.groups) * taps > self.max_k(zp) else self.dtype
                gd = gf.to(dtype)
                return _input_gradient(gd, wf.to(dtype), geom, _stand_in_input(gd, x_shape)).float().mul_(scale)
            stand_in = _stand_in_input(gf, x_shape)
            parts = [_input_gradient(gf[:, c], wf[c], geom, stand_in)
                     for c in _chunks(wf.shape[0], self.max_k(zp) // taps)]
        return _sum_exact(parts).mul_(scale)

    def linear(self, x: Tensor, zp: int, w: Tensor, scale: float) -> Tensor:
        xf, wf = self._centered(x, zp), w.to(self.dtype)
        with _exact_float_products(x.device):
            parts = [xf[:, k] @ wf[:, k].t() for k in _chunks(wf.shape[1], self.max_k(zp))]
        return _sum_exact(parts).mul_(scale)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def int8_mm(a: Tensor, b: Tensor) -> Tensor:
    """int32 product of ``a`` [M,K] (int8 or uint8) and ``b`` [K,N] (int8) by ``torch._int_mm``.

    On CUDA it needs M > 16 and K, N multiples of 8: operands are zero-padded (zero rows and columns add
    nothing to the integer result) and the result sliced back.
    """
    if a.device.type != "cuda":  # the CPU kernel takes a transposed (column-major) b as is: no copy
        return torch._int_mm(a.contiguous(), b)
    m, k = a.shape
    n = b.shape[1]
    mp, kp, np_ = max(m, _CUDA_MIN_ROWS), _round_up(k, _CUDA_MULTIPLE), _round_up(n, _CUDA_MULTIPLE)
    if (mp, kp, np_) != (m, k, n):
        a = F.pad(a, (0, kp - k, 0, mp - m))
        b = F.pad(b, (0, np_ - n, 0, kp - k))
    # cuBLASLt's int8 product wants b column-major ("TN"): a row-major b of 72 columns was refused
    # (CUBLAS_STATUS_NOT_SUPPORTED, H200, torch 2.11) while its column-major copy was taken
    return torch._int_mm(a.contiguous(), b.t().contiguous().t())[:m, :n]


def im2col(codes: Tensor, kernel: tuple[int, int], stride: tuple[int, int], padding: tuple[int, int],
           pad_code: int) -> Tensor:
    """Patches of 1-byte ``codes`` [N,C,H,W] as rows [N*Ho*Wo, C*kh*kw] (dilation 1), column order (C, kh, kw).

    Padding uses ``pad_code`` (the zero point), so padded taps are exact zeros.
    """
    n, c = codes.shape[:2]
    ph, pw = padding
    if ph or pw:
        codes = F.pad(codes, (pw, pw, ph, ph), value=pad_code)
    patches = codes.unfold(2, kernel[0], stride[0]).unfold(3, kernel[1], stride[1])
    ho, wo = patches.shape[2:4]
    return patches.permute(0, 2, 3, 1, 4, 5).reshape(n * ho * wo, c * kernel[0] * kernel[1])


def col2im(cols: Tensor, batch: int, in_hw: tuple[int, int], kernel: tuple[int, int],
           stride: tuple[int, int], padding: tuple[int, int]) -> Tensor:
    """Scatter-add inverse of ``im2col`` for fp32 rows [N*Ho*Wo, C*kh*kw] -> [N,C,H,W]."""
    cols = cols.reshape(batch, -1, cols.shape[1]).transpose(1, 2)
    return F.fold(cols, in_hw, kernel, padding=padding, stride=stride)


@functools.cache
def _int_mm_takes_uint8(device_type: str) -> bool:
    """Whether this build's ``torch._int_mm`` accepts a uint8 left operand on ``device_type`` (x86 CPU builds do: u8 x
    s8 is VNNI's native form; CUDA and the aarch64 CPU build of torch 2.9 take int8 only). Tried once, tiny."""
    if device_type == "cuda":
        return False
    try:
        torch._int_mm(torch.zeros(32, 8, dtype=torch.uint8), torch.zeros(8, 8, dtype=torch.int8))
        return True
    except RuntimeError:
        return False


def _int_mm_operand(codes: Tensor, zp: int) -> tuple[Tensor, int]:
    """uint8 codes ``u`` as ``_int_mm`` takes them here: as is, or ``u - 128`` (int8) with zero point ``zp - 128``
    (the centred values ``u - zp`` are unchanged)."""
    if codes.dtype != torch.uint8 or _int_mm_takes_uint8(codes.device.type):
        return codes, zp
    return (codes.to(torch.int16) - CODE_SHIFT).to(torch.int8), zp - CODE_SHIFT


class IntMMKernel(ProductKernel):
    """``torch._int_mm`` products; convolutions through a uint8 im2col (groups 1, dilation 1)."""

    name = "int_mm"

    def supports(self, op: str, geom: ConvGeometry | None) -> bool:
        return geom is None or geom.plain

    def conv_fwd(self, x: Tensor, zp: int, w: Tensor, geom: ConvGeometry, scale: float) -> Tensor:
        x, zp = _int_mm_operand(x, zp)
        n, c_out = x.shape[0], w.shape[0]
        cols = im2col(x, geom.kernel, geom.stride, geom.padding, zp)
        w2 = w.reshape(c_out, -1)
        acc = int8_mm(cols, w2.t())
        if zp:
            acc -= zp * w2.sum(1, dtype=torch.int32)
        ho, wo = geom.out_hw((x.shape[2], x.shape[3]))
        return acc.float().mul_(scale).reshape(n, ho, wo, c_out).permute(0, 3, 1, 2)

    def conv_dgrad(self, g: Tensor, zp: int, w: Tensor, geom: ConvGeometry, x_shape: torch.Size,
                   scale: float) -> Tensor:
        g, zp = _int_mm_operand(g, zp)
        c_out = w.shape[0]
        rows = g.permute(0, 2, 3, 1).reshape(-1, c_out)
        w2 = w.reshape(c_out, -1)
        acc = int8_mm(rows, w2)
        if zp:
            acc -= zp * w2.sum(0, dtype=torch.int32)
        # fold adds up to kh*kw integers per input pixel: fp32 is exact only while their total reduction is short
        cols = acc.float() if c_out * geom.kernel[0] * geom.kernel[1] <= FP32_EXACT_K else acc.double()
        dx = col2im(cols, x_shape[0], (x_shape[2], x_shape[3]), geom.kernel, geom.stride, geom.padding)
        return dx.float().mul_(scale)

    def linear(self, x: Tensor, zp: int, w: Tensor, scale: float) -> Tensor:
        x, zp = _int_mm_operand(x, zp)
        acc = int8_mm(x, w.t())
        if zp:
            acc -= zp * w.sum(1, dtype=torch.int32)
        return acc.float().mul_(scale)


def _phase(r: int, pad: int, stride: int, kernel: int, out_len: int, in_len: int) -> tuple[int, int, int, int]:
    """One axis of a strided convolution's input gradient, for the input positions t = stride*i + r: the first tap
    k0, the number of taps J, and the padding of the output gradient before and after (negative: crop) that turn it
    into a stride-1 correlation with the phase's flipped sub-kernel, of as many outputs as there are such t."""
    k0 = (r + pad) % stride
    taps = len(range(k0, kernel, stride))
    count = max(0, -(-(in_len - r) // stride))
    if not taps or not count:
        return k0, 0, 0, 0
    before = taps - 1 - (r + pad - k0) // stride
    return k0, taps, before, count - out_len - before + taps - 1


def _pad_codes(codes: Tensor, top: int, bottom: int, left: int, right: int, pad_code: int) -> Tensor:
    """``codes`` padded with ``pad_code`` (value zero) by the given amounts, negative ones cropping; 1-byte copies,
    the layout (channels_last) kept."""
    if not (top or bottom or left or right):
        return codes
    h, w = codes.shape[2:]
    src = codes[:, :, max(0, -top):h - max(0, -bottom), max(0, -left):w - max(0, -right)]
    shape = (codes.shape[0], codes.shape[1], src.shape[2] + max(0, top) + max(0, bottom),
             src.shape[3] + max(0, left) + max(0, right))
    out = torch.empty(shape, dtype=codes.dtype, device=codes.device, memory_format=torch.channels_last)
    out.fill_(pad_code)
    out[:, :, max(0, top):max(0, top) + src.shape[2], max(0, left):max(0, left) + src.shape[3]] = src
    return out


class OneDNNKernel(ProductKernel):
    """oneDNN u8 x s8 convolution / linear with fp32 output (CPU; exactness is the probe's to prove)."""

    name = "onednn"

    def unavailable(self, device: torch.device) -> str | None:
        if device.type != "cpu":
            return "CPU only"
        if not torch.backends.mkldnn.is_available():
            return "torch built without oneDNN"
        ops = torch.ops.onednn
        if not all(hasattr(ops, name) for name in ("qconv_prepack", "qconv_pointwise", "qlinear_prepack",
                                                   "qlinear_pointwise")):
            return "oneDNN quantized ops missing in this torch build"
        return None

    def supports(self, op: str, geom: ConvGeometry | None) -> bool:
        if op == "conv.dgrad":  # as convolutions with the flipped weight (one per stride phase): no dilation, groups
            return geom is not None and geom.plain
        return True

    @staticmethod
    def _conv(x: Tensor, zp: int, w: Tensor, stride, padding, dilation, groups: int, scale: float) -> Tensor:
        # one weight scale for the whole tensor (per-tensor quantization): a per-channel vector of ones is read
        # element by element on every prepack and call
        one = torch.ones(1)
        packed = torch.ops.onednn.qconv_prepack(w, one, 1.0, zp, list(stride), list(padding), list(dilation),
                                                groups, list(x.shape))
        return torch.ops.onednn.qconv_pointwise(
            x, scale, zp, packed, one, torch.zeros(1, dtype=torch.long), None, list(stride),
            list(padding), list(dilation), groups, 1.0, 0, torch.float32, "none", [], "")

    def conv_fwd(self, x: Tensor, zp: int, w: Tensor, geom: ConvGeometry, scale: float) -> Tensor:
        return self._conv(x, zp, w, geom.stride, geom.padding, geom.dilation, geom.groups, scale)

    def conv_dgrad(self, g: Tensor, zp: int, w: Tensor, geom: ConvGeometry, x_shape: torch.Size,
                   scale: float) -> Tensor:
        kh, kw = geom.kernel
        padding = (kh - 1 - geom.padding[0], kw - 1 - geom.padding[1])
        if geom.stride == (1, 1) and min(padding) >= 0:
            flipped = w.transpose(0, 1).flip(2, 3).contiguous()
            return self._conv(g, zp, flipped, (1, 1), padding, (1, 1), 1, scale)
        # Strided: the input pixels of one stride phase (t = s*i + r per axis) receive the taps k = k0 + s*j with
        # k0 = (r + p) mod s, from output positions o = i + q - j (q = (r + p - k0) / s): a stride-1 correlation of
        # g with that phase's flipped sub-kernel, g padded by J - 1 - q before (J taps) and as needed after. Each
        # phase is one exact u8 x s8 convolution; together they do the direct input gradient's multiply-adds.
        out = torch.empty(x_shape, device=g.device, memory_format=torch.channels_last).zero_()
        w_t = w.transpose(0, 1)
        rows = [_phase(r, geom.padding[0], geom.stride[0], kh, g.shape[2], x_shape[2]) for r in range(geom.stride[0])]
        cols = [_phase(r, geom.padding[1], geom.stride[1], kw, g.shape[3], x_shape[3]) for r in range(geom.stride[1])]
        for ry, (k0y, taps_y, before_y, after_y) in enumerate(rows):
            for rx, (k0x, taps_x, before_x, after_x) in enumerate(cols):
                if not taps_y or not taps_x:
                    continue  # no tap reaches this phase (kernel smaller than the stride): its gradient is zero
                sub = w_t[:, :, k0y::geom.stride[0], k0x::geom.stride[1]].flip(2, 3).contiguous()
                padded = _pad_codes(g, before_y, after_y, before_x, after_x, zp)
                out[:, :, ry::geom.stride[0], rx::geom.stride[1]] = self._conv(
                    padded, zp, sub, (1, 1), (0, 0), (1, 1), 1, scale)
        return out

    def linear(self, x: Tensor, zp: int, w: Tensor, scale: float) -> Tensor:
        n = w.shape[0]
        packed = torch.ops.onednn.qlinear_prepack(w.contiguous(), list(x.shape))
        return torch.ops.onednn.qlinear_pointwise(
            x.contiguous(), scale, zp, packed, torch.ones(n), torch.zeros(n, dtype=torch.long), None, 1.0, 0,
            torch.float32, "none", [], "")


def all_kernels() -> list[ProductKernel]:
    """Every kernel, fastest-hoped first (the probe times them all anyway)."""
    return [OneDNNKernel(), IntMMKernel(), FloatCodesKernel(torch.float32), FloatCodesKernel(torch.float64)]
