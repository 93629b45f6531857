"""The deflate envelope: a codec payload entropy-coded with zlib when that makes it smaller.

Why: a dense 8-bit message (the consensus phase's, about 1 byte per parameter) does not use its codes evenly - the
differences Choco sends concentrate near zero - so Huffman coding them takes a quarter or more off (MNIST CNN
phase messages of 422 kB, docs/RESULTS.md#the-consensus-phase-after-training) for about 1 ms per 100 kB to
compress and 0.5 ms to inflate. Raw fp32 values gain about 7%, sparse 1% messages little (their indices are
already Rice-coded), so the codec only wraps when asked (``CodecConfig.deflate``) and only when the result is
smaller.

Wire form (docs/design.md#the-wire):

    envelope := magic  4 bytes  b"LPDZ"
                stream          a zlib stream (RFC 1950) whose inflated bytes are one LPDC payload

The inflated size is bounded by the receiver before it is reached (``max_inflated``, from the model alone), so a
small hostile envelope cannot make a peer allocate more than the largest valid payload.
"""

from __future__ import annotations

import zlib

from .errors import PayloadError

__all__ = ["DEFLATE_MAGIC", "is_deflated", "deflate", "inflate"]

DEFLATE_MAGIC = b"LPDZ"
#: Huffman coding only, no string matching: a payload's gain is its codes' uneven use, not repeats - on dense
#: 8-bit codes of a heavy-tailed vector (421 kB) it came out 6% smaller than level 1's default strategy, in 4.4 ms
#: instead of 10.3 (inflate 1.8 ms; AMD EPYC, one core).
STRATEGY = zlib.Z_HUFFMAN_ONLY
LEVEL = 1


def is_deflated(data: bytes | bytearray | memoryview) -> bool:
    """Whether ``data`` is a deflate envelope (by its magic)."""
    return bytes(memoryview(data)[: len(DEFLATE_MAGIC)]) == DEFLATE_MAGIC


def deflate(payload: bytes) -> bytes:
    """``payload`` in a deflate envelope if that is smaller, else ``payload`` itself."""
    compressor = zlib.compressobj(LEVEL, zlib.DEFLATED, zlib.MAX_WBITS, 9, STRATEGY)
    wrapped = DEFLATE_MAGIC + compressor.compress(payload) + compressor.flush()
    return wrapped if len(wrapped) < len(payload) else payload


def inflate(data: bytes | bytearray | memoryview, max_inflated: int) -> bytes:
    """The payload inside a deflate envelope, at most ``max_inflated`` bytes.

    Raises:
        PayloadError: not an envelope, a corrupt or truncated stream, bytes after its end, or more than
            ``max_inflated`` bytes inflated (checked while inflating: nothing larger is allocated).
    """
    view = memoryview(data)
    if not is_deflated(view):
        raise PayloadError("magic: not an LPDZ envelope")
    inflater = zlib.decompressobj()
    try:
        payload = inflater.decompress(view[len(DEFLATE_MAGIC):], max_inflated)
    except zlib.error as e:
        raise PayloadError(f"deflate stream: {e}") from None
    if inflater.unconsumed_tail:
        raise PayloadError(f"deflate stream inflates to more than {max_inflated} bytes, the model's largest payload")
    if not inflater.eof:
        raise PayloadError("deflate stream: truncated")
    if inflater.unused_data:
        raise PayloadError(f"{len(inflater.unused_data)} trailing bytes after the deflate stream")
    return payload
