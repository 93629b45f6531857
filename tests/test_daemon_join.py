"""A joining peer checks the models it pulled (issue 23: an insider's poisoned model was what a joiner started from):
non-finite or far out of the fleet's norms is refused, and of several the medoid is chosen."""

from __future__ import annotations

import torch

from peer.daemon.join import MAX_NORM_RATIO, choose_model


def models(n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """``n`` honest models: a common trained model plus small per-peer differences."""
    gen = torch.Generator().manual_seed(seed)
    common = torch.randn(1000, generator=gen)
    return {f"peer-{i}": common + 0.01 * torch.randn(1000, generator=gen) for i in range(n)}


def test_a_poisoned_model_among_three_is_never_chosen() -> None:
    initial = torch.randn(1000, generator=torch.Generator().manual_seed(7))
    for poison in (lambda z: z * 1e30, lambda z: z * 50.0, lambda z: -z, lambda z: z + 3.0):
        candidates = models(2)
        candidates["insider"] = poison(candidates["peer-0"].clone())
        choice = choose_model(candidates, initial)
        assert choice.chosen in {"peer-0", "peer-1"}, choice


def test_non_finite_and_out_of_norm_models_are_refused_with_the_reason() -> None:
    initial = torch.ones(1000)
    nan = torch.ones(1000)
    nan[3] = float("nan")
    huge = torch.ones(1000) * (2 * MAX_NORM_RATIO)
    choice = choose_model({"a": nan, "b": huge}, initial)
    assert choice.chosen is None
    assert "non-finite" in choice.refused["a"] and "norm" in choice.refused["b"]
    assert choose_model({"a": nan, "c": torch.ones(1000) * 1.5}, initial).chosen == "c"


def test_with_two_left_the_one_nearer_the_initial_norm_is_chosen() -> None:
    initial = torch.ones(1000)
    choice = choose_model({"near": torch.ones(1000) * 1.2, "inflated": torch.ones(1000) * 40.0}, initial)
    assert choice.chosen == "near" and not choice.refused
