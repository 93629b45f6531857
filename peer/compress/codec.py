"""The payload codec: a flat fp32 vector <-> self-describing bytes (layer-wise top-k, k-bit values, coded indices).

What the gossip algorithms see (docs/method.md#gossip-algorithms, docs/method.md#communication-compression):
`encode(flat, layout, cfg)` returns the bytes to send AND the `Decoded` update the receiver will reconstruct from them,
bit for bit (both ends run the same dequantisation and assembly code). The sender subtracts exactly that `Decoded`; the
receiver adds `decode(bytes, layout)`. Nothing the codec loses can then create or destroy push-sum mass. Error feedback
lives in gossip/, not here.

Wire format, version 2 (all integers unsigned; varint = LEB128, minimal length; f32 = IEEE-754 single, little
endian; sizes in bytes unless said otherwise; S = number of segments in the layout, numel = the segment's size):

    payload   := header tensor{n_tensors}                 -- nothing may follow the last tensor
    header    := magic      4 bytes  b"LPDC"
                 version    u8       2
                 layout     8 bytes  Layout.digest() of the sender's model; must equal the receiver's
                 n_tensors  varint   0 .. S
    tensor    := id         varint   ONLY when n_tensors < S: segment index, strictly ascending within a payload.
                                     When n_tensors == S every segment is present in layout order, so the ids are
                                     implied (0, 1, .., S-1) and not sent.
                 form       u8       coding << 4 | width
                   coding   (high nibble)  0 DENSE: all numel entries, in order
                                           1 VARINT, 2 BITMAP, 3 RICE: positions of the kept entries (indexcode.py)
                                           4 SINGLE: exactly one kept entry, its value as a raw f32
                   width    (low nibble)   2..8: values quantised to signed width-bit integers with one scale
                                           15 (F32): raw f32 values, no scale (CodecConfig.bits == 32)
                                           (SINGLE: always 15)
                 k          varint   VARINT, BITMAP, RICE only: kept entries, 1 .. numel-1
                                     (implied: numel for DENSE, 1 for SINGLE)
                 scale      f32      width 2..8 only: value per integer step, finite, +0.0 or positive, and
                                     Q * scale finite in f32 (so every decoded value is finite)
                 index_len  varint   VARINT, RICE only: length of the index bytes
                 index      VARINT, RICE: index_len bytes; BITMAP: ceil(numel / 8) bytes;
                            SINGLE: the position as one varint, < numel; DENSE: nothing
                 values     width 2..8: ceil(k * width / 8) bytes of unsigned codes u = q + Q, Q = 2**(width-1) - 1,
                                        u in [0, 2Q], MSB first, zero padded; decoded value = (u - Q) * scale in f32
                            width 15:   4 * k bytes, f32 each, finite
Per-tensor overhead: 7 bytes for a typical small sparse int8 tensor (form 1, k 1, scale 4, index_len 1; version 1
had 9), 5 for a dense int8 tensor, 1 for a dense raw f32 one; a SINGLE record is 6 bytes in all for a tensor of
up to 128 entries (form 1, position 1, value 4), where version 1 took 11 (9 + 1 index byte + 1 code byte).

SINGLE is what the encoder sends for every sparse tensor that keeps one entry (at 1% density: every tensor of
2..199 entries, e.g. ResNet-20's 57 per-channel norm vectors). Its value is the f32 the receiver would have computed from a quantised record, (u - Q) * scale at
the configured width, or the raw value at bits = 32: the Decoded is the same as with the general record, in 6 bytes
instead of 9 + index + value. The encoder uses the general codings only for k >= 2 (the choice between VARINT,
BITMAP and RICE is indexcode's: the smallest). The decoder accepts any valid coding for any k, and a subset of the
segments (ascending ids), so a future sender may skip unchanged tensors without a format change.

A payload may travel in a deflate envelope instead (magic b"LPDZ", peer/compress/deflate.py): a zlib stream of the
payload above, sent when ``CodecConfig.deflate`` asks and it is smaller; `decode` inflates it (bounded by
`max_payload_bytes`) and decodes the payload inside, which must be an LPDC one. The Decoded is the same.

Version 1 (explicit id, separate coding and bits bytes, k, scale and index_len always present, no SINGLE) is
refused with a PayloadError that names both versions: peers of one fleet must run the same format.
`decode` checks every field and raises `PayloadError` (a ValueError) naming the field and tensor; it never raises
anything else on bad bytes and never mutates state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from . import quant
from .bitpack import packed_len
from .deflate import deflate, inflate, is_deflated
from .errors import PayloadError
from .indexcode import RICE, VARINT, decode_positions, encode_positions
from .layout import DIGEST_BYTES, Layout, Segment
from .topk import layerwise_topk
from .wire import Reader, f32, varint

__all__ = ["FORMAT_VERSION", "MAGIC", "CodecConfig", "Decoded", "PayloadError", "decode", "encode"]

MAGIC = b"LPDC"
FORMAT_VERSION = 2
# Codings (high nibble of `form`): DENSE, indexcode's VARINT / BITMAP / RICE, and SINGLE.
DENSE = 0
SINGLE = 4
# Width (low nibble of `form`) of raw f32 values, i.e. CodecConfig.bits == RAW_BITS.
F32_WIDTH = 15
RAW_BITS = 32
_LENGTH_PREFIXED = (VARINT, RICE)  # index codings whose byte length is sent as index_len


@dataclass(frozen=True)
class CodecConfig:
    """How to compress one update.

    compression: c in [0, 1), the fraction of each tensor's entries dropped (0 => dense, 0.99 keeps 1%).
    bits: 2..8 for quantised values (one fp32 scale per tensor), or 32 for raw fp32 values.
    rounding: "nearest" (deterministic, error <= half a step) or "stochastic" (unbiased in expectation).
    deflate: entropy-code the payload with zlib when that is smaller (peer/compress/deflate.py: dense 8-bit
        consensus-phase messages to 0.68x in the simulator, 0.79x in the README fleet; a 1% sparse one barely;
        about 1 ms per 100 kB to compress, 0.5 ms to inflate).
    step_floor: the smallest value per integer step, relative to each tensor's RMS in the ``reference`` model
        handed to `encode` (0: none; no reference, no floor). A difference much smaller than the model it
        corrects is then sent on that coarser grid - with nearest rounding at most half a step per entry, so a
        dense message's replica stays within step_floor / 2 of the model's norm - mostly as the value 0, which
        deflate shrinks (Choco's consensus phase: a warm edge's replica gap and the later rounds' moves are a few
        percent of the model; docs/decisions/consensus-phase.md). Only the sender reads it: the scale travels as
        before.
    """

    compression: float = 0.0
    bits: int = 8
    rounding: str = "nearest"
    deflate: bool = False
    step_floor: float = 0.0

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
        if not isinstance(self.deflate, bool):
            raise ValueError(f"CodecConfig.deflate must be a bool, got {self.deflate!r}")
        f = self.step_floor
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not (math.isfinite(f) and 0.0 <= f <= 1.0):
            raise ValueError(f"CodecConfig.step_floor must be a number in [0, 1], got {f!r}")


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


def _form(coding: int, bits: int) -> bytes:
    """The `form` byte: coding in the high nibble, value width in the low one."""
    return bytes([coding << 4 | (F32_WIDTH if bits == RAW_BITS else bits)])


def _values(
    values: torch.Tensor, cfg: CodecConfig, generator: torch.Generator | None, where: str, min_scale: float
) -> tuple[float, bytes, torch.Tensor]:
    """(scale, value bytes, decoded fp32 values) of one tensor's kept values; scale is 1.0 for raw f32."""
    if cfg.bits == RAW_BITS:
        if not bool(torch.isfinite(values).all()):
            raise ValueError(f"encode: {where} has NaN or Inf values")
        return 1.0, values.numpy().astype("<f4").tobytes(), values.clone()
    try:
        codes, scale = quant.quantize(values, cfg.bits, cfg.rounding, generator, min_scale)
    except ValueError as e:
        raise ValueError(f"encode: {where}: {e}") from None
    return scale, quant.pack_codes(codes, cfg.bits), quant.dequantize(codes, cfg.bits, scale)


