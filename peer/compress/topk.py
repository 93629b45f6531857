"""Layer-wise top-k selection (docs/method.md#communication-compression): per parameter tensor keep the K_l largest
|values|.

A full selection over a 2.4M-element layer costs ~60 ms on a small CPU (torch.topk), too slow for ResNet-18 at 1%
density. Large segments therefore take a two-pass route that returns exactly the same set: a strided sample
estimates a magnitude threshold a little below the K-th largest, one vectorised compare collects the candidates
above it (about 1.5 K of them), and the exact selection runs on the candidates only. If the sample was unlucky and
fewer than K candidates pass, the segment falls back to a full selection, so the result never depends on the
sample. Ties at the threshold are broken arbitrarily. The work is numpy (single-threaded, ~1 us per call): on a
shared 2-core machine the per-op overhead of torch's thread pool dominated the ~80 small tensors of a ResNet-20.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .layout import Layout

# Segments smaller than this use torch.topk directly (the two-pass route only pays off on large tensors).
_DIRECT_TOPK_MAX = 65_536
# Target number of sampled entries for the threshold estimate.
_SAMPLE_SIZE = 16_384
# Over-provisioning of the candidate set relative to K (fraction and absolute slack, in entries).
_OVERSHOOT = 1.5
_SLACK = 64


def keep_count(numel: int, compression: float) -> int:
    """K_l = max(1, floor(numel * (1 - c))), the number of entries kept for a tensor of `numel` elements."""
    if numel == 0:
        return 0
    return max(1, math.floor(numel * (1.0 - compression)))


def _segment_topk(mag: np.ndarray, k: int) -> np.ndarray:
    """Positions (int64, unsorted) of the k largest entries of the 1-D non-negative array `mag`."""
    n = mag.size
    if n <= _DIRECT_TOPK_MAX or 4 * k > n:
        return np.argpartition(mag, n - k)[n - k :]
    stride = max(1, n // _SAMPLE_SIZE)
    sample = mag[::stride]
    rank = min(sample.size, math.ceil(k / n * sample.size * _OVERSHOOT) + _SLACK)
    threshold = np.partition(sample, sample.size - rank)[sample.size - rank]
    candidates = np.flatnonzero(mag >= threshold)
    if candidates.size < k:
        return np.argpartition(mag, n - k)[n - k :]
    return candidates[np.argpartition(mag[candidates], candidates.size - k)[candidates.size - k :]]


def layerwise_topk(flat: torch.Tensor, layout: Layout, compression: float) -> list[np.ndarray | None]:
    """For each segment, the sorted local positions (int64, ascending) of its top-K_l entries by magnitude.

    `None` marks a segment kept whole (K_l == numel, e.g. c == 0 or a 1-element tensor): it travels dense.
    """
    values = flat.numpy()
    out: list[np.ndarray | None] = []
    for seg in layout.segments:
        k = keep_count(seg.numel, compression)
        if k == seg.numel:
            out.append(None)
            continue
        # abs per segment, not of the whole vector: segment-sized buffers are recycled by the allocator, while a
        # model-sized one is a fresh mmap (page faults) on every call.
        positions = _segment_topk(np.abs(values[seg.offset : seg.offset + seg.numel]), k)
        out.append(np.sort(positions).astype(np.int64, copy=False))
    return out
