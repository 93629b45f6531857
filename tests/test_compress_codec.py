"""The payload codec: exact round trips, encode's Decoded == decode(bytes), strict refusal of bad payloads."""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from peer.compress import CodecConfig, Decoded, Layout, PayloadError, decode, encode
from peer.compress.codec import DENSE, F32_WIDTH, FORMAT_VERSION, SINGLE
from peer.compress.indexcode import (
    BITMAP,
    RICE,
    VARINT,
    encode_positions,
    encode_varints,
)
from peer.compress.quant import dequantize, quantize
from peer.compress.topk import keep_count
from peer.compress.wire import f32, varint

LAYOUT = Layout.from_named_shapes([("conv", (20, 3, 3, 3)), ("norm", (20,)), ("one", (1,)), ("fc", (10, 200)), ("bias", (10,))])
SMALL = Layout.from_named_shapes([("w", (100,))])


def _flat(layout: Layout, seed: int = 0) -> torch.Tensor:
    return torch.randn(layout.numel, generator=torch.Generator().manual_seed(seed)) * 0.1


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def _same(a: Decoded, b: Decoded) -> bool:
    if (a.indices is None) != (b.indices is None):
        return False
    return (a.indices is None or torch.equal(a.indices, b.indices)) and _bits_equal(a.values, b.values)


# ---- config ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"compression": 1.0}, "compression"),
        ({"compression": -0.1}, "compression"),
        ({"compression": float("nan")}, "compression"),
        ({"compression": "0.5"}, "compression"),
        ({"bits": 1}, "bits"),
        ({"bits": 9}, "bits"),
        ({"bits": 16}, "bits"),
        ({"bits": 8.0}, "bits"),
        ({"bits": True}, "bits"),
        ({"rounding": "floor"}, "rounding"),
    ],
)
def test_config_validation_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"CodecConfig.{field}"):
        CodecConfig(**kwargs).validate()
    with pytest.raises(ValueError, match=f"CodecConfig.{field}"):
        encode(_flat(LAYOUT), LAYOUT, CodecConfig(**kwargs))


def test_defaults_are_dense_int8_nearest() -> None:
    cfg = CodecConfig()
    cfg.validate()
    assert (cfg.compression, cfg.bits, cfg.rounding) == (0.0, 8, "nearest")


# ---- round trips -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("c", [0.0, 0.3, 0.9, 0.99, 0.999])
def test_k_per_layer(c: float) -> None:
    flat = _flat(LAYOUT)
    _, decoded = encode(flat, LAYOUT, CodecConfig(compression=c))
    counts = [keep_count(s.numel, c) for s in LAYOUT.segments]
    assert counts == [max(1, math.floor(s.numel * (1 - c))) for s in LAYOUT.segments]
    if c == 0.0:
        assert decoded.indices is None and decoded.values.numel() == LAYOUT.numel
        return
    for seg, k in zip(LAYOUT.segments, counts):
        inside = (decoded.indices >= seg.offset) & (decoded.indices < seg.offset + seg.numel)
        assert int(inside.sum()) == k


@pytest.mark.parametrize("bits", [2, 3, 5, 8, 32])
@pytest.mark.parametrize("c", [0.5, 0.99])
def test_round_trip_is_exact_on_the_kept_entries(bits: int, c: float) -> None:
    flat = _flat(LAYOUT, seed=bits)
    data, decoded = encode(flat, LAYOUT, CodecConfig(compression=c, bits=bits))
    received = decode(data, LAYOUT)
    assert _same(decoded, received)
    assert torch.all(received.indices[1:] > received.indices[:-1])
    for seg in LAYOUT.segments:
        part = flat[seg.offset : seg.offset + seg.numel]
        k = keep_count(seg.numel, c)
        expected = torch.sort(torch.topk(part.abs(), k).indices).values + seg.offset
        inside = (received.indices >= seg.offset) & (received.indices < seg.offset + seg.numel)
        assert torch.equal(received.indices[inside], expected)
        kept = flat[expected]
        if bits == 32:
            assert _bits_equal(received.values[inside], kept)
        else:
            codes, scale = quantize(kept, bits, "nearest")
            assert _bits_equal(received.values[inside], dequantize(codes, bits, scale))


