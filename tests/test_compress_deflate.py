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


def segment_rms(reference: torch.Tensor) -> torch.Tensor:
    """Each entry's segment RMS in ``reference`` (what CodecConfig.step_floor is relative to)."""
    out = torch.empty_like(reference)
    for seg in LAYOUT.segments:
        part = reference[seg.offset:seg.offset + seg.numel]
        out[seg.offset:seg.offset + seg.numel] = part.norm() / seg.numel ** 0.5
    return out


def test_a_step_floor_sends_a_small_difference_on_a_coarser_grid_smaller_and_within_half_a_step() -> None:
    """A consensus-phase difference 3% of the model: on a grid of step_floor x the model's RMS per
    tensor it is mostly zero codes, deflated far smaller, each entry within half a step; the receiver decodes
    the same update. A difference too large for the floor to matter, or no reference, is sent as before."""
    gen = torch.Generator().manual_seed(5)
    model = torch.randn(LAYOUT.numel, generator=gen)
    small = 0.02 * heavy_tailed()
    floor = CodecConfig(bits=8, deflate=True, step_floor=0.02)
    fine, fine_decoded = encode(small, LAYOUT, CodecConfig(bits=8, deflate=True))
    coarse, coarse_decoded = encode(small, LAYOUT, floor, reference=model)
    assert len(coarse) < 0.6 * len(fine)
    assert same(decode(coarse, LAYOUT), coarse_decoded)
    error = (coarse_decoded.values - small).abs()
    assert bool((error <= 0.01 * segment_rms(model) * (1 + 1e-5)).all())
    assert float(error.max()) > float((fine_decoded.values - small).abs().max())  # the grid did get coarser
    large = 100 * small
    assert encode(large, LAYOUT, floor, reference=model)[0] == encode(large, LAYOUT, CodecConfig(deflate=True))[0]
    assert encode(small, LAYOUT, floor)[0] == fine


def test_a_step_floor_must_be_a_fraction_and_its_reference_fit_the_layout() -> None:
    for bad in (-0.1, 2.0, float("nan"), True):
        with pytest.raises(ValueError, match="CodecConfig.step_floor"):
            CodecConfig(step_floor=bad).validate()  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="reference"):
        encode(heavy_tailed(), LAYOUT, CodecConfig(step_floor=0.01), reference=torch.zeros(3))


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
