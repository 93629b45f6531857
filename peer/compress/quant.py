
"""k-bit symmetric quantisation with one fp32 scale per tensor (docs/method.md#communication-compression).
A tensor's kept values v are sent as signed integers q in [-Q, Q], Q = 2**(bits-1) - 1, and one fp32 scale
s = max|v| / Q (units: value per integer step); the receiver uses q * s. On the wire q travels offset to the
unsigned code u = q + Q in [0, 2Q] (2Q = 2**bits - 2, so the all-ones code is invalid and rejected), bit-packed
at `bits` bits per value (one byte at bits = 8).

Rounding: "nearest" (|v - q*s| <= s/2, deterministic) or "stochastic" (q = floor(v/s + u), u ~ U[0, 1):
E[q*s] = v: unbiased, for callers that run without error feedback).

`dequantize` is the ONE function that turns codes into fp32 values; the encoder and decoder both call it, so the
sender's copy of what it sent is bit-identical to what the receiver adds (mass conservation,
docs/method.md#gossip-algorithms).
"""

from __future__ import annotations

import numpy as np
import torch

from .bitpack import pack_uint, packed_len, unpack_uint
from .errors import PayloadError
from .kinds import ROUNDINGS

MIN_BITS = 2
MAX_BITS = 8


def qmax(bits: int) -> int:
    """Largest integer magnitude Q at `bits` bits (127 at 8 bits, 1 at 2 bits)."""
    return (1 << (bits - 1)) - 1


def scale_fits(scale: float, bits: int) -> bool:
    """Whether Q * scale, the largest decoded magnitude, is finite in fp32 (every (u - Q) * scale then is too)."""
    with np.errstate(over="ignore"):
        return bool(np.isfinite(np.float32(qmax(bits)) * np.float32(scale)))


def quantize(
    values: torch.Tensor, bits: int, rounding: str, generator: torch.Generator | None = None, min_scale: float = 0.0
) -> tuple[np.ndarray, float]:
    """Quantise 1-D fp32 `values` to unsigned codes (uint8, in [0, 2Q]) and the fp32 scale (returned as float).

    `min_scale` (>= 0, value per integer step) coarsens the grid of small tensors: the scale is
    max(max|v| / Q, min_scale), so with nearest rounding values below half of it send the value 0 (code Q) - what
    an entropy coder then shrinks (codec.CodecConfig.step_floor).

    Raises ValueError if `values` holds NaN or Inf: a non-finite model is a local bug, never something to send; or
    if max|v| is so close to the fp32 maximum that Q * scale rounds up to Inf (the receiver would refuse it).
    Arithmetic is fp32 numpy (cheap on small tensors); `generator` drives the stochastic rounding noise.
    """
    q_max = qmax(bits)
    v = values.numpy()
    max_abs = np.abs(v).max(initial=np.float32(0))
    if not np.isfinite(max_abs):
        raise ValueError("quantize: values contain NaN or Inf")
    scale = np.float32(max(max_abs / np.float32(q_max), np.float32(min_scale)))
    if not scale_fits(float(scale), bits):
        raise ValueError(f"quantize: max |value| {float(max_abs)!r} overflows fp32 once quantised at {bits} bits")
    if scale == 0:
        return np.full(v.size, q_max, dtype=np.uint8), 0.0
    x = v / scale
    if rounding == "nearest":
        x = np.rint(x)
    else:
        x = np.floor(x + torch.rand(v.shape, generator=generator, dtype=torch.float32).numpy())
    np.clip(x, -q_max, q_max, out=x)
    return (x + np.float32(q_max)).astype(np.uint8), float(scale)


def dequantize(codes: np.ndarray, bits: int, scale: float) -> torch.Tensor:
    """fp32 values (code - Q) * scale; exact integer arithmetic then one fp32 multiply, identical on both ends."""
    signed = codes.astype(np.float32) - np.float32(qmax(bits))
    return torch.from_numpy(signed * np.float32(scale))


def pack_codes(codes: np.ndarray, bits: int) -> bytes:
    """Bit-pack unsigned codes at `bits` bits each (plain bytes at 8 bits)."""
    return pack_uint(codes, bits)


def codes_len(count: int, bits: int) -> int:
    """Bytes taken by `count` packed codes."""
    return packed_len(count, bits)


def unpack_codes(buf: bytes | memoryview, count: int, bits: int) -> np.ndarray:
    """Unpack and range-check codes; PayloadError on a bad length, padding, or code outside [0, 2Q]."""
    codes = unpack_uint(buf, count, bits).astype(np.uint8, copy=False)
    if codes.size and int(codes.max()) > 2 * qmax(bits):
        raise PayloadError(f"value code {int(codes.max())} > {2 * qmax(bits)} at {bits} bits")
    return codes