def test_dense_round_trip_and_size() -> None:
    flat = _flat(LAYOUT)
    data, decoded = encode(flat, LAYOUT, CodecConfig())
    assert decoded.indices is None
    assert _same(decoded, decode(data, LAYOUT))
    assert len(data) <= LAYOUT.numel + 14 + 10 * len(LAYOUT.segments)
    raw, raw_decoded = encode(flat, LAYOUT, CodecConfig(bits=32))
    assert _bits_equal(raw_decoded.values, flat)
    assert _bits_equal(decode(raw, LAYOUT).values, flat)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    shapes=st.lists(st.lists(st.integers(1, 40), min_size=1, max_size=3), min_size=1, max_size=5),
    c=st.sampled_from([0.0, 0.1, 0.5, 0.9, 0.99]),
    bits=st.sampled_from([2, 4, 6, 8, 32]),
    rounding=st.sampled_from(["nearest", "stochastic"]),
    scale=st.sampled_from([0.0, 1e-30, 1e-3, 1.0, 1e30]),
    seed=st.integers(0, 2**31 - 1),
)
def test_encoders_decoded_is_bit_identical_to_decode(
    shapes: list[list[int]], c: float, bits: int, rounding: str, scale: float, seed: int
) -> None:
    layout = Layout.from_named_shapes((f"t{i}", tuple(s)) for i, s in enumerate(shapes))
    gen = torch.Generator().manual_seed(seed)
    flat = torch.randn(layout.numel, generator=gen) * scale
    data, decoded = encode(flat, layout, CodecConfig(compression=c, bits=bits, rounding=rounding), gen)
    received = decode(data, layout)
    assert _same(decoded, received)
    # Mass conservation: the sender subtracts what encode returned, the receiver adds what it decoded; in exact
    # (float64, both operands fp32) arithmetic the total is unchanged.
    sender = flat.double() - decoded.to_dense(layout.numel).double()
    receiver = received.to_dense(layout.numel).double()
    assert torch.equal(sender + receiver, flat.double())


def test_add_into_and_to_dense() -> None:
    flat = _flat(LAYOUT)
    _, sparse = encode(flat, LAYOUT, CodecConfig(compression=0.9, bits=32))
    target = torch.ones(LAYOUT.numel)
    sparse.add_into(target, -0.5)
    expected = torch.ones(LAYOUT.numel)
    expected[sparse.indices] -= 0.5 * flat[sparse.indices]
    assert torch.allclose(target, expected)
    dense_view = sparse.to_dense(LAYOUT.numel)
    assert int((dense_view != 0).sum()) == sparse.indices.numel()
    _, dense = encode(flat, LAYOUT, CodecConfig(bits=32))
    target = torch.zeros(LAYOUT.numel)
    dense.add_into(target, 2.0)
    assert torch.equal(target, 2 * flat)
    assert torch.equal(dense.to_dense(LAYOUT.numel), flat)


def test_stochastic_encoding_is_reproducible_with_a_generator() -> None:
    flat = _flat(LAYOUT)
    cfg = CodecConfig(compression=0.5, bits=4, rounding="stochastic")
    a, _ = encode(flat, LAYOUT, cfg, torch.Generator().manual_seed(7))
    b, _ = encode(flat, LAYOUT, cfg, torch.Generator().manual_seed(7))
    assert a == b


def test_encode_refuses_bad_input() -> None:
    flat = _flat(LAYOUT)
    flat[3] = float("nan")
    with pytest.raises(ValueError, match=r"tensor 0 \(conv\).*NaN"):
        encode(flat, LAYOUT, CodecConfig(compression=0.5))
    with pytest.raises(ValueError, match=r"tensor 0 \(conv\).*NaN"):
        encode(flat, LAYOUT, CodecConfig(bits=32))
    with pytest.raises(ValueError, match="1-D float32"):
        encode(torch.zeros(3), LAYOUT, CodecConfig())
    huge = torch.zeros(SMALL.numel)
    huge[5] = float(np.finfo(np.float32).max)
    with pytest.raises(ValueError, match=r"tensor 0 \(w\).*overflows fp32"):
        encode(huge, SMALL, CodecConfig(compression=0.99))
    assert torch.equal(decode(encode(huge, SMALL, CodecConfig(compression=0.99, bits=32))[0], SMALL).values, huge[5:6])


def test_wire_header_layout() -> None:
    data, _ = encode(torch.arange(100, dtype=torch.float32), SMALL, CodecConfig(compression=0.9))
    assert data[:4] == b"LPDC" and data[4] == FORMAT_VERSION == 2 and data[5:13] == SMALL.digest()
    assert data[13] == 1  # one tensor: every segment present, so no id follows
    assert data[14] >> 4 in (VARINT, BITMAP, RICE) and data[14] & 0x0F == 8  # form: coding << 4 | width
    assert data[15] == keep_count(100, 0.9) == 9  # k (floor(100 * 0.1) is 9 in floating point)
    scale = struct.unpack("<f", data[16:20])[0]
    assert scale == pytest.approx(99 / 127)


