"""The divergence recovery policy on its own (peer/runtime/recovery.py): verdicts from plain figures, no peer, no
model. The round carrying them out is tested in tests/test_runtime.py."""

from __future__ import annotations

import math

import pytest
import torch

from peer.runtime.recovery import (
    GiveUp,
    Healthy,
    Recovery,
    RollBack,
    Snapshot,
    halved_gamma,
)


def snap(round_index: int) -> Snapshot:
    return Snapshot(round_index, torch.full((3,), float(round_index)), {})


def test_healthy_rounds_ask_for_a_snapshot_every_interval() -> None:
    policy = Recovery("p0", gamma=0.4, snapshot_every=10)
    assert not policy.has_snapshot
    policy.keep(snap(0))
    due = []
    for t in range(1, 25):
        verdict = policy.judge(t, 1.0, True, 10)
        assert isinstance(verdict, Healthy)
        if verdict.snapshot:
            due.append(t)
            policy.keep(snap(t))
    assert due == [10, 20]
    assert policy.loss_mean == pytest.approx(1.0) and policy.gamma == 0.4


def test_a_divergence_rolls_back_to_the_older_snapshot_and_halves_gamma() -> None:
    policy = Recovery("p0", gamma=0.4, max_halvings=2)
    policy.keep(snap(0))
    policy.keep(snap(10))
    verdict = policy.judge(12, math.nan, True, 10)
    assert isinstance(verdict, RollBack) and verdict.to.round == 0
    assert verdict.event.gamma == policy.gamma == pytest.approx(0.2) and verdict.event.reason == "training loss nan"
    assert [s.round for s in policy.snapshots] == [0] and policy.recoveries == 1 and policy.halvings == 1
    verdict = policy.judge(13, 1.0, False, 10)
    assert isinstance(verdict, RollBack) and verdict.event.reason == "model not finite" and policy.gamma == 0.1


def test_out_of_halvings_gives_up_with_a_message_and_the_last_good_model() -> None:
    policy = Recovery("p0", gamma=0.4, max_halvings=0)
    assert policy.judge(0, math.inf, True, 10) == GiveUp(None, "peer p0 diverged in round 0 (training loss inf) "
                                                               "with no healthy model to roll back to; try a lower "
                                                               "--lr or --gamma")
    policy.keep(snap(0))
    verdict = policy.judge(1, math.nan, True, 10)
    assert isinstance(verdict, GiveUp) and verdict.to is not None and verdict.to.round == 0
    assert "halved 0 time(s) to 0.4" in verdict.message and "--lr" in verdict.message


def test_an_explosion_is_judged_against_the_running_mean_and_a_uniform_guess() -> None:
    policy = Recovery("p0", gamma=1.0)
    policy.loss_mean = 0.5
    assert policy.diagnose(3.0, True, 10) is None  # 6x the mean, below 2 ln 10
    assert "exploded" in (policy.diagnose(50.0, True, 10) or "")
    assert policy.loss_mean == 0.5  # diagnose only judges


def test_a_round_whose_own_training_threw_the_model_diverged() -> None:
    """A round's loss is the model's before each step: a step that throws the model shows in its movement first,
    judged before the round sends anything."""
    policy = Recovery("p0", gamma=1.0)
    policy.loss_mean = 0.5
    assert policy.diagnose(0.5, True, 10, moved=0.19) is None  # the largest healthy move measured (warm-up's end)
    assert "moved the model by 0.6 of its norm" in (policy.diagnose(0.5, True, 10, moved=0.6) or "")
    policy.keep(snap(0))
    verdict = policy.judge(3, 0.5, True, 10, moved=0.6)
    assert isinstance(verdict, RollBack) and verdict.charged is None and verdict.lr_halved


def test_the_remedy_follows_the_cause_and_both_halvings_share_one_budget() -> None:
    """A divergence of the training step itself halves the learning rate, not gamma (halving gamma slowed mixing
    for the rest of the run without touching the cause); one gossip explains halves gamma as before; the two
    together are bounded by max_halvings, and the factor survives a checkpoint."""
    policy = Recovery("p0", gamma=0.4, max_halvings=3)
    policy.keep(snap(0))
    step = policy.judge(1, math.nan, True, 10, own_step=True)
    assert isinstance(step, RollBack) and step.lr_halved and step.event.lr_factor == 0.5
    assert policy.lr_factor == 0.5 and policy.gamma == 0.4
    gossip = policy.judge(2, math.nan, True, 10)
    assert isinstance(gossip, RollBack) and not gossip.lr_halved and policy.gamma == 0.2 and policy.lr_factor == 0.5
    restored = Recovery("p0", gamma=0.4, max_halvings=3)
    restored.load_state_dict(policy.state_dict())
    assert restored.lr_factor == 0.5 and restored.gamma == 0.2
    assert isinstance(policy.judge(3, 0.5, True, 10, moved=0.9), RollBack) and policy.lr_factor == 0.25
    out = policy.judge(4, math.nan, True, 10, own_step=True)
    assert isinstance(out, GiveUp) and "the learning rate 2 time(s)" in out.message and "--lr" in out.message


def test_gamma_is_derived_from_the_halvings_not_accumulated() -> None:
    policy = Recovery("p0", gamma=0.3)
    for _ in range(2):  # a restore applied twice must not halve twice
        policy.load_state_dict({"halvings": 3, "recoveries": 3})
        assert policy.gamma == halved_gamma(0.3, 3) == pytest.approx(0.3 / 8)
    assert policy.recoveries == 3
