"""Start-up probe of the int8 product kernels: exactness on full-range operands, speed against fp32
(docs/design.md#int8-kernels).

A kernel is admitted for an op kind and shape only if it returns, on operands spanning the whole uint8 x int8 range,
exactly ``float32(p)`` for the exact integer product ``p`` (kernels.py). The operands include the worst cases of
16-bit pair saturation, the failure of u8 x s8 instructions on CPUs without VNNI: a sample whose codes are all 255
(zero point 0) against output channels whose weights are all -128 or all 127, so every pair of products sums to
+-65 280, far outside int16; and the opposite zero point (255, codes 0). Admitted kernels are then timed on the
layer's own shapes against the fp32 operation the same layer would run in fp32 mode.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.grad import conv2d_input

from peer.lowp.kernels import (
    ConvGeometry,
    ProductKernel,
    reference_conv,
    reference_conv_dgrad,
    reference_linear,
)

#: extreme zero points (the fp32 kernel splits long reductions there) and the central one training nearly always has
#: (where it does not split them: K <= 1024)
_PROBE_ZERO_POINTS = (0, 128, 255)


@dataclass(frozen=True)
class OpCase:
    """One product of one layer: op kind, operand shapes (``a`` = codes of activation or gradient) and geometry.

    conv.fwd: a [N,C,H,W], w [Co,C/g,kh,kw] -> [N,Co,Ho,Wo]; conv.dgrad: a [N,Co,Ho,Wo] -> ``x_shape``;
    linear.fwd: a [M,K], w [N,K] -> [M,N]; linear.dgrad: a [M,N], w [N,K] -> [M,K].
    """

    op: str
    a_shape: tuple[int, ...]
    w_shape: tuple[int, ...]
    geom: ConvGeometry | None = None
    x_shape: tuple[int, ...] | None = None

    def conv_geom(self) -> ConvGeometry:
        """The geometry of a conv.* case (ValueError for a linear one)."""
        if self.geom is None:
            raise ValueError(f"{self.op} case has no convolution geometry")
        return self.geom

    def out_shape(self) -> tuple[int, ...]:
        """``x_shape``: the input shape a dgrad case produces, the output-gradient shape of a wgrad case."""
        if self.x_shape is None:
            raise ValueError(f"{self.op} case has no x_shape")
        return self.x_shape

    def label(self) -> str:
        """Short human-readable description for logs and status."""
        text = f"{self.op} {'x'.join(map(str, self.a_shape))} w{'x'.join(map(str, self.w_shape))}"
        if self.geom is not None and self.geom.stride != (1, 1):
            text += f" s{self.geom.stride[0]}"
        return text


def run_kernel(kernel: ProductKernel, case: OpCase, a: Tensor, zp: int, w: Tensor, scale: float = 1.0) -> Tensor:
    """``kernel``'s product for ``case`` on codes ``a`` (uint8, zero point ``zp``) and ``w`` (int8)."""
    if case.op == "conv.fwd":
        return kernel.conv_fwd(a, zp, w, case.conv_geom(), scale)
    if case.op == "conv.dgrad":
        return kernel.conv_dgrad(a, zp, w, case.conv_geom(), torch.Size(case.out_shape()), scale)
    if case.op == "linear.fwd":
        return kernel.linear(a, zp, w, scale)
    return kernel.linear(a, zp, w.t(), scale)  # linear.dgrad: (g - zp) @ w


def reference(case: OpCase, a: Tensor, zp: int, w: Tensor) -> Tensor:
    """The exact product of ``case`` (fp64 holding integers). Convolutions one sample at a time: the fp64
    convolution's im2col of a whole batch was the probe's largest transient (MNIST CNN batch 32: 57 MiB per call,
    above the fp32 training step's whole working set)."""
    if case.op == "conv.fwd":
        return torch.cat([reference_conv(sample, zp, w, case.conv_geom()) for sample in a.split(1)])
    if case.op == "conv.dgrad":
        sample_shape = torch.Size((1, *case.out_shape()[1:]))
        return torch.cat([reference_conv_dgrad(sample, zp, w, case.conv_geom(), sample_shape)
                          for sample in a.split(1)])
    if case.op == "linear.fwd":
        return reference_linear(a, zp, w)
    return reference_linear(a, zp, w.t())


def fp32_baseline(case: OpCase, device: torch.device) -> Callable[[], Tensor]:
    """The fp32 operation a fp32-mode layer runs for ``case`` (random operands), as a thunk to time."""
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(case.a_shape, generator=gen).to(device)
    w = torch.randn(case.w_shape, generator=gen).to(device)
    if case.op == "conv.fwd":
        g = case.conv_geom()
        return lambda: F.conv2d(a, w, None, g.stride, g.padding, g.dilation, g.groups)
    if case.op == "conv.dgrad":
        g, x_shape = case.conv_geom(), case.out_shape()
        return lambda: conv2d_input(x_shape, w, a, g.stride, g.padding, g.dilation, g.groups)
    if case.op == "linear.fwd":
        return lambda: F.linear(a, w)
    return lambda: a @ w


def full_range_operands(case: OpCase, device: torch.device, seed: int = 0) -> tuple[Tensor, Tensor]:
    """uint8 codes over [0, 255] and int8 weights over [-128, 127], with the pair-saturation worst cases built in."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randint(0, 256, case.a_shape, dtype=torch.uint8, generator=gen)
    w = torch.randint(-128, 128, case.w_shape, dtype=torch.int8, generator=gen)
    a[0] = 255  # first sample (conv) / row (linear): every code at the top
    a[-1] = 0  # last one at the bottom (large negative values with zero point 255)
    out_dim = 0 if case.op in ("conv.fwd", "linear.fwd") else 1  # w's dimension that indexes outputs
    w.select(out_dim, 0).fill_(-128)
    if w.shape[out_dim] > 1:
        w.select(out_dim, 1).fill_(127)
    return as_in_use(a.to(device)), w.to(device)


def as_in_use(codes: Tensor) -> Tensor:
    """4-D codes in the layout the fused passes hand to convolutions (channels_last): kernels are checked and timed
    on what they will really get (an fp32 convolution on NCHW codes ran 2-4x slower than on channels_last ones)."""
    return codes.contiguous(memory_format=torch.channels_last) if codes.dim() == 4 else codes


def check_exact(kernel: ProductKernel, case: OpCase, device: torch.device) -> str | None:
    """None if ``kernel`` is exact on ``case``'s full-range operands (extreme and central zero points), else why
    not."""
    a, w = full_range_operands(case, device)
    for zp in _PROBE_ZERO_POINTS:
        want = reference(case, a.cpu(), zp, w.cpu()).float()
        try:
            got = run_kernel(kernel, case, a, zp, w).float().cpu()
        except (RuntimeError, NotImplementedError, ValueError) as exc:
            return f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        if got.shape != want.shape:
            return f"wrong shape {tuple(got.shape)} != {tuple(want.shape)}"
        if not torch.equal(got, want):
            wrong = int((got != want).sum())
            return f"inexact: {wrong}/{want.numel()} entries wrong at zero point {zp}"
    return None


def timing_operands(case: OpCase, device: torch.device) -> tuple[Tensor, int, Tensor]:
    """Typical codes for timing: uint8 around zero point 128, int8 weights."""
    gen = torch.Generator().manual_seed(2)
    a = torch.randint(0, 256, case.a_shape, dtype=torch.uint8, generator=gen).to(device)
    w = torch.randint(-127, 128, case.w_shape, dtype=torch.int8, generator=gen).to(device)
    return as_in_use(a), 128, w
