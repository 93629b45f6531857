"""The deflate envelope (peer/compress/deflate.py): smaller when the codes are uneven, the same Decoded, never
larger than the payload, and a hostile envelope - a bomb, a corrupt or truncated stream, trailing bytes, an
envelope in an envelope - refused with a PayloadError naming the cause, before anything large is allocated."""

from __future__ import annotations

import os
import zlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from peer.compress import CodecConfig, Decoded, Layout, PayloadError, decode, encode
from peer.compress.codec import max_payload_bytes
from peer.compress.deflate import DEFLATE_MAGIC, deflate, inflate

LAYOUT = Layout.from_named_shapes([("conv", (32, 8, 3, 3)), ("norm", (32,)), ("fc", (10, 512)), ("bias", (10,))])


def heavy_tailed(seed: int = 0) -> torch.Tensor:
    """A vector whose 8-bit codes crowd near zero (what a phase's differences look like): Laplace entries for
    seed 0, cubed normal ones otherwise."""
    gen = torch.Generator().manual_seed(seed)
    if seed == 0:
        uniform = torch.rand(LAYOUT.numel, generator=gen) - 0.5
        return -torch.sign(uniform) * torch.log1p(-2 * uniform.abs())
    return torch.randn(LAYOUT.numel, generator=gen) ** 3


def same(a: Decoded, b: Decoded) -> bool:
    return a.indices is None and b.indices is None and torch.equal(a.values.view(torch.int32),
                                                                   b.values.view(torch.int32))


@pytest.mark.parametrize("seed", [0, 1])
def test_a_dense_8bit_payload_of_uneven_codes_travels_deflated_smaller_and_decodes_to_the_same_update(seed) -> None:
    flat = heavy_tailed(seed)
    plain, plain_decoded = encode(flat, LAYOUT, CodecConfig(bits=8))
    packed, packed_decoded = encode(flat, LAYOUT, CodecConfig(bits=8, deflate=True))
    assert packed.startswith(DEFLATE_MAGIC) and plain.startswith(b"LPDC")
    assert len(packed) < 0.9 * len(plain)
    assert same(packed_decoded, plain_decoded)
    assert same(decode(packed, LAYOUT), plain_decoded)


def test_deflate_never_makes_a_payload_larger() -> None:
    noise = os.urandom(4096)
    assert deflate(noise) is noise
    flat = torch.randn(LAYOUT.numel, generator=torch.Generator().manual_seed(3))
    for cfg in (CodecConfig(compression=0.99), CodecConfig(bits=32)):
        plain, _ = encode(flat, LAYOUT, cfg)
        packed, _ = encode(flat, LAYOUT, CodecConfig(compression=cfg.compression, bits=cfg.bits, deflate=True))
        assert packed == plain or (packed.startswith(DEFLATE_MAGIC) and len(packed) < len(plain))


def envelope(inner: bytes, level: int = 1) -> bytes:
    return DEFLATE_MAGIC + zlib.compress(inner, level)


def test_a_deflate_bomb_is_refused_before_it_is_inflated_past_its_bounds() -> None:
    bomb = envelope(b"\0" * (64 * 1024 * 1024), 9)  # 64 MiB of zeros in about 64 kB
    assert len(bomb) < 100_000
    with pytest.raises(PayloadError, match="inflates to more than"):
        decode(bomb, LAYOUT)
    # even under a bound as large as the bomb: never more than 8 bytes per byte of stream (what Huffman codes allow)
    with pytest.raises(PayloadError, match=f"more than {8 * (len(bomb) - 4) + 64} bytes"):
        inflate(bomb, 10**9)
    with pytest.raises(ValueError, match="max_inflated"):
        inflate(bomb, 0)  # zlib would read 0 as "no limit"


def test_an_honest_envelope_inflates_to_exactly_its_bound_and_not_a_byte_more() -> None:
    payload, _ = encode(heavy_tailed(), LAYOUT, CodecConfig())
    packed = deflate(payload)
    assert packed.startswith(DEFLATE_MAGIC)
    assert inflate(packed, len(payload)) == payload
    with pytest.raises(PayloadError, match=f"more than {len(payload) - 1} bytes"):
        inflate(packed, len(payload) - 1)


@pytest.mark.parametrize(("data", "message"), [
    (DEFLATE_MAGIC + b"\x78\x01garbage", "deflate stream"),
    (envelope(bytes(range(256)) * 2)[:-3], "truncated|deflate stream"),
    (envelope(bytes(range(256)) * 2) + b"tail", "trailing bytes"),
    (envelope(b"not a payload at all"), "magic: not an LPDC payload"),
    (DEFLATE_MAGIC, "truncated"),
])
def test_hostile_envelopes_are_refused_naming_the_cause(data: bytes, message: str) -> None:
    with pytest.raises(PayloadError, match=message):
        decode(data, LAYOUT)


def test_an_envelope_inside_an_envelope_is_refused() -> None:
    inner, _ = encode(heavy_tailed(), LAYOUT, CodecConfig(deflate=True))
    assert inner.startswith(DEFLATE_MAGIC)
    with pytest.raises(PayloadError, match="not an LPDC payload"):
        decode(envelope(inner), LAYOUT)


def test_the_receivers_size_limit_applies_to_the_envelope_and_to_what_it_inflates_to() -> None:
    payload, _ = encode(heavy_tailed(), LAYOUT, CodecConfig())
    packed, _ = encode(heavy_tailed(), LAYOUT, CodecConfig(deflate=True))
    assert len(packed) < len(payload) < max_payload_bytes(LAYOUT)
    decode(packed, LAYOUT, max_bytes=len(payload))
    with pytest.raises(PayloadError, match="inflates to more than"):
        decode(packed, LAYOUT, max_bytes=len(payload) - 1)
    with pytest.raises(PayloadError, match="over the limit"):
        decode(packed, LAYOUT, max_bytes=len(packed) - 1)


def test_deflate_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match="CodecConfig.deflate"):
        CodecConfig(deflate="yes").validate()  # type: ignore[arg-type]


PACKED, _ = encode(heavy_tailed(), LAYOUT, CodecConfig(deflate=True))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_mutations_of_an_envelope_decode_or_raise_payload_error(data: st.DataObject) -> None:
    blob = bytearray(PACKED)
    for _ in range(data.draw(st.integers(1, 8))):
        blob[data.draw(st.integers(0, len(blob) - 1))] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(len(DEFLATE_MAGIC), len(blob)))
    try:
        decoded = decode(bytes(blob[:cut]), LAYOUT)
    except PayloadError:
        return
    assert decoded.values.numel() <= LAYOUT.numel and bool(torch.isfinite(decoded.values).all())
