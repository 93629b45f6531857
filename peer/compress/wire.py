"""Byte-level primitives of the payload format: u8, unsigned LEB128 varint, little-endian f32, raw slices.

`Reader` is a bounds-checked cursor: every read names the field it is reading, so a truncated or corrupt payload
fails with a PayloadError that says which field ran out, never an IndexError or struct.error.
"""

from __future__ import annotations

import struct

from .errors import PayloadError

# Header varints (tensor count, ids, k, lengths) are < 2**63; 9 groups of 7 bits hold that.
_MAX_SCALAR_VARINT_BYTES = 9
_F32 = struct.Struct("<f")


def varint(value: int) -> bytes:
    """Unsigned LEB128 encoding of one non-negative int."""
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def f32(value: float) -> bytes:
    """Little-endian IEEE-754 single (the value must already be exactly representable)."""
    return _F32.pack(value)


class Reader:
    """Sequential reader over a payload; PayloadError (naming the field) on truncation or malformed scalars."""

    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        self._buf = memoryview(data).cast("B")
        self._pos = 0

    @property
    def remaining(self) -> int:
        """Bytes not read yet."""
        return len(self._buf) - self._pos

    def take(self, n: int, field: str) -> memoryview:
        """The next `n` bytes."""
        if n > self.remaining:
            raise PayloadError(f"{field}: truncated (need {n} bytes, {self.remaining} left)")
        out = self._buf[self._pos : self._pos + n]
        self._pos += n
        return out

    def u8(self, field: str) -> int:
        """One unsigned byte."""
        return self.take(1, field)[0]

    def f32(self, field: str) -> float:
        """One little-endian f32, as a Python float (exact)."""
        return _F32.unpack(self.take(4, field))[0]

    def varint(self, field: str) -> int:
        """One canonical (minimal-length) unsigned LEB128 varint."""
        value = 0
        for i in range(_MAX_SCALAR_VARINT_BYTES):
            byte = self.u8(field)
            value |= (byte & 0x7F) << (7 * i)
            if not byte & 0x80:
                if byte == 0 and i > 0:
                    raise PayloadError(f"{field}: non-canonical varint")
                return value
        raise PayloadError(f"{field}: varint overflow (> {_MAX_SCALAR_VARINT_BYTES} bytes)")