def test_single_entry_record_is_form_position_f32() -> None:
    flat = torch.zeros(100)
    flat[42] = -3.0
    flat[7] = 0.5
    data, decoded = encode(flat, SMALL, CodecConfig(compression=0.99))  # keeps 1 entry
    record = data[14:]
    assert record == bytes([SINGLE << 4 | F32_WIDTH, 42]) + struct.pack("<f", float(decoded.values[0]))
    # the value is the one the int8 record would have carried: (u - Q) * scale, here exactly -3.0
    codes, scale = quantize(torch.tensor([-3.0]), 8, "nearest")
    assert _bits_equal(decoded.values, dequantize(codes, 8, scale))
    assert decoded.indices.tolist() == [42] and _same(decoded, decode(data, SMALL))
    raw, raw_decoded = encode(flat, SMALL, CodecConfig(compression=0.99, bits=32))
    assert raw[14:] == bytes([SINGLE << 4 | F32_WIDTH, 42]) + struct.pack("<f", -3.0)
    assert _same(raw_decoded, decode(raw, SMALL))


def test_per_tensor_overhead() -> None:
    """Full payload of LAYOUT at 1%: ids implied, SINGLE for the k = 1 tensors, no scale for raw f32."""
    flat = _flat(LAYOUT)
    data, decoded = encode(flat, LAYOUT, CodecConfig(compression=0.99))
    def general(seg_id: int, k: int) -> int:  # form, k, scale, [index_len], index, k int8 codes
        seg = LAYOUT.segments[seg_id]
        positions = np.sort(torch.topk(flat[seg.offset : seg.offset + seg.numel].abs(), k).indices.numpy())
        coding, index = encode_positions(positions, seg.numel)
        index_len = len(varint(len(index))) if coding in (VARINT, RICE) else 0
        return 1 + len(varint(k)) + 4 + index_len + len(index) + k

    # conv k=5, norm k=1 (SINGLE: form, 1-byte position, f32), one (dense: form, scale, code), fc k=20, bias k=1
    assert len(data) == 14 + general(0, 5) + 6 + 6 + general(3, 20) + 6
    dense, _ = encode(flat, LAYOUT, CodecConfig())
    assert len(dense) == 14 + 5 * len(LAYOUT.segments) + LAYOUT.numel  # form + scale per tensor
    raw, _ = encode(flat, LAYOUT, CodecConfig(bits=32))
    assert len(raw) == 14 + len(LAYOUT.segments) + 4 * LAYOUT.numel  # form only
    assert raw[-4:] == struct.pack("<f", float(flat[-1])) and raw[15:19] == struct.pack("<f", float(flat[0]))
    assert decoded.values.numel() == 5 + 1 + 1 + 20 + 1


# ---- refusal of bad payloads -----------------------------------------------------------------------------------

PAIR = Layout.from_named_shapes([("a", (100,)), ("b", (50,))])
TINY = Layout.from_named_shapes([("one", (1,)), ("w", (100,))])
V2 = bytes([FORMAT_VERSION])


def _payload(tensors: list[bytes], n: int | None = None, layout: Layout = SMALL, version: bytes = V2) -> bytes:
    return b"LPDC" + version + layout.digest() + varint(len(tensors) if n is None else n) + b"".join(tensors)


def _tensor(
    coding: int = VARINT, width: int = 8, k: int = 2, scale: bytes = f32(0.5),
    index: bytes = encode_varints(np.array([3, 4], dtype=np.uint64)), values: bytes = bytes([127, 130]),
    tid: int | None = None,
) -> bytes:
    """A general (non-SINGLE) v2 record; k, scale and index_len only where the format has them."""
    out = (varint(tid) if tid is not None else b"") + bytes([coding << 4 | width])
    out += varint(k) if coding != DENSE else b""
    out += scale if width != F32_WIDTH else b""
    out += varint(len(index)) if coding in (VARINT, RICE) else b""
    return out + index + values


def _single(position: bytes = varint(7), value: bytes = f32(-1.5), width: int = F32_WIDTH, tid: int | None = None) -> bytes:
    return (varint(tid) if tid is not None else b"") + bytes([SINGLE << 4 | width]) + position + value


