"""The counter-based generator of stochastic rounding (docs/method.md#8-bit-local-training numerics): uniform [0, 1)
fp32 draws computed from each element's position and a per-call seed, by the compiled passes inside their kernels,
by the eager passes one block at a time, and by sim8's reference quantizer - the same bits in all three.

Why not torch.rand: its CPU generator (mt19937) is sequential and was about 20 ms of an eager int8 ResNet-20 step;
a hash of the position needs no state, vectorises, and fuses into a compiled kernel. The seed comes from torch's
generator (:func:`sr_seed`), so runs repeat under ``torch.manual_seed``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from peer.lowp.layout import inverse_order, memory_order

#: Odd multipliers of the hash (Wellons' hash prospector, "lowbias32").
_HASH_MUL = (0x21F0AAAD, 0x735A2D97)
_UNIFORM_BITS = 24  # random bits per uniform: torch.rand's fp32 resolution
_UNIFORM_STEP = 1.0 / (1 << _UNIFORM_BITS)
#: Largest block :func:`uniform_block_` fills (elements): the eager passes draw per block of this many (in L2).
BLOCK = 1 << 16


def sr_seed(device: torch.device) -> Tensor:
    """A fresh 64-bit seed as two int32, from torch's generator (runs repeat under a seed)."""
    return torch.randint(-2**31, 2**31, (2,), dtype=torch.int32).to(device)


def _shr32(h: Tensor, bits: int) -> Tensor:
    """Logical right shift of the 32-bit patterns held in int32 ``h`` (torch's ``>>`` on int32 is arithmetic)."""
    return (h >> bits) & ((1 << (32 - bits)) - 1)


def mix32(counter: Tensor, seed: Tensor) -> Tensor:
    """32 random bits per int32 ``counter`` (any shape) and 64-bit ``seed`` (two int32): ``(c + s0) * M1``,
    xorshift 16, ``(^ s1) * M2``, xorshift 15; products wrap modulo 2^32 on int32 lanes holding 32-bit patterns (two's
    complement: the same in eager ATen, inductor's C++ and Triton).

    For a uniform seed, ``c + s0`` is uniform over 2^32 and every later step is a bijection: each draw is exactly
    uniform. int32, not int64: AVX2 and NEON have no 64-bit vector multiply (5x slower compiled for AVX2)."""
    h = (counter + seed[0]) * _HASH_MUL[0]
    h = h ^ _shr32(h, 16)
    h = (h ^ seed[1]) * _HASH_MUL[1]
    return h ^ _shr32(h, 15)


def hash_uniform(like: Tensor, seed: Tensor) -> Tensor:
    """Uniform [0, 1) fp32 of ``like``'s shape and layout, 24 random bits each (torch.rand's distribution): the top
    24 bits of :func:`mix32` of each element's position in ``like``'s memory order (NCHW or channels_last), so a
    block-by-block fill in memory order (:func:`uniform_block_`) draws what a kernel draws per element."""
    order = memory_order(like)
    counter = torch.arange(like.numel(), dtype=torch.int32, device=like.device)
    counter = counter.reshape([like.shape[d] for d in order]).permute(inverse_order(order))
    return _shr32(mix32(counter, seed), 32 - _UNIFORM_BITS).to(torch.float32) * _UNIFORM_STEP


_POSITIONS: dict[torch.device, Tensor] = {}  # 0..BLOCK-1 per device, built once (arange costs three in-place passes)


def _positions(device: torch.device) -> Tensor:
    if device not in _POSITIONS:
        _POSITIONS[device] = torch.arange(BLOCK, dtype=torch.int32, device=device)
    return _POSITIONS[device]


def _xorshift_(h: Tensor, bits: int, tmp: Tensor) -> Tensor:
    """``h ^= h >>> bits`` in place (logical shift of 32-bit patterns; ``tmp`` a buffer of h's size)."""
    torch.bitwise_right_shift(h, bits, out=tmp).bitwise_and_((1 << (32 - bits)) - 1)
    return h.bitwise_xor_(tmp)


def uniform_block_(y: Tensor, start: Tensor, seed: Tensor, h: Tensor, tmp: Tensor) -> Tensor:
    """Fill fp32 ``y`` (1-D, at most :data:`BLOCK`) with :func:`hash_uniform`'s draws for the positions ``start + i``
    (``start`` an int32 0-d tensor), in place in the int32 buffers ``h`` and ``tmp`` of y's size: :func:`mix32`'s
    operations in its order, about half the time of ``torch.rand`` filling the same block."""
    torch.add(_positions(y.device)[:y.numel()], start + seed[0], out=h).mul_(_HASH_MUL[0])
    _xorshift_(h, 16, tmp).bitwise_xor_(seed[1]).mul_(_HASH_MUL[1])
    _xorshift_(h, 15, tmp)
    torch.bitwise_right_shift(h, 32 - _UNIFORM_BITS, out=tmp).bitwise_and_((1 << _UNIFORM_BITS) - 1)
    return y.copy_(tmp).mul_(_UNIFORM_STEP)
