"""A model's count-sketch: a few kB from which a neighbour estimates how far its own model is from the sender's
(docs/method.md#the-consensus-phase).

Why: a consensus phase on the rotating exponential graph averages 2^k peers exactly in k dense rounds, but no peer
can tell from those rounds' messages that it is done - each carries its sender's model from BEFORE the round - so
one more dense round only confirmed agreement: a quarter of the 8-peer phase's bytes (230-340 kB a message for the
MNIST CNN). A probe sends this sketch instead (4 KiB at the default 1024 buckets).

The count-sketch ``S`` is linear (``S(a) - S(b) = S(a - b)``) and ``||S(v)||^2`` is an unbiased estimate of
``||v||^2`` whose relative standard deviation is at most ``sqrt(2 / buckets)`` (4.4% at 1024 buckets; so about 2.2%
for the distance itself): coordinate ``j`` goes to bucket ``h(j)`` with sign ``s(j)``, both from fixed integer hashes
of ``j`` - the same on every machine and every torch version, so two peers of one model layout sketch alike.

Everything here is pure: tensors and numbers, no network, no clock.
"""

from __future__ import annotations

import math

import torch

from peer.errors import PeerError
from peer.gossip.consensus import MIN_NORM

__all__ = ["PROBE_BUCKETS", "SKETCH_BYTES", "SketchError", "decode_sketch", "encode_sketch", "estimated_distance",
           "sketch"]

#: Buckets of a probe's sketch: 4 KiB of float32 on the wire, the distance estimated within about 2.2% (one
#: standard deviation) - far finer than a phase tolerance of 0.02 needs, at about 1.5% of a dense phase message.
PROBE_BUCKETS = 1024
#: Bytes of a probe's sketch on the wire (float32 each).
SKETCH_BYTES = PROBE_BUCKETS * 4
#: The hashes' prime modulus (2^31 - 1) and multipliers/offsets: ``((a * j + b) mod P)``, exact in int64 for any
#: index below 2^32.
_PRIME = 2_147_483_647
_BUCKET_HASH = (1_103_515_245, 12_345)
_SIGN_HASH = (214_013, 2_531_011)


class SketchError(PeerError, ValueError):
    """A probe's sketch is refused: wrong length or a non-finite value."""

    default_reason = "bad_probe"


#: Coordinates hashed at a time: the hashes are recomputed at each sketch (about 9 ms for the MNIST CNN's 422k
#: entries) rather than kept, which would hold 12 bytes per model entry (134 MB for an 11M-parameter model).
_CHUNK = 1 << 18


def sketch(vector: torch.Tensor, buckets: int = PROBE_BUCKETS) -> torch.Tensor:
    """The count-sketch of a flat model ``vector`` (float32, ``buckets`` entries, on the CPU)."""
    flat = vector.detach().reshape(-1).to(device="cpu", dtype=torch.float32)
    out = torch.zeros(buckets, dtype=torch.float32)
    for start in range(0, flat.numel(), _CHUNK):
        part = flat[start:start + _CHUNK]
        index = torch.arange(start, start + part.numel(), dtype=torch.int64)
        bucket = (index * _BUCKET_HASH[0] + _BUCKET_HASH[1]) % _PRIME % buckets
        negative = (index * _SIGN_HASH[0] + _SIGN_HASH[1]) % _PRIME % 2 == 1
        out.index_add_(0, bucket, torch.where(negative, -part, part))
    return out


def encode_sketch(values: torch.Tensor) -> bytes:
    """A sketch as wire bytes: little-endian float32."""
    return values.to(torch.float32).contiguous().numpy().astype("<f4").tobytes()


def decode_sketch(data: bytes | memoryview, buckets: int = PROBE_BUCKETS) -> torch.Tensor:
    """A probe's sketch from its wire bytes.

    Raises:
        SketchError: not exactly ``buckets`` float32 values, or a value not finite.
    """
    if len(data) != buckets * 4:
        raise SketchError(f"sketch of {len(data)} bytes, expected {buckets * 4} ({buckets} float32)")
    values = torch.frombuffer(bytearray(data), dtype=torch.float32)
    if not bool(torch.isfinite(values).all()):
        raise SketchError("sketch holds a NaN or infinite value")
    return values


def estimated_distance(other: torch.Tensor, own: torch.Tensor) -> float:
    """``||z_other - z_own|| / ||z_own||`` estimated from ``other``'s sketch and this peer's flat model ``own``."""
    gap = float(torch.linalg.vector_norm(other - sketch(own, other.numel())))
    norm = float(torch.linalg.vector_norm(own))
    return gap / max(norm, MIN_NORM) if math.isfinite(gap) else math.inf