def _v1_tensor() -> bytes:
    """The same record as _tensor() in format version 1: id, coding, bits, k, scale, index_len, index, values."""
    index = encode_varints(np.array([3, 4], dtype=np.uint64))
    return varint(0) + bytes([VARINT, 8]) + varint(2) + f32(0.5) + varint(len(index)) + index + bytes([127, 130])


def test_crafted_valid_payloads_decode() -> None:
    decoded = decode(_payload([_tensor()]), SMALL)
    assert decoded.indices.tolist() == [3, 7]
    assert decoded.values.tolist() == [0.0, 1.5]
    decoded = decode(_payload([_single()]), SMALL)
    assert decoded.indices.tolist() == [7] and decoded.values.tolist() == [-1.5]
    bitmap = np.packbits(np.isin(np.arange(100), [3, 7])).tobytes()
    decoded = decode(_payload([_tensor(coding=BITMAP, index=bitmap)]), SMALL)
    assert decoded.indices.tolist() == [3, 7]
    # a k = 1 tensor in a general coding, and raw f32 values: accepted (the encoder would send SINGLE)
    decoded = decode(_payload([_tensor(width=F32_WIDTH, k=1, index=varint(9), values=f32(2.0))]), SMALL)
    assert decoded.indices.tolist() == [9] and decoded.values.tolist() == [2.0]


def test_subset_payloads_carry_ids() -> None:
    """Fewer tensors than segments: each record starts with its id (ascending); all of them: ids implied."""
    b_only = decode(_payload([_single(tid=1)], layout=PAIR), PAIR)
    assert b_only.indices.tolist() == [107]
    a_only = decode(_payload([_tensor(tid=0)], layout=PAIR), PAIR)
    assert a_only.indices.tolist() == [3, 7]
    both = decode(_payload([_tensor(), _single()], layout=PAIR), PAIR)
    assert both.indices.tolist() == [3, 7, 107]
    assert decode(_payload([], layout=PAIR), PAIR).indices.tolist() == []


def test_version_1_is_refused_by_name() -> None:
    with pytest.raises(PayloadError, match=r"version 1 not supported \(this peer reads 2\)"):
        decode(_payload([_v1_tensor()], version=bytes([1])), SMALL)


