"""Index coding: varint / bitmap / Rice round trips, smallest-choice, strict validation of crafted streams."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from peer.compress.errors import PayloadError
from peer.compress.indexcode import (
    BITMAP,
    RICE,
    VARINT,
    _encode_bitmap,
    _encode_rice,
    _gaps,
    decode_positions,
    decode_varints,
    encode_positions,
    encode_varints,
)


def _positions(draw_set: set[int]) -> np.ndarray:
    return np.array(sorted(draw_set), dtype=np.int64)


@given(st.lists(st.integers(0, 2**63 - 1), max_size=200))
def test_varint_round_trip(values: list[int]) -> None:
    arr = np.array(values, dtype=np.uint64)
    buf = encode_varints(arr)
    assert decode_varints(buf, len(values)).tolist() == values


def test_varint_known_bytes_and_large_vectorised() -> None:
    assert encode_varints(np.array([0, 1, 127, 128, 300], dtype=np.uint64)) == bytes(
        [0x00, 0x01, 0x7F, 0x80, 0x01, 0xAC, 0x02]
    )
    rng = np.random.default_rng(0)
    values = rng.integers(0, 2**40, size=200_000, dtype=np.uint64)
    assert np.array_equal(decode_varints(encode_varints(values), values.size), values.astype(np.int64))


@pytest.mark.parametrize(
    ("buf", "count", "message"),
    [
        (bytes([0x80]), 1, "holds 0 values"),
        (bytes([0x01, 0x80]), 1, "truncated"),
        (bytes([0x81, 0x00]), 1, "non-canonical"),
        (bytes([0xFF] * 9 + [0x01]), 1, "overflow"),
        (bytes([0x01, 0x02]), 1, "holds 2 values"),
    ],
)
def test_varint_rejects_malformed(buf: bytes, count: int, message: str) -> None:
    with pytest.raises(PayloadError, match=message):
        decode_varints(buf, count)


@settings(max_examples=60)
@given(st.integers(2, 5000).flatmap(lambda n: st.tuples(st.just(n), st.sets(st.integers(0, n - 1), min_size=1, max_size=n - 1))))
def test_each_coding_round_trips_and_smallest_is_chosen(case: tuple[int, set[int]]) -> None:
    numel, chosen = case
    positions = _positions(chosen)
    gaps = _gaps(positions)
    encodings = {
        VARINT: encode_varints(gaps),
        BITMAP: _encode_bitmap(positions, numel),
        **{(RICE, b): _encode_rice(gaps, b) for b in range(14)},
    }
    for key, buf in encodings.items():
        coding = key[0] if isinstance(key, tuple) else key
        assert np.array_equal(decode_positions(coding, buf, positions.size, numel), positions)
    coding, buf = encode_positions(positions, numel)
    assert np.array_equal(decode_positions(coding, buf, positions.size, numel), positions)
    # Never larger than the two contract codings; Rice's parameter is searched near log2(mean gap) only, which is
    # optimal for the geometric gaps of top-k sets (next test), not necessarily for adversarial sets.
    assert len(buf) <= min(len(encodings[VARINT]), len(encodings[BITMAP]))


def test_one_percent_density_costs_about_one_byte_per_position() -> None:
    rng = np.random.default_rng(1)
    numel = 1_000_000
    positions = np.sort(rng.choice(numel, size=numel // 100, replace=False)).astype(np.int64)
    coding, buf = encode_positions(positions, numel)
    assert coding == RICE
    assert len(buf) / positions.size < 1.03  # entropy of a random 1% subset: 1.01 bytes per position
    gaps = _gaps(positions)
    assert len(buf) == min(len(_encode_rice(gaps, b)) for b in range(20))


def test_dense_sets_pick_bitmap() -> None:
    positions = np.arange(0, 1000, 2, dtype=np.int64)
    assert encode_positions(positions, 1000)[0] == BITMAP


@pytest.mark.parametrize(
    ("coding", "buf", "count", "numel", "message"),
    [
        (VARINT, encode_varints(np.array([3, 0], dtype=np.uint64)), 2, 10, "duplicate"),
        (VARINT, encode_varints(np.array([3, 7], dtype=np.uint64)), 2, 10, "out of range"),
        (VARINT, encode_varints(np.array([10], dtype=np.uint64)), 1, 10, "out of range"),
        # 2**63 - 1 then +1 would wrap an int64 cumsum to a small (or negative, i.e. "unsorted") position
        (VARINT, encode_varints(np.array([2**62, 2**62, 2], dtype=np.uint64)), 3, 10, "out of range"),
        (BITMAP, bytes([0b1100_0000, 0b0000_0001]), 2, 10, "padding"),
        (BITMAP, bytes([0b1100_0000, 0]), 3, 10, "popcount"),
        (BITMAP, bytes([0b1100_0000]), 2, 10, "bitmap is 1 bytes"),
        (RICE, bytes([41, 0xFF]), 1, 10, "rice parameter"),
        (RICE, bytes([0]), 1, 10, "shorter"),
        (RICE, bytes([0, 0, 0b0010_0000]), 1, 10, "index out of range"),
        (RICE, bytes([0, 0, 0, 0b0010_0000]), 1, 10, "index out of range"),
        (RICE, bytes([0, 0b1000_0000, 0]), 1, 10, "trailing"),
        (RICE, bytes([0, 0b1100_0000]), 2, 10, "duplicate"),
        (RICE, bytes([2, 0b0000_0000, 0xFF]), 1, 100, "holds 8 values"),
        (RICE, bytes([2, 0b0000_0001, 0x80]), 1, 100, "padding"),
        (9, b"", 1, 10, "unknown index coding"),
    ],
)
def test_crafted_bad_positions_raise_payload_error(coding: int, buf: bytes, count: int, numel: int, message: str) -> None:
    with pytest.raises(PayloadError, match=message):
        decode_positions(coding, buf, count, numel)
