"""Fixed-width bit packing of unsigned integers (numpy-vectorised, no per-entry Python loops).

Values are written MSB first, back to back, and the last byte is padded with zero bits. Used for quantised values
(width = bits, 2..8) and for the low bits of Rice-coded index gaps (width 0..40). The unpacker insists on
the exact byte length and on zero padding, so every packed string has exactly one valid reading.
"""

from __future__ import annotations

import numpy as np

from .errors import PayloadError

MAX_WIDTH = 64


def packed_len(count: int, width: int) -> int:
    """Bytes taken by `count` values of `width` bits each."""
    return (count * width + 7) // 8


def _container(width: int) -> np.dtype:
    """Smallest big-endian unsigned dtype holding `width` bits."""
    for nbytes in (1, 2, 4, 8):
        if width <= 8 * nbytes:
            return np.dtype(f">u{nbytes}")
    raise ValueError(f"bit width {width} > {MAX_WIDTH}")


def pack_uint(values: np.ndarray, width: int) -> bytes:
    """Pack non-negative integers (each < 2**width) into `packed_len(len(values), width)` bytes."""
    if width == 0 or values.size == 0:
        return b""
    if width == 8:
        return values.astype(np.uint8).tobytes()
    dtype = _container(width)
    rows = np.unpackbits(values.astype(dtype).view(np.uint8).reshape(values.size, dtype.itemsize), axis=1)
    return np.packbits(rows[:, rows.shape[1] - width :].reshape(-1)).tobytes()


def unpack_uint(buf: bytes | memoryview, count: int, width: int) -> np.ndarray:
    """Inverse of `pack_uint`; returns unsigned ints in the smallest native container; PayloadError if malformed."""
    if len(buf) != packed_len(count, width):
        raise PayloadError(f"packed length {len(buf)} bytes, expected {packed_len(count, width)} for {count} x {width} bits")
    dtype = _container(max(width, 1))
    if width == 0:
        return np.zeros(count, dtype=dtype.newbyteorder("="))
    raw = np.frombuffer(buf, dtype=np.uint8)
    if width == 8:
        return raw.copy()
    bits = np.unpackbits(raw)
    if bits[count * width :].any():
        raise PayloadError("non-zero padding bits")
    rows = np.zeros((count, 8 * dtype.itemsize), dtype=np.uint8)
    rows[:, rows.shape[1] - width :] = bits[: count * width].reshape(count, width)
    return np.packbits(rows, axis=1).reshape(-1).view(dtype).astype(dtype.newbyteorder("="))
