"""Where each parameter tensor lives inside the flat fp32 vector that gossip moves around.

The gossip algorithms work on one flat 1-D fp32 vector per model (numerator x_i, error e_i, replicas); the codec
works per parameter tensor (layer-wise top-k, one scale per tensor). A `Layout` is the map between the two:
an ordered tuple of `Segment`s, each a named tensor of a given shape occupying `numel` consecutive entries
starting at `offset` (units: elements of the flat vector, not bytes).

The 8-byte `digest` of names and shapes travels in every payload header, so a peer refuses a payload shaped
for another model instead of adding it into the wrong places.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

DIGEST_BYTES = 8
_DIGEST_DOMAIN = b"lpdl-layout-v1\x00"


@dataclass(frozen=True)
class Segment:
    """One parameter tensor: its name, shape, and the slice [offset, offset + numel) of the flat vector."""

    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int


@dataclass(frozen=True)
class Layout:
    """Ordered, contiguous segments covering the flat vector from 0 to `numel` (elements)."""

    segments: tuple[Segment, ...]

    def __post_init__(self) -> None:
        expected_offset = 0
        names: set[str] = set()
        for seg in self.segments:
            if seg.name in names:
                raise ValueError(f"layout: duplicate segment name {seg.name!r}")
            names.add(seg.name)
            if any(d < 0 for d in seg.shape):
                raise ValueError(f"layout: segment {seg.name!r} has a negative dimension {seg.shape}")
            if seg.numel != math.prod(seg.shape):
                raise ValueError(f"layout: segment {seg.name!r} numel {seg.numel} != prod{seg.shape}")
            if seg.offset != expected_offset:
                raise ValueError(f"layout: segment {seg.name!r} offset {seg.offset}, expected {expected_offset}")
            expected_offset += seg.numel

    @classmethod
    def from_named_shapes(cls, items: Iterable[tuple[str, tuple[int, ...]]]) -> Layout:
        """Lay the tensors out back to back in the order given."""
        segments = []
        offset = 0
        for name, shape in items:
            shape = tuple(int(d) for d in shape)
            numel = math.prod(shape)
            segments.append(Segment(name=name, shape=shape, offset=offset, numel=numel))
            offset += numel
        return cls(tuple(segments))

    @classmethod
    def from_module(cls, module: nn.Module) -> Layout:
        """Parameters only (buffers are not gossiped), in `named_parameters()` order."""
        return cls.from_named_shapes((name, tuple(p.shape)) for name, p in module.named_parameters())

    @property
    def numel(self) -> int:
        """Total number of elements of the flat vector."""
        return self.segments[-1].offset + self.segments[-1].numel if self.segments else 0

    def digest(self) -> bytes:
        """8-byte BLAKE2b of the names and shapes (order included): stable across runs, machines and versions."""
        h = hashlib.blake2b(_DIGEST_DOMAIN, digest_size=DIGEST_BYTES)
        for seg in self.segments:
            name = seg.name.encode("utf-8")
            h.update(struct.pack("<I", len(name)) + name + struct.pack(f"<I{len(seg.shape)}Q", len(seg.shape), *seg.shape))
        return h.digest()

    def flatten(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """Copy the tensors (one per segment, in order, matching shapes) into a new flat fp32 vector."""
        tensors = list(tensors)
        if len(tensors) != len(self.segments):
            raise ValueError(f"layout: got {len(tensors)} tensors for {len(self.segments)} segments")
        for seg, t in zip(self.segments, tensors):
            if tuple(t.shape) != seg.shape:
                raise ValueError(f"layout: tensor for {seg.name!r} has shape {tuple(t.shape)}, expected {seg.shape}")
        if not tensors:
            return torch.zeros(0, dtype=torch.float32)
        return torch.cat([t.detach().reshape(-1).to(torch.float32) for t in tensors])

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Zero-copy views of a flat fp32 vector, one per segment, shaped like the parameters."""
        if flat.dim() != 1 or flat.dtype != torch.float32 or not flat.is_contiguous():
            raise ValueError(f"layout: need a contiguous 1-D float32 tensor, got {flat.dtype} {tuple(flat.shape)}")
        if flat.numel() != self.numel:
            raise ValueError(f"layout: flat vector has {flat.numel()} elements, layout has {self.numel}")
        return [flat[s.offset : s.offset + s.numel].view(s.shape) for s in self.segments]