BAD = [
    (b"XXXX" + _payload([_tensor()])[4:], "magic"),
    (_payload([_tensor()], version=bytes([3])), "version 3"),
    (_payload([_tensor()], version=bytes([0])), "version 0"),
    (_payload([_tensor()], layout=LAYOUT), "payload is for another model"),
    (_payload([_tensor()], n=2), r"n_tensors 2 > 1"),
    (_payload([_tensor(), _tensor()], n=1), "trailing bytes"),
    (_payload([_tensor(coding=5)]), "unknown coding 5"),
    (_payload([_tensor(coding=15)]), "unknown coding 15"),
    (_payload([_tensor(width=9)]), "width 9"),
    (_payload([_tensor(width=1)]), "width 1"),
    (_payload([_tensor(width=0)]), "width 0"),
    (_payload([_tensor(width=14)]), "width 14"),
    (_payload([_tensor(k=0, index=b"", values=b"")]), "k 0"),
    (_payload([_tensor(k=100)]), "k 100"),
    (_payload([_tensor(coding=DENSE, index=b"", values=bytes(99))]), "w.*values: truncated"),
    (_payload([_tensor(coding=DENSE, width=F32_WIDTH, index=b"", values=f32(1.0) * 99)]), "w.*values: truncated"),
    (_payload([_tensor(scale=f32(float("nan")))]), "scale nan"),
    (_payload([_tensor(scale=f32(float("inf")))]), "scale inf"),
    (_payload([_tensor(scale=f32(-1.0))]), "scale -1.0"),
    (_payload([_tensor(scale=f32(-0.0))]), "scale -0.0"),
    # finite scale, but 127 * scale is Inf in f32: the decoded values would not be finite
    (_payload([_tensor(scale=f32(float(np.finfo(np.float32).max) / 100))]), "overflows f32 at width 8"),
    (_payload([_tensor(width=F32_WIDTH, values=f32(1.0) + f32(float("inf")))]), "NaN or Inf"),
    # a raw-f32 record carries no scale: one sent anyway is read as values and leaves trailing bytes
    (_payload([_tensor(width=F32_WIDTH, values=f32(1.0) + f32(1.0) + f32(1.0))]), "4 trailing bytes"),
    (_payload([_tensor(values=bytes([255, 0]))]), "value code 255"),
    (_payload([_tensor(index=encode_varints(np.array([3, 0], dtype=np.uint64)))]), "duplicate"),
    (_payload([_tensor(index=encode_varints(np.array([3, 97], dtype=np.uint64)))]), "out of range"),
    # "unsorted": a gap that wraps the int64 running sum round to a smaller position
    (_payload([_tensor(index=encode_varints(np.array([50, 2**63 - 40], dtype=np.uint64)))]), "out of range"),
    (_payload([_tensor(index=bytes([0x01] + [0xFF] * 9 + [0x01]))]), "overflow"),
    (_payload([_tensor(coding=RICE, index=bytes([0, 0b1100_0000]))]), "duplicate"),
    # BITMAP: no index_len, the bitmap is ceil(numel / 8) = 13 bytes
    (_payload([_tensor(coding=BITMAP, index=bytes(12) + bytes([0x08]))]), "padding bit set"),
    (_payload([_tensor(coding=BITMAP, index=bytes([0x10]) + bytes(12))]), "popcount 1 != k 2"),
    (_payload([_tensor(coding=BITMAP, index=bytes(12), values=b"")]), "index: truncated"),
    # an index_len sent anyway for a BITMAP is read as the bitmap's first byte
    (_payload([bytes([BITMAP << 4 | 8]) + varint(2) + f32(0.5) + varint(13) + bytes([0x11]) + bytes(12) + bytes(2)]), "popcount 5 != k 2"),  # 13 = 0b1101, 0x11
    # SINGLE: form, position varint, f32 value; nothing else
    (_payload([_single(width=8)]), "SINGLE record needs width 15"),
    (_payload([_single(width=2)]), "SINGLE record needs width 15"),
    (_payload([_single(position=varint(100))]), "position 100 out of range"),
    (_payload([_single(position=varint(2**62))]), "out of range"),
    (_payload([_single(position=bytes([0x87, 0x00]))]), "position: non-canonical"),
    (_payload([_single(position=bytes([0xFF] * 10))]), "position: varint overflow"),
    (_payload([_single()])[:15], "position: truncated"),
    (_payload([_single(value=f32(float("nan")))]), "NaN or Inf"),
    (_payload([_single(value=f32(float("-inf")))]), "NaN or Inf"),
    (_payload([_single(value=b"\x00\x00")]), "values: truncated"),
    (_payload([_single() + f32(0.5)]), "4 trailing bytes"),
    (_payload([_single(), _single()], n=1), "trailing bytes"),
    (_payload([_tensor()])[:-1], "values: truncated"),
    (_payload([_single()])[:-1], "values: truncated"),
    (_payload([_tensor()]) + b"\x00", "1 trailing bytes"),
    (_payload([_tensor()])[:14], "form: truncated"),
]


@pytest.mark.parametrize(("data", "message"), BAD)
def test_crafted_bad_payloads_raise_payload_error_naming_the_field(data: bytes, message: str) -> None:
    with pytest.raises(PayloadError, match=message):
        decode(data, SMALL)


BAD_LAYOUTS = [
    # SINGLE for a 1-element tensor (it is always DENSE); ids implied because both tensors are present
    (_payload([_single(position=varint(0)), _single()], layout=TINY), TINY, r"tensor 0 \(one\): SINGLE record for a tensor of 1"),
    # subsets: ids present, ascending, in range
    (_payload([_single(tid=2)], layout=PAIR), PAIR, r"id 2: not ascending after -1 or not < 2"),
    (_payload([_single(tid=0), _single(tid=0)], n=1, layout=PAIR), PAIR, "trailing bytes"),
    (_payload([_single(tid=1)], n=1, layout=PAIR)[:-7], PAIR, r"tensor #0 id: truncated"),
    # with every tensor present there are no ids: a stray id byte is read as the form
    (_payload([_single(tid=0), _single(tid=1)], layout=PAIR), PAIR, r"tensor 0 \(a\): form 0x00.*width 0"),
    (_payload([_single(position=varint(60)) for _ in range(2)], layout=PAIR), PAIR, r"tensor 1 \(b\): position 60 out of range"),
]


@pytest.mark.parametrize(("data", "layout", "message"), BAD_LAYOUTS)
def test_crafted_bad_records_per_layout(data: bytes, layout: Layout, message: str) -> None:
    with pytest.raises(PayloadError, match=message):
        decode(data, layout)


def test_payload_error_is_a_value_error_and_names_the_tensor() -> None:
    with pytest.raises(ValueError, match=r"tensor 0 \(w\): scale"):
        decode(_payload([_tensor(scale=f32(float("nan")))]), SMALL)


