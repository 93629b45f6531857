"""The deflate envelope: a codec payload entropy-coded with zlib when that makes it smaller.

Why: a dense 8-bit message (the consensus phase's, about 1 byte per parameter) does not use its codes evenly - the
differences Choco sends concentrate near zero - so Huffman coding them takes a fifth to a third off (MNIST CNN
phase messages of 422 kB: 0.79x in the README fleet, 0.68x in the simulator;
docs/RESULTS.md#the-consensus-phase-after-training) for about 1 ms per 100 kB to compress and 0.5 ms to inflate. Raw
fp32 values gain about 7%, sparse 1% messages little (their indices are already Rice-coded), so the codec only wraps
when asked (``CodecConfig.deflate``) and only when the result is smaller.

Wire form (docs/design.md#the-wire):

    envelope := magic  4 bytes  b"LPDZ"
                stream          a zlib stream (RFC 1950) whose inflated bytes are one LPDC payload

The inflated size is bounded by the receiver before it is reached (``max_inflated``: the smaller of the model's
largest valid payload and the receiver's payload limit, and never more than :data:`MAX_RATIO` times the envelope -
Huffman coding alone cannot shrink a byte below 1 bit, so an honest envelope never exceeds it), so a small hostile
envelope cannot make a peer allocate or inflate more than a few times what it sent.
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
#: Most bytes an honest envelope inflates to per byte of its stream (Huffman codes are at least 1 bit), and the
#: slack on top (zlib header, block headers, a short stream).
MAX_RATIO = 8
RATIO_SLACK = 64


def is_deflated(data: bytes | bytearray | memoryview) -> bool:
    """Whether ``data`` is a deflate envelope (by its magic)."""
    return bytes(memoryview(data)[: len(DEFLATE_MAGIC)]) == DEFLATE_MAGIC


def deflate(payload: bytes) -> bytes:
    """``payload`` in a deflate envelope if that is smaller, else ``payload`` itself."""
    compressor = zlib.compressobj(LEVEL, zlib.DEFLATED, zlib.MAX_WBITS, 9, STRATEGY)
    wrapped = DEFLATE_MAGIC + compressor.compress(payload) + compressor.flush()
    return wrapped if len(wrapped) < len(payload) else payload


def inflate(data: bytes | bytearray | memoryview, max_inflated: int) -> bytes:
    """The payload inside a deflate envelope, at most ``max_inflated`` bytes (>= 1) and at most :data:`MAX_RATIO`
    times the stream's size plus :data:`RATIO_SLACK`.

    Raises:
        PayloadError: not an envelope, a corrupt or truncated stream, bytes after its end, or more bytes inflated
            than either bound (checked while inflating: nothing larger is allocated).
        ValueError: ``max_inflated`` < 1 (a caller's bug: zlib reads 0 as no limit).
    """
    if max_inflated < 1:
        raise ValueError(f"inflate: max_inflated must be >= 1 byte, got {max_inflated}")
    view = memoryview(data)
    if not is_deflated(view):
        raise PayloadError("magic: not an LPDZ envelope")
    stream = view[len(DEFLATE_MAGIC):]
    limit = min(max_inflated, MAX_RATIO * len(stream) + RATIO_SLACK)
    inflater = zlib.decompressobj()
    try:
        payload = inflater.decompress(stream, limit)
    except zlib.error as e:
        raise PayloadError(f"deflate stream: {e}") from None
    if not inflater.eof and (inflater.unconsumed_tail or len(payload) >= limit):
        raise PayloadError(f"deflate stream inflates to more than {limit} bytes (the bound: the receiver's "
                           f"largest payload, and {MAX_RATIO}x the stream's {len(stream)} bytes)")
    if not inflater.eof:
        raise PayloadError("deflate stream: truncated")
    if inflater.unused_data:
        raise PayloadError(f"{len(inflater.unused_data)} trailing bytes after the deflate stream")
    return payload
