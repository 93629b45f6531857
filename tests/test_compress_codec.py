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
from peer.compress.indexcode import RICE, VARINT, encode_varints
from peer.compress.quant import dequantize, qmax, quantize
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


def test_wire_header_layout() -> None:
    data, _ = encode(torch.arange(100, dtype=torch.float32), SMALL, CodecConfig(compression=0.9))
    assert data[:4] == b"LPDC" and data[4] == 1 and data[5:13] == SMALL.digest()
    assert data[13] == 1  # one tensor
    assert data[14] == 0  # tensor id 0
    scale = struct.unpack("<f", data[18:22])[0]
    assert scale == pytest.approx(99 / 127)


# ---- refusal of bad payloads -----------------------------------------------------------------------------------

def _payload(tensors: list[bytes], n: int | None = None, layout: Layout = SMALL, head: bytes | None = None) -> bytes:
    head = head if head is not None else b"LPDC" + bytes([1]) + layout.digest()
    return head + varint(len(tensors) if n is None else n) + b"".join(tensors)


def _tensor(
    tid: int = 0, coding: int = VARINT, bits: int = 8, k: int = 2, scale: bytes = f32(0.5),
    index: bytes = encode_varints(np.array([3, 4], dtype=np.uint64)), values: bytes = bytes([127, 130]),
) -> bytes:
    return varint(tid) + bytes([coding, bits]) + varint(k) + scale + varint(len(index)) + index + values


def test_crafted_valid_payload_decodes() -> None:
    decoded = decode(_payload([_tensor()]), SMALL)
    assert decoded.indices.tolist() == [3, 7]
    assert decoded.values.tolist() == [0.0, 1.5]


BAD = [
    (b"XXXX" + _payload([_tensor()])[4:], "magic"),
    (b"LPDC" + bytes([2]) + _payload([_tensor()])[5:], "version 2"),
    (_payload([_tensor()], layout=LAYOUT), "payload is for another model"),
    (_payload([_tensor()], n=2), r"n_tensors 2 > 1"),
    (_payload([_tensor(), _tensor()], n=1), "trailing bytes"),
    (_payload([_tensor(tid=1)]), "id 1"),
    (_payload([_tensor(coding=7)]), "unknown index coding 7"),
    (_payload([_tensor(bits=9)]), "bits 9"),
    (_payload([_tensor(bits=1)]), "bits 1"),
    (_payload([_tensor(k=0, index=b"", values=b"")]), "k 0"),
    (_payload([_tensor(k=100)]), "k 100"),
    (_payload([_tensor(coding=0, k=100, index=b"")]), "w.*values: truncated"),
    (_payload([_tensor(coding=0)]), "k 2 != numel 100"),
    (_payload([_tensor(scale=f32(float("nan")))]), "scale nan"),
    (_payload([_tensor(scale=f32(float("inf")))]), "scale inf"),
    (_payload([_tensor(scale=f32(-1.0))]), "scale -1.0"),
    (_payload([_tensor(scale=f32(-0.0))]), "scale -0.0"),
    (_payload([_tensor(bits=32, values=f32(1.0) + f32(2.0))]), "must be 1.0"),
    (_payload([_tensor(bits=32, scale=f32(1.0), values=f32(1.0) + f32(float("inf")))]), "NaN or Inf"),
    (_payload([_tensor(values=bytes([255, 0]))]), "value code 255"),
    (_payload([_tensor(index=encode_varints(np.array([3, 0], dtype=np.uint64)))]), "duplicate"),
    (_payload([_tensor(index=encode_varints(np.array([3, 97], dtype=np.uint64)))]), "out of range"),
    # "unsorted": a gap that wraps the int64 running sum round to a smaller position
    (_payload([_tensor(index=encode_varints(np.array([50, 2**63 - 40], dtype=np.uint64)))]), "out of range"),
    (_payload([_tensor(index=bytes([0x01] + [0xFF] * 9 + [0x01]))]), "overflow"),
    (_payload([_tensor(coding=RICE, index=bytes([0, 0b1100_0000]))]), "duplicate"),
    (_payload([_tensor()])[:-1], "values: truncated"),
    (_payload([_tensor()]) + b"\x00", "1 trailing bytes"),
]


@pytest.mark.parametrize(("data", "message"), BAD)
def test_crafted_bad_payloads_raise_payload_error_naming_the_field(data: bytes, message: str) -> None:
    with pytest.raises(PayloadError, match=message):
        decode(data, SMALL)


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
    return [encode(flat, LAYOUT, CodecConfig(compression=c, bits=b))[0] for c, b in [(0.0, 8), (0.5, 4), (0.9, 8), (0.99, 2), (0.9, 32)]]


VALID = _valid_payloads()


def _check_decodes_or_refuses(data: bytes) -> None:
    try:
        decoded = decode(data, LAYOUT)
    except PayloadError:
        return
    assert torch.isfinite(decoded.values).all()
    if decoded.indices is not None:
        assert decoded.indices.numel() == decoded.values.numel()
        assert torch.all(decoded.indices[1:] > decoded.indices[:-1])
        assert decoded.indices.numel() == 0 or (0 <= int(decoded.indices[0]) and int(decoded.indices[-1]) < LAYOUT.numel)
    else:
        assert decoded.values.numel() == LAYOUT.numel


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
    data = (b"LPDC" + bytes([1]) + LAYOUT.digest() + blob) if with_header else blob
    _check_decodes_or_refuses(data)