def test_size_bound_and_input_type() -> None:
    data = _payload([_tensor()])
    decode(data, SMALL, max_bytes=len(data))
    with pytest.raises(PayloadError, match="over the limit"):
        decode(data, SMALL, max_bytes=len(data) - 1)
    with pytest.raises(PayloadError, match="must be bytes"):
        decode("LPDC", SMALL)  # type: ignore[arg-type]
    assert decode(bytearray(data), SMALL).indices.tolist() == [3, 7]


def _valid_payloads() -> list[bytes]:
    flat = _flat(LAYOUT, seed=3)
    full = [encode(flat, LAYOUT, CodecConfig(compression=c, bits=b))[0] for c, b in [(0.0, 8), (0.5, 4), (0.9, 8), (0.99, 2), (0.9, 32), (0.99, 32)]]
    # a subset (ids present): norm as SINGLE, fc in VARINT (2 entries), bias in BITMAP with raw f32 values
    subset = _payload(
        [_single(tid=1), _tensor(tid=3), _tensor(tid=4, coding=BITMAP, width=F32_WIDTH, index=bytes([0x44, 0x00]), values=f32(1.0) * 2)],
        layout=LAYOUT,
    )
    return full + [subset]


VALID = _valid_payloads()


def _check_decodes_or_refuses(data: bytes, layout: Layout = LAYOUT) -> None:
    try:
        decoded = decode(data, layout)
    except PayloadError:
        return
    assert torch.isfinite(decoded.values).all()
    if decoded.indices is not None:
        assert decoded.indices.numel() == decoded.values.numel()
        assert torch.all(decoded.indices[1:] > decoded.indices[:-1])
        assert decoded.indices.numel() == 0 or (0 <= int(decoded.indices[0]) and int(decoded.indices[-1]) < layout.numel)
    else:
        assert decoded.values.numel() == layout.numel


def test_every_truncation_is_refused() -> None:
    for data in VALID:
        for cut in range(len(data)):
            with pytest.raises(PayloadError):
                decode(data[:cut], LAYOUT)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_random_mutations_decode_or_raise_payload_error(data: st.DataObject) -> None:
    payload = bytearray(data.draw(st.sampled_from(VALID)))
    for _ in range(data.draw(st.integers(1, 4))):
        kind = data.draw(st.sampled_from(["flip", "set", "insert", "delete"]))
        pos = data.draw(st.integers(0, len(payload) - 1)) if payload else 0
        if kind == "flip" and payload:
            payload[pos] ^= 1 << data.draw(st.integers(0, 7))
        elif kind == "set" and payload:
            payload[pos] = data.draw(st.integers(0, 255))
        elif kind == "insert":
            payload[pos:pos] = data.draw(st.binary(min_size=1, max_size=8))
        elif payload:
            del payload[pos : pos + data.draw(st.integers(1, 8))]
    _check_decodes_or_refuses(bytes(payload))


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300), st.booleans())
def test_random_bytes_raise_payload_error(blob: bytes, with_header: bool) -> None:
    data = (b"LPDC" + V2 + LAYOUT.digest() + blob) if with_header else blob
    _check_decodes_or_refuses(data)


@settings(max_examples=300, deadline=None)
@given(
    n=st.sampled_from([1, 2]),
    forms=st.lists(st.sampled_from([SINGLE << 4 | F32_WIDTH, SINGLE << 4 | 8, VARINT << 4 | 8, RICE << 4 | 2,
                                    BITMAP << 4 | F32_WIDTH, DENSE << 4 | 8, DENSE << 4 | F32_WIDTH]) | st.integers(0, 255),
                   min_size=1, max_size=2),
    bodies=st.lists(st.binary(max_size=24), min_size=2, max_size=2),
    ids=st.booleans(),
)
def test_random_records_decode_or_raise_payload_error(n: int, forms: list[int], bodies: list[bytes], ids: bool) -> None:
    """Hand-shaped records (plausible form byte, random rest) on a two-tensor layout, with and without ids."""
    records = [(varint(j) if ids else b"") + bytes([form]) + body for j, (form, body) in enumerate(zip(forms, bodies))]
    _check_decodes_or_refuses(_payload(records, n=n, layout=PAIR), PAIR)
    single = bytes([SINGLE << 4 | F32_WIDTH]) + bodies[0]  # SINGLE with a random position and value
    _check_decodes_or_refuses(_payload([single], layout=SMALL), SMALL)
