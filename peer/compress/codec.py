"""The payload codec: a flat fp32 vector <-> self-describing bytes (layer-wise top-k, k-bit values, coded indices).

What the gossip algorithms see (METHOD.md sections 3-4): `encode(flat, layout, cfg)` returns the bytes to send AND
the `Decoded` update the receiver will reconstruct from them, bit for bit (both ends run the same dequantisation
and assembly code). The sender subtracts exactly that `Decoded`; the receiver adds `decode(bytes, layout)`. Nothing
the codec loses can then create or destroy push-sum mass. Error feedback lives in gossip/, not here.

Wire format, version 1 (all integers unsigned; varint = LEB128, minimal length; f32 = IEEE-754 single, little
endian; sizes in bytes unless said otherwise):

    payload   := header tensor{n_tensors}                 -- nothing may follow the last tensor
    header    := magic      4 bytes  b"LPDC"
                 version    u8       1
                 layout     8 bytes  Layout.digest() of the sender's model; must equal the receiver's
                 n_tensors  varint   0 .. number of segments in the layout
    tensor    := id         varint   segment index in the layout; strictly ascending within a payload
                 coding     u8       0 DENSE: all numel entries, in order, no index bytes
                                     1 VARINT, 2 BITMAP, 3 RICE: positions of the kept entries (indexcode.py)
                 bits       u8       2..8: values quantised to signed bits-bit integers; 32: raw f32 values
                 k          varint   kept entries: == numel for DENSE, 1 .. numel-1 otherwise
                 scale      f32      value per integer step: finite, +0.0 or positive; exactly 1.0 when bits = 32
                 index_len  varint   length of the index bytes (0 for DENSE)
                 index      index_len bytes
                 values     bits 2..8: ceil(k * bits / 8) bytes of unsigned codes u = q + Q, Q = 2**(bits-1) - 1,
                                       u in [0, 2Q], MSB first, zero padded; decoded value = (u - Q) * scale in f32
                            bits 32:   4 * k bytes, f32 each, finite
Per-tensor overhead is 9 bytes for a typical small tensor (id 1, coding 1, bits 1, k 1, scale 4, index_len 1).

The encoder sends every segment, in layout order. The decoder also accepts a subset (ascending ids), so a future
sender may skip unchanged tensors without a format change. `decode` checks every field and raises `PayloadError`
(a ValueError) naming the field and tensor; it never raises anything else on bad bytes and never mutates state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from . import quant
from .errors import PayloadError
from .indexcode import decode_positions, encode_positions
from .layout import DIGEST_BYTES, Layout, Segment
from .topk import layerwise_topk
from .wire import Reader, f32, varint

__all__ = ["CodecConfig", "Decoded", "PayloadError", "encode", "decode", "MAGIC", "FORMAT_VERSION"]

MAGIC = b"LPDC"
FORMAT_VERSION = 1
DENSE = 0
RAW_BITS = 32


@dataclass(frozen=True)
class CodecConfig:
    """How to compress one update.

    compression: c in [0, 1), the fraction of each tensor's entries dropped (0 => dense, 0.99 keeps 1%).
    bits: 2..8 for quantised values (one fp32 scale per tensor), or 32 for raw fp32 values.
    rounding: "nearest" (deterministic, error <= half a step) or "stochastic" (unbiased in expectation).
    """

    compression: float = 0.0
    bits: int = 8
    rounding: str = "nearest"

    def validate(self) -> None:
        """Raise ValueError naming the bad field."""
        c = self.compression
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not (0.0 <= c < 1.0):
            raise ValueError(f"CodecConfig.compression must be a number in [0, 1), got {c!r}")
        b = self.bits
        if isinstance(b, bool) or not isinstance(b, int) or not (quant.MIN_BITS <= b <= quant.MAX_BITS or b == RAW_BITS):
            raise ValueError(
                f"CodecConfig.bits must be an int in {quant.MIN_BITS}..{quant.MAX_BITS} or {RAW_BITS}, got {b!r}"
            )
        if self.rounding not in quant.ROUNDINGS:
            raise ValueError(f"CodecConfig.rounding must be one of {quant.ROUNDINGS}, got {self.rounding!r}")


@dataclass(eq=False)
class Decoded:
    """A decoded update: `values` (fp32) at `indices` (int64, ascending) of the flat vector, or dense if None."""

    indices: torch.Tensor | None
    values: torch.Tensor

    def add_into(self, flat: torch.Tensor, alpha: float) -> None:
        """flat += alpha * update, in place (push-sum mass transfer; alpha < 0 on the sender)."""
        if self.indices is None:
            flat.add_(self.values, alpha=alpha)
        else:
            flat.index_add_(0, self.indices, self.values, alpha=alpha)

    def to_dense(self, numel: int) -> torch.Tensor:
        """The update as a new dense fp32 vector of `numel` elements (zeros where nothing was kept)."""
        out = torch.zeros(numel, dtype=torch.float32)
        if self.indices is None:
            out.copy_(self.values)
        else:
            out[self.indices] = self.values
        return out


_Part = tuple[Segment, "np.ndarray | None", torch.Tensor]


def _assemble(layout: Layout, parts: list[_Part]) -> Decoded:
    """Concatenate per-tensor (positions, values) into one Decoded; shared by encode and decode (bit-identity)."""
    values = torch.cat([v for _, _, v in parts]) if parts else torch.zeros(0, dtype=torch.float32)
    if len(parts) == len(layout.segments) and all(p is None for _, p, _ in parts):
        return Decoded(indices=None, values=values)
    index_parts = [
        torch.arange(seg.offset, seg.offset + seg.numel, dtype=torch.int64)
        if positions is None
        else torch.from_numpy(positions + seg.offset)
        for seg, positions, _ in parts
    ]
    indices = torch.cat(index_parts) if index_parts else torch.zeros(0, dtype=torch.int64)
    return Decoded(indices=indices, values=values)


def encode(
    flat: torch.Tensor, layout: Layout, cfg: CodecConfig, generator: torch.Generator | None = None
) -> tuple[bytes, Decoded]:
    """Compress `flat` (1-D fp32, layout.numel elements) into payload bytes and the exact Decoded they carry.

    `generator` drives stochastic rounding (None: torch's default generator). Raises ValueError on a bad config,
    a flat vector that does not match the layout, or NaN/Inf among the values to send.
    """
    cfg.validate()
    if flat.dim() != 1 or flat.dtype != torch.float32 or flat.numel() != layout.numel:
        raise ValueError(
            f"encode: need a 1-D float32 tensor of {layout.numel} elements, got {flat.dtype} {tuple(flat.shape)}"
        )
    flat = flat.detach().cpu().contiguous()
    flat_np = flat.numpy()  # gathers go through numpy: torch advanced indexing was ~70x slower here
    kept = layerwise_topk(flat, layout, cfg.compression)
    chunks = [MAGIC, bytes([FORMAT_VERSION]), layout.digest(), varint(len(layout.segments))]
    parts: list[_Part] = []
    for tensor_id, (seg, positions) in enumerate(zip(layout.segments, kept)):
        seg_flat = flat_np[seg.offset : seg.offset + seg.numel]
        if positions is None:
            coding, index, values = DENSE, b"", torch.from_numpy(seg_flat)
        else:
            coding, index = encode_positions(positions, seg.numel)
            values = torch.from_numpy(seg_flat[positions])
        if cfg.bits == RAW_BITS:
            if not bool(torch.isfinite(values).all()):
                raise ValueError(f"encode: tensor {tensor_id} ({seg.name}) has NaN or Inf values")
            scale, value_bytes, decoded = 1.0, values.numpy().astype("<f4").tobytes(), values.clone()
        else:
            try:
                codes, scale = quant.quantize(values, cfg.bits, cfg.rounding, generator)
            except ValueError as e:
                raise ValueError(f"encode: tensor {tensor_id} ({seg.name}): {e}") from None
            value_bytes, decoded = quant.pack_codes(codes, cfg.bits), quant.dequantize(codes, cfg.bits, scale)
        chunks += [varint(tensor_id), bytes([coding, cfg.bits]), varint(values.numel()), f32(scale)]
        chunks += [varint(len(index)), index, value_bytes]
        parts.append((seg, positions, decoded))
    return b"".join(chunks), _assemble(layout, parts)


def _decode_tensor(reader: Reader, seg: Segment) -> tuple["np.ndarray | None", torch.Tensor]:
    """Parse one tensor record after its id; returns (local positions or None if dense, fp32 values)."""
    coding = reader.u8("coding")
    bits = reader.u8("bits")
    if not (quant.MIN_BITS <= bits <= quant.MAX_BITS or bits == RAW_BITS):
        raise PayloadError(f"bits {bits} not in {quant.MIN_BITS}..{quant.MAX_BITS} or {RAW_BITS}")
    k = reader.varint("k")
    if coding == DENSE and k != seg.numel:
        raise PayloadError(f"k {k} != numel {seg.numel} for a dense tensor")
    if coding != DENSE and not 1 <= k < seg.numel:
        raise PayloadError(f"k {k} not in 1..{seg.numel - 1} for a sparse tensor of {seg.numel} elements")
    scale = reader.f32("scale")
    if not math.isfinite(scale) or math.copysign(1.0, scale) < 0:
        raise PayloadError(f"scale {scale!r} is not finite and non-negative")
    if bits == RAW_BITS and scale != 1.0:
        raise PayloadError(f"scale {scale!r} must be 1.0 for raw f32 values")
    index_len = reader.varint("index_len")
    if coding == DENSE and index_len != 0:
        raise PayloadError(f"index_len {index_len} must be 0 for a dense tensor")
    index = reader.take(index_len, "index")
    positions = None if coding == DENSE else decode_positions(coding, index, k, seg.numel)
    if bits == RAW_BITS:
        raw = np.frombuffer(reader.take(4 * k, "values"), dtype="<f4")
        if not np.isfinite(raw).all():
            raise PayloadError("values: NaN or Inf among raw f32 values")
        values = torch.from_numpy(raw.astype(np.float32))
    else:
        codes = quant.unpack_codes(reader.take(quant.codes_len(k, bits), "values"), k, bits)
        values = quant.dequantize(codes, bits, scale)
    return positions, values


def decode(data: bytes | bytearray | memoryview, layout: Layout, max_bytes: int | None = None) -> Decoded:
    """Validate and decode a payload for `layout`; PayloadError (a ValueError) naming the field on any problem.

    `max_bytes` (optional) refuses payloads larger than that many bytes before parsing anything.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise PayloadError(f"payload must be bytes, got {type(data).__name__}")
    size = memoryview(data).nbytes
    if max_bytes is not None and size > max_bytes:
        raise PayloadError(f"payload is {size} bytes, over the limit of {max_bytes}")
    reader = Reader(data)
    if bytes(reader.take(len(MAGIC), "magic")) != MAGIC:
        raise PayloadError("magic: not an LPDC payload")
    version = reader.u8("version")
    if version != FORMAT_VERSION:
        raise PayloadError(f"version: format version {version} not supported (this peer reads {FORMAT_VERSION})")
    if bytes(reader.take(DIGEST_BYTES, "layout digest")) != layout.digest():
        raise PayloadError("layout digest: payload is for another model")
    n_tensors = reader.varint("n_tensors")
    if n_tensors > len(layout.segments):
        raise PayloadError(f"n_tensors {n_tensors} > {len(layout.segments)} tensors in the layout")
    parts: list[_Part] = []
    previous_id = -1
    for j in range(n_tensors):
        tensor_id = reader.varint(f"tensor #{j} id")
        if not previous_id < tensor_id < len(layout.segments):
            raise PayloadError(
                f"tensor #{j} id {tensor_id}: not ascending after {previous_id} or not < {len(layout.segments)}"
            )
        previous_id = tensor_id
        seg = layout.segments[tensor_id]
        try:
            positions, values = _decode_tensor(reader, seg)
        except PayloadError as e:
            raise PayloadError(f"tensor {tensor_id} ({seg.name}): {e}") from None
        parts.append((seg, positions, values))
    if reader.remaining:
        raise PayloadError(f"{reader.remaining} trailing bytes after the last tensor")
    return _assemble(layout, parts)