def _min_scales(reference: torch.Tensor | None, layout: Layout, cfg: CodecConfig) -> list[float]:
    """Each segment's smallest quantisation step: ``cfg.step_floor`` times the segment's RMS in ``reference``
    (all 0 without a floor or a reference, or at raw f32)."""
    if reference is None or cfg.step_floor == 0.0 or cfg.bits == RAW_BITS:
        return [0.0] * len(layout.segments)
    if reference.shape != (layout.numel,):
        raise ValueError(f"encode: the reference must have {layout.numel} elements, got {tuple(reference.shape)}")
    ref = reference.detach().cpu().numpy()
    scales = []
    for seg in layout.segments:
        part = ref[seg.offset : seg.offset + seg.numel]
        rms = float(np.sqrt(np.dot(part, part) / max(seg.numel, 1)))
        scales.append(cfg.step_floor * rms if math.isfinite(rms) else 0.0)
    return scales


def encode(
    flat: torch.Tensor, layout: Layout, cfg: CodecConfig, generator: torch.Generator | None = None,
    reference: torch.Tensor | None = None,
) -> tuple[bytes, Decoded]:
    """Compress `flat` (1-D fp32, layout.numel elements) into payload bytes and the exact Decoded they carry.

    Every segment is sent, in layout order (so tensor ids are implied); in a deflate envelope when `cfg.deflate`
    and that is smaller. `generator` drives stochastic rounding
    (None: torch's default generator); `reference` is the model `cfg.step_floor` is relative to (Choco's sender:
    its model, of which `flat` is the difference to a replica). Raises ValueError on a bad config, a flat vector
    or reference that does not match the layout, or NaN/Inf among the values to send.
    """
    cfg.validate()
    if flat.dim() != 1 or flat.dtype != torch.float32 or flat.numel() != layout.numel:
        raise ValueError(
            f"encode: need a 1-D float32 tensor of {layout.numel} elements, got {flat.dtype} {tuple(flat.shape)}"
        )
    min_scales = _min_scales(reference, layout, cfg)
    flat = flat.detach().cpu().contiguous()
    flat_np = flat.numpy()  # gathers go through numpy: torch advanced indexing was ~70x slower here
    kept = layerwise_topk(flat, layout, cfg.compression)
    chunks = [MAGIC, bytes([FORMAT_VERSION]), layout.digest(), varint(len(layout.segments))]
    parts: list[_Part] = []
    for tensor_id, (seg, positions) in enumerate(zip(layout.segments, kept)):
        seg_flat = flat_np[seg.offset : seg.offset + seg.numel]
        values = torch.from_numpy(seg_flat if positions is None else seg_flat[positions])
        scale, value_bytes, decoded = _values(values, cfg, generator, f"tensor {tensor_id} ({seg.name})",
                                              min_scales[tensor_id])
        if positions is not None and positions.size == 1:
            # The value travels as the f32 the receiver would have dequantised: same Decoded, no scale or codes.
            chunks += [_form(SINGLE, RAW_BITS), varint(int(positions[0])), decoded.numpy().astype("<f4").tobytes()]
        else:
            coding, index = (DENSE, b"") if positions is None else encode_positions(positions, seg.numel)
            chunks.append(_form(coding, cfg.bits))
            if positions is not None and coding != DENSE:
                chunks.append(varint(positions.size))
            if cfg.bits != RAW_BITS:
                chunks.append(f32(scale))
            if coding in _LENGTH_PREFIXED:
                chunks.append(varint(len(index)))
            chunks += [index, value_bytes]
        parts.append((seg, positions, decoded))
    payload = b"".join(chunks)
    return deflate(payload) if cfg.deflate else payload, _assemble(layout, parts)


