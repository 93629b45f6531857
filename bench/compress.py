"""Bench: bytes on the wire and encode/decode time of the payload codec, against a naive baseline, one run.

Usage:  python bench/compress.py [--repeats N]

Models: ResNet-20 (CIFAR, EvoNorm: every norm brings three per-channel vectors) and ResNet-18, built by
peer.models so the layouts are the real ones. Tensors are realistic: conv/linear weights ~ N(0, 2/fan_in)
(He init scale), norm vectors 1 + N(0, 0.1^2) or N(0, 0.1^2), biases N(0, 0.01^2).

Baseline ("naive"): per-tensor torch.topk, values as fp32 and positions as int32 (8 bytes per kept entry, plus
nothing for headers), decode = np.frombuffer. The paper's reference code sends fp32 values and fp32-cast indices,
also 8 bytes per kept entry. Times are the best of --repeats runs (the CPU is shared; the best run is the least
disturbed), in milliseconds of wall clock.

Sizes: "v2" is len(encode(...)) in the current format; "v1" is what format version 1 (commit 050cbc6: explicit id,
coding and bits bytes, k, scale and index_len in every record) sent for the same selection, computed by `sizes`.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from functools import partial

import numpy as np
import torch

from peer.compress import CodecConfig, Layout, decode, encode
from peer.compress.indexcode import encode_positions
from peer.compress.topk import layerwise_topk
from peer.compress.wire import varint
from peer.models.registry import build_model


def realistic_flat(layout: Layout, seed: int = 0) -> torch.Tensor:
    """A flat parameter vector drawn at the scale a freshly initialised network has."""
    gen = torch.Generator().manual_seed(seed)
    parts = []
    for seg in layout.segments:
        noise = torch.randn(seg.numel, generator=gen)
        if len(seg.shape) >= 2 and seg.shape[0] > 1:
            parts.append(noise * math.sqrt(2.0 / (seg.numel // seg.shape[0])))
        elif seg.name.endswith(("gamma", ".v", "weight")):
            parts.append(1.0 + 0.1 * noise)
        elif seg.name.endswith("beta"):
            parts.append(0.1 * noise)
        else:
            parts.append(0.01 * noise)
    return torch.cat(parts)


def naive_encode(flat: torch.Tensor, layout: Layout, compression: float) -> bytes:
    """fp32 values + int32 positions of the layer-wise top-k (full torch.topk per tensor)."""
    idx, val = [], []
    for seg in layout.segments:
        part = flat[seg.offset : seg.offset + seg.numel]
        k = max(1, math.floor(seg.numel * (1 - compression)))
        top = torch.topk(part.abs(), k, sorted=False).indices + seg.offset
        idx.append(top)
        val.append(flat[top])
    return torch.cat(idx).to(torch.int32).numpy().tobytes() + torch.cat(val).numpy().tobytes()


def naive_decode(data: bytes, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of naive_encode, without any validation."""
    idx = torch.from_numpy(np.frombuffer(data, dtype=np.int32, count=count).astype(np.int64))
    val = torch.from_numpy(np.frombuffer(data, dtype=np.float32, offset=4 * count).copy())
    return idx, val


def best_ms(fn: Callable[[], object], repeats: int) -> float:
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def sizes(flat: torch.Tensor, layout: Layout, cfg: CodecConfig) -> tuple[int, int, int]:
    """(index bytes, value bytes, format-v1 payload bytes) of the payload `encode` makes for `flat`.

    Index and value bytes are counted as version 2 sends them (a SINGLE record: its position varint and a 4-byte
    f32 value); headers are the rest of len(payload). The version-1 size is what the previous format (commit
    050cbc6) sent for the same selection: per tensor id, coding, bits, k, f32 scale, index_len, index, values.
    """
    index = values = 0
    v1 = 4 + 1 + 8 + len(varint(len(layout.segments)))
    value_len = (lambda k: 4 * k) if cfg.bits == 32 else (lambda k: (k * cfg.bits + 7) // 8)
    for tensor_id, (seg, positions) in enumerate(zip(layout.segments, layerwise_topk(flat, layout, cfg.compression))):
        code = b"" if positions is None else encode_positions(positions, seg.numel)[1]
        k = seg.numel if positions is None else positions.size
        v1 += len(varint(tensor_id)) + 2 + len(varint(k)) + 4 + len(varint(len(code))) + len(code) + value_len(k)
        if positions is not None and k == 1:
            index, values = index + len(varint(int(positions[0]))), values + 4
        else:
            index, values = index + len(code), values + value_len(k)
    return index, values, v1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, best of {args.repeats}\n")
    sparse = CodecConfig(compression=0.99, bits=8)
    dense = CodecConfig(compression=0.0, bits=8)
    print("| model | params | tensors | kept @1% | v1 B/kept | v2 B/kept | naive B/kept | v2 vs naive "
          "| v2 (index, values, headers) B/kept | dense int8 B/param v1 / v2 | enc ms | dec ms | enc+dec ms "
          "| naive enc+dec ms | time ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in ("resnet20", "resnet18"):
        layout = Layout.from_module(build_model(name))
        flat = realistic_flat(layout)
        data, decoded = encode(flat, layout, sparse)
        kept = decoded.values.numel()
        index, values, v1 = sizes(flat, layout, sparse)
        headers = len(data) - index - values
        naive = naive_encode(flat, layout, sparse.compression)
        dense_bytes = len(encode(flat, layout, dense)[0])
        dense_v1 = sizes(flat, layout, dense)[2]
        enc = best_ms(partial(encode, flat, layout, sparse), args.repeats)
        dec = best_ms(partial(decode, data, layout), args.repeats)
        n_enc = best_ms(partial(naive_encode, flat, layout, sparse.compression), args.repeats)
        n_dec = best_ms(partial(naive_decode, naive, kept), args.repeats)
        ours, theirs = len(data) / kept, len(naive) / kept
        print(
            f"| {name} | {layout.numel:,} | {len(layout.segments)} | {kept:,} | {v1 / kept:.3f} | {ours:.3f} "
            f"| {theirs:.3f} | {theirs / ours:.2f}x smaller | ({index / kept:.3f}, {values / kept:.3f}, "
            f"{headers / kept:.3f}) | {dense_v1 / layout.numel:.5f} / {dense_bytes / layout.numel:.5f} "
            f"| {enc:.1f} | {dec:.1f} | {enc + dec:.1f} | {n_enc + n_dec:.1f} | {(enc + dec) / (n_enc + n_dec):.2f}x |"
        )


if __name__ == "__main__":
    main()
