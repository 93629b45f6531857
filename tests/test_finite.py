"""Whole-tensor finiteness checks (peer/finite.py): the same answers as ``torch.isfinite(t).all()``."""

import math

import pytest
import torch

from peer.finite import all_finite, max_abs


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, None])
@pytest.mark.parametrize("where", [0, 777, -1])
def test_all_finite_agrees_with_isfinite(dtype, bad, where):
    t = torch.randn(1000, generator=torch.Generator().manual_seed(where % 7)).to(dtype)
    if bad is not None:
        t[where] = bad
    assert all_finite(t) == bool(torch.isfinite(t).all()) == (bad is None)


def test_empty_and_integer_tensors_are_finite():
    assert all_finite(torch.empty(0)) and all_finite(torch.arange(5)) and all_finite(torch.zeros(3, 0, 2))
    assert max_abs(torch.empty(0)) == 0.0


def test_max_abs_is_the_largest_magnitude_and_propagates_nan():
    assert max_abs(torch.tensor([1.0, -7.5, 3.0])) == 7.5
    assert max_abs(torch.tensor([1.0, 7.5, -3.0])) == 7.5
    assert math.isnan(max_abs(torch.tensor([1.0, math.nan, -3.0])))
    assert max_abs(torch.tensor([-math.inf, 2.0])) == math.inf


@pytest.mark.parametrize("x, w, refused", [
    ([1.0, -2.0], 1.0, None),
    ([1.0, math.nan], 1.0, "non-finite"),
    ([3e38, -1.0], 1e-300, "overflows"),  # x / w beyond float64
    ([-3e38, 1.0], 1e-300, "overflows"),
    ([3e38, 1.0], 1e-200, None),  # 3e238: finite in float64, where z = x / w is checked
])
def test_a_checkpoint_is_refused_for_a_model_that_is_not_finite_or_overflows(x, w, refused):
    from peer.runtime.state import CheckpointError, check_sane

    state = {"engine": {"x": torch.tensor(x), "w": w}, "buffers": {"b": torch.ones(2)}}
    if refused is None:
        check_sane(state, "test.pt")
    else:
        with pytest.raises(CheckpointError, match=refused):
            check_sane(state, "test.pt")
    state["buffers"]["b"] = torch.tensor([0.0, math.inf])
    with pytest.raises(CheckpointError):
        check_sane(state, "test.pt")
