"""Non-IID split of a training set over peers by degree of skew s (docs/method.md#non-iid-skew).

s = 0 gives every peer an IID sample, s = 1 gives each peer a contiguous run of classes. Every peer computes the same
partition from the same labels, peer count, skew and seed, so no coordination is needed.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np


def skew_partition(labels: np.ndarray, n_peers: int, skew: float, seed: int = 0) -> list[np.ndarray]:
    """Return, for each peer rank 0..n_peers-1, the training-set indices it owns (int64, no index twice overall).

    Steps, exactly as docs/method.md#non-iid-skew: sort the indices by label (stable, so ties stay in index order); for each class c
    the first floor(s*|c|) indices go, in class order, to a sorted pool and the rest to a random pool, which is
    shuffled with `seed`. Peer r takes the next floor(N/n * s) indices of the sorted pool and the next
    floor(N/n * (1-s)) of the random pool. Leftovers from the floors are left unused. The random pool always suffices;
    the sorted pool can fall short by at most one index per class (per-class floors), in which case the last peers'
    sorted parts are shorter.
    Each peer's array lists its sorted-pool part first, then its random-pool part.

    The floors are computed in exact rational arithmetic on the skew's shortest decimal form (0.8 means 4/5), because
    in binary floating point 50000/8 * (1 - 0.8) is 1249.99..., which would floor to 1249 instead of 1250.
    """
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise ValueError(f"labels: expected a 1-D array, got shape {labels.shape}")
    if isinstance(n_peers, bool) or not isinstance(n_peers, (int, np.integer)) or n_peers < 1:
        raise ValueError(f"n_peers: expected an integer >= 1, got {n_peers!r}")
    if isinstance(skew, bool) or not (isinstance(skew, (int, float, np.floating)) and 0.0 <= float(skew) <= 1.0):
        raise ValueError(f"skew: expected a number in [0, 1], got {skew!r}")
    s = Fraction(repr(float(skew)))
    n_total = labels.shape[0]

    order = np.argsort(labels, kind="stable")
    sorted_labels = labels[order]
    _, starts, counts = np.unique(sorted_labels, return_index=True, return_counts=True)
    sorted_parts: list[np.ndarray] = []
    random_parts: list[np.ndarray] = []
    for start, count in zip(starts, counts):
        n_sorted = math.floor(s * int(count))
        sorted_parts.append(order[start : start + n_sorted])
        random_parts.append(order[start + n_sorted : start + count])
    empty = np.empty(0, dtype=np.int64)
    sorted_pool = np.concatenate(sorted_parts or [empty]).astype(np.int64)
    random_pool = np.concatenate(random_parts or [empty]).astype(np.int64)
    np.random.default_rng(seed).shuffle(random_pool)

    per_peer = Fraction(n_total, int(n_peers))
    take_sorted = math.floor(per_peer * s)
    take_random = math.floor(per_peer * (1 - s))
    return [
        np.concatenate(
            [
                sorted_pool[r * take_sorted : (r + 1) * take_sorted],
                random_pool[r * take_random : (r + 1) * take_random],
            ]
        )
        for r in range(n_peers)
    ]
