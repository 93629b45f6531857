"""k-bit symmetric quantisation: rounding error bounds, unbiasedness, bit packing."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from peer.compress.errors import PayloadError
from peer.compress.quant import (
    codes_len,
    dequantize,
    pack_codes,
    qmax,
    quantize,
    scale_fits,
    unpack_codes,
)

BITS = list(range(2, 9))


@pytest.mark.parametrize("bits", BITS)
def test_nearest_is_within_half_a_step_and_hits_the_extremes(bits: int) -> None:
    values = torch.randn(10_000, generator=torch.Generator().manual_seed(bits)) * 0.03
    codes, scale = quantize(values, bits, "nearest")
    assert scale == pytest.approx(float(values.abs().max()) / qmax(bits))
    decoded = dequantize(codes, bits, scale)
    assert decoded.dtype == torch.float32
    assert float((decoded - values).abs().max()) <= scale / 2 * (1 + 1e-5)
    assert int(codes.max()) <= 2 * qmax(bits) and int(codes.min()) >= 0
    assert float(decoded.abs().max()) == pytest.approx(float(values.abs().max()), rel=1e-6)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_stochastic_rounding_is_unbiased(bits: int) -> None:
    gen = torch.Generator().manual_seed(0)
    values = torch.tensor([1.0, -0.37, 0.5, 0.013, -0.999, 0.0])  # max 1.0 fixes the scale at 1/Q
    trials = 20_000
    total = torch.zeros_like(values)
    for _ in range(trials // 1000):
        batch = values.repeat(1000)
        codes, scale = quantize(batch, bits, "stochastic", gen)
        total += dequantize(codes, bits, scale).view(1000, -1).sum(0)
    mean = total / trials
    step = 1.0 / qmax(bits)
    # std of one draw <= step/2, so the mean's error is < 5 standard errors
    assert torch.allclose(mean, values, atol=5 * step / 2 / trials**0.5)
    codes, scale = quantize(values, bits, "stochastic", gen)
    assert float((dequantize(codes, bits, scale) - values).abs().max()) < step * (1 + 1e-6)


@pytest.mark.parametrize("bits", [4, 8])
def test_a_minimum_scale_coarsens_the_grid_of_small_values_and_leaves_large_ones_alone(bits: int) -> None:
    v = torch.linspace(-1.0, 1.0, 101) * 1e-3  # entries 2e-5 apart
    floor = 3e-4  # max |v| / Q is 1e-3 / 7 at 4 bits, 1e-3 / 127 at 8: below it both
    codes, scale = quantize(v, bits, "nearest", min_scale=floor)
    assert scale == pytest.approx(floor, rel=1e-6)
    assert float((dequantize(codes, bits, scale) - v).abs().max()) <= scale / 2 * (1 + 1e-6)
    assert (codes == qmax(bits)).sum() == 15  # the value 0 for |v| < 1.5e-4: the 15 entries nearest zero
    large = v * 1e3
    assert quantize(large, bits, "nearest", min_scale=floor)[1] == quantize(large, bits, "nearest")[1]


def test_zero_tensor_gives_zero_scale_and_zero_values() -> None:
    codes, scale = quantize(torch.zeros(5), 8, "nearest")
    assert scale == 0.0
    assert torch.equal(dequantize(codes, 8, scale), torch.zeros(5))


def test_non_finite_values_are_refused() -> None:
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize(torch.tensor([1.0, float("nan")]), 8, "nearest")
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize(torch.tensor([float("inf")]), 8, "stochastic")


@pytest.mark.parametrize("bits", BITS)
def test_values_near_the_fp32_maximum_are_refused_or_stay_finite(bits: int) -> None:
    """Q * fl(max / Q) can round up past the fp32 maximum: quantize refuses instead of producing Inf."""
    big = torch.tensor([np.finfo(np.float32).max, -1.0])
    if scale_fits(float(np.float32(big[0]) / np.float32(qmax(bits))), bits):
        codes, scale = quantize(big, bits, "nearest")
        assert torch.isfinite(dequantize(codes, bits, scale)).all()
    else:
        with pytest.raises(ValueError, match="overflows fp32"):
            quantize(big, bits, "nearest")
    codes, scale = quantize(big / 4, bits, "nearest")
    assert scale_fits(scale, bits) and torch.isfinite(dequantize(codes, bits, scale)).all()


def test_int8_overflow_case() -> None:
    assert not scale_fits(float(np.float32(np.finfo(np.float32).max) / np.float32(127)), 8)
    with pytest.raises(ValueError, match="overflows fp32 once quantised at 8 bits"):
        quantize(torch.tensor([np.finfo(np.float32).max]), 8, "nearest")


@given(st.sampled_from(BITS), st.data())
def test_pack_round_trip(bits: int, data: st.DataObject) -> None:
    codes = np.array(data.draw(st.lists(st.integers(0, 2 * qmax(bits)), max_size=100)), dtype=np.uint8)
    buf = pack_codes(codes, bits)
    assert len(buf) == codes_len(codes.size, bits) == (codes.size * bits + 7) // 8
    assert np.array_equal(unpack_codes(buf, codes.size, bits), codes)


def test_unpack_rejects_invalid_codes_padding_and_length() -> None:
    with pytest.raises(PayloadError, match="value code 255"):
        unpack_codes(bytes([0, 255]), 2, 8)
    with pytest.raises(PayloadError, match="value code 3"):
        unpack_codes(bytes([0b1100_0000]), 1, 2)
    with pytest.raises(PayloadError, match="padding"):
        unpack_codes(bytes([0b0100_0001]), 1, 2)
    with pytest.raises(PayloadError, match="packed length"):
        unpack_codes(bytes([1, 2, 3]), 2, 8)