def _decode_values(reader: Reader, count: int, width: int, scale: float) -> torch.Tensor:
    """`count` values at `width` (2..8 with `scale`, or F32_WIDTH) as fp32; the same arithmetic as the encoder."""
    if width == F32_WIDTH:
        raw = np.frombuffer(reader.take(4 * count, "values"), dtype="<f4")
        if not np.isfinite(raw).all():
            raise PayloadError("values: NaN or Inf among raw f32 values")
        return torch.from_numpy(raw.astype(np.float32))
    codes = quant.unpack_codes(reader.take(quant.codes_len(count, width), "values"), count, width)
    return quant.dequantize(codes, width, scale)


def _decode_tensor(reader: Reader, seg: Segment) -> tuple[np.ndarray | None, torch.Tensor]:
    """Parse one tensor record after its id; returns (local positions or None if dense, fp32 values)."""
    form = reader.u8("form")
    coding, width = form >> 4, form & 0x0F
    if coding > SINGLE:
        raise PayloadError(f"form 0x{form:02x}: unknown coding {coding}")
    if not (quant.MIN_BITS <= width <= quant.MAX_BITS or width == F32_WIDTH):
        raise PayloadError(f"form 0x{form:02x}: width {width} not in {quant.MIN_BITS}..{quant.MAX_BITS} or {F32_WIDTH}")
    if coding == SINGLE:
        if width != F32_WIDTH:
            raise PayloadError(f"form 0x{form:02x}: a SINGLE record needs width {F32_WIDTH} (f32), got {width}")
        if seg.numel < 2:
            raise PayloadError(f"SINGLE record for a tensor of {seg.numel} elements (needs >= 2; use DENSE)")
        position = reader.varint("position")
        if position >= seg.numel:
            raise PayloadError(f"position {position} out of range (>= numel {seg.numel})")
        return np.array([position], dtype=np.int64), _decode_values(reader, 1, F32_WIDTH, 1.0)
    k = seg.numel if coding == DENSE else reader.varint("k")
    if coding != DENSE and not 1 <= k < seg.numel:
        raise PayloadError(f"k {k} not in 1..{seg.numel - 1} for a sparse tensor of {seg.numel} elements")
    scale = 1.0
    if width != F32_WIDTH:
        scale = reader.f32("scale")
        if not math.isfinite(scale) or math.copysign(1.0, scale) < 0:
            raise PayloadError(f"scale {scale!r} is not finite and non-negative")
        if not quant.scale_fits(scale, width):
            raise PayloadError(f"scale {scale!r} overflows f32 at width {width} (Q * scale is Inf)")
    positions = None
    if coding != DENSE:
        index_len = reader.varint("index_len") if coding in _LENGTH_PREFIXED else packed_len(seg.numel, 1)
        positions = decode_positions(coding, reader.take(index_len, "index"), k, seg.numel)
    return positions, _decode_values(reader, k, width, scale)


