"""Skew partitioner: docs/method.md#non-iid-skew example counts, disjointness, extremes s=0 and s=1, argument
validation."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from peer.data.partition import skew_partition


def _blocked_labels(class_sizes: list[int], seed: int = 1) -> np.ndarray:
    """Labels with the given class sizes, in a shuffled order (so sorting by label actually matters)."""
    labels = np.repeat(np.arange(len(class_sizes)), class_sizes)
    return np.random.default_rng(seed).permutation(labels)


def test_method_example_counts() -> None:
    labels = _blocked_labels([5000] * 10)
    parts = skew_partition(labels, n_peers=8, skew=0.8, seed=0)
    assert len(parts) == 8
    for part in parts:
        assert part.size == 5000 + 1250
    sorted_part = parts[0][:5000]
    counts = np.bincount(labels[sorted_part], minlength=10)
    assert counts[0] == 4000 and counts[1] == 1000 and counts[2:].sum() == 0
    # sorted parts keep index order within a class (stable sort)
    assert np.all(np.diff(sorted_part[:4000]) > 0)
    # the random part comes from the 20% of each class left out of the sorted pool, roughly balanced
    random_counts = np.bincount(labels[parts[0][5000:]], minlength=10)
    assert random_counts.min() > 60
    everything = np.concatenate(parts)
    assert np.unique(everything).size == everything.size == 8 * 6250


def test_skew_zero_is_iid_like() -> None:
    labels = _blocked_labels([1000] * 10)
    parts = skew_partition(labels, n_peers=5, skew=0.0, seed=3)
    for part in parts:
        assert part.size == 2000
        counts = np.bincount(labels[part], minlength=10)
        assert counts.min() > 140 and counts.max() < 260  # binomial-ish around 200


def test_skew_one_gives_contiguous_classes() -> None:
    labels = _blocked_labels([1000] * 10)
    parts = skew_partition(labels, n_peers=5, skew=1.0)
    for r, part in enumerate(parts):
        assert part.size == 2000
        assert sorted(np.unique(labels[part]).tolist()) == [2 * r, 2 * r + 1]


def test_same_seed_same_partition_other_seed_differs() -> None:
    labels = _blocked_labels([300] * 4)
    a = skew_partition(labels, 3, 0.5, seed=7)
    b = skew_partition(labels, 3, 0.5, seed=7)
    c = skew_partition(labels, 3, 0.5, seed=8)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"n_peers": 0, "skew": 0.5}, "n_peers"),
        ({"n_peers": 2, "skew": 1.5}, "skew"),
        ({"n_peers": 2, "skew": -0.1}, "skew"),
        ({"n_peers": 2.0, "skew": 0.5}, "n_peers"),
        ({"n_peers": 2, "skew": True}, "skew"),
    ],
)
def test_invalid_arguments_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        skew_partition(np.zeros(10, dtype=np.int64), **kwargs)


@settings(max_examples=60, deadline=None)
@given(
    class_sizes=st.lists(st.integers(min_value=0, max_value=60), min_size=1, max_size=6),
    n_peers=st.integers(min_value=1, max_value=9),
    skew=st.floats(min_value=0.0, max_value=1.0, allow_nan=False),
    seed=st.integers(min_value=0, max_value=2**32 - 1),
)
def test_every_sample_at_most_once(class_sizes: list[int], n_peers: int, skew: float, seed: int) -> None:
    labels = _blocked_labels(class_sizes, seed=seed % 1000)
    parts = skew_partition(labels, n_peers, skew, seed=seed)
    assert len(parts) == n_peers
    everything = np.concatenate(parts)
    assert everything.dtype == np.int64
    assert np.unique(everything).size == everything.size
    assert everything.size == 0 or (everything.min() >= 0 and everything.max() < labels.size)
    per_peer = labels.size / n_peers
    # random parts are always full; sorted parts fall short by at most one index per class overall
    assert everything.size <= n_peers * int(per_peer)
    full = n_peers * (np.floor(per_peer * skew) + np.floor(per_peer * (1 - skew)) - 1)
    assert everything.size >= full - len(class_sizes)
