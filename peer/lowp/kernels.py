"""int8 matrix-product kernels: ``torch._int_mm`` with shape handling, and int8 im2col.

``torch._int_mm`` (int8 [M,K] x int8 [K,N] -> int32 [M,N]) is 2-D only. On CUDA it also
needs M > 16 and K, N multiples of 8: smaller/odd operands are zero-padded (zero rows and
columns add nothing to the exact integer result) and the result is sliced back.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

_CUDA_MIN_ROWS = 17
_CUDA_MULTIPLE = 8


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def int8_mm(a: Tensor, b: Tensor) -> Tensor:
    """Exact (where the probe passed) int32 product of int8 matrices ``a`` [M,K], ``b`` [K,N]."""
    if a.device.type != "cuda":
        return torch._int_mm(a.contiguous(), b.contiguous())
    m, k = a.shape
    n = b.shape[1]
    mp, kp, np_ = max(m, _CUDA_MIN_ROWS), _round_up(k, _CUDA_MULTIPLE), _round_up(n, _CUDA_MULTIPLE)
    if (mp, kp, np_) != (m, k, n):
        a = F.pad(a, (0, kp - k, 0, mp - m))
        b = F.pad(b, (0, np_ - n, 0, kp - k))
    return torch._int_mm(a.contiguous(), b.contiguous())[:m, :n]


def im2col_int8(codes: Tensor, kernel: tuple[int, int], stride: tuple[int, int],
                padding: tuple[int, int], pad_code: int) -> Tensor:
    """Patches of int8 ``codes`` [N,C,H,W] as rows [N*Ho*Wo, C*kh*kw] (dilation 1).

    Padding uses ``pad_code``, the code of 0.0, so padded taps dequantize to exact zeros.
    Column order (C, kh, kw) matches ``weight.reshape(C_out, -1)``.
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
    """Inverse scatter-add of ``im2col_int8`` for fp32 rows [N*Ho*Wo, C*kh*kw] -> [N,C,H,W]."""
    cols = cols.reshape(batch, -1, cols.shape[1]).transpose(1, 2)
    return F.fold(cols, in_hw, kernel, padding=padding, stride=stride)