#: Bytes a tensor record may take beyond its values and positions: form, k, scale, index_len (varints <= 10 bytes).
_RECORD_OVERHEAD = 32
#: Most bytes one kept entry may take: a 5-byte varint position plus a raw f32 value.
_ENTRY_MAX_BYTES = 9


def max_payload_bytes(layout: Layout) -> int:
    """An upper bound on the size of ANY valid payload for ``layout`` (every tensor dense raw f32, or every entry
    with the widest position coding): what a receiver may buffer for one update, derived from the model alone."""
    return len(MAGIC) + 1 + DIGEST_BYTES + 10 + sum(_RECORD_OVERHEAD + _ENTRY_MAX_BYTES * seg.numel
                                                    for seg in layout.segments)


def decode(data: bytes | bytearray | memoryview, layout: Layout, max_bytes: int | None = None) -> Decoded:
    """Validate and decode a payload for `layout`; PayloadError (a ValueError) naming the field on any problem.

    `max_bytes` (optional) refuses payloads larger than that many bytes before parsing anything (a deflate
    envelope by its own size, and what it inflates to by `max_bytes` and `max_payload_bytes` both).
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise PayloadError(f"payload must be bytes, got {type(data).__name__}")
    size = memoryview(data).nbytes
    if max_bytes is not None and size > max_bytes:
        raise PayloadError(f"payload is {size} bytes, over the limit of {max_bytes}")
    if is_deflated(data):
        bound = max_payload_bytes(layout)
        data = inflate(data, bound if max_bytes is None else min(bound, max_bytes))
    reader = Reader(data)
    if bytes(reader.take(len(MAGIC), "magic")) != MAGIC:
        raise PayloadError("magic: not an LPDC payload")
    version = reader.u8("version")
    if version != FORMAT_VERSION:
        raise PayloadError(f"version: format version {version} not supported (this peer reads {FORMAT_VERSION})")
    if bytes(reader.take(DIGEST_BYTES, "layout digest")) != layout.digest():
        raise PayloadError("layout digest: payload is for another model")
    n_segments = len(layout.segments)
    n_tensors = reader.varint("n_tensors")
    if n_tensors > n_segments:
        raise PayloadError(f"n_tensors {n_tensors} > {n_segments} tensors in the layout")
    ids_implied = n_tensors == n_segments
    parts: list[_Part] = []
    previous_id = -1
    for j in range(n_tensors):
        tensor_id = j if ids_implied else reader.varint(f"tensor #{j} id")
        if not previous_id < tensor_id < n_segments:
            raise PayloadError(f"tensor #{j} id {tensor_id}: not ascending after {previous_id} or not < {n_segments}")
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
