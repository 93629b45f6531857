"""The daemon's evaluations spread over its rounds (peer/daemon/evaluator.py): a snapshot evaluated a few batches
per round gives what evaluating that model at once gives, however the peer trains meanwhile."""

from __future__ import annotations

import copy

import pytest
import torch

from peer.config import DataSpec, ModelSpec, OptimSpec, RunSpec
from peer.daemon.evaluator import SpreadEvaluator
from peer.data import load_dataset
from peer.runtime.build import build_peer, build_peer_model, eval_loader
from peer.runtime.evaluation import evaluate

SPEC = RunSpec(model=ModelSpec(name="mnist-cnn", precision="fp32"), data=DataSpec(dataset="synthetic", batch_size=8),
               optim=OptimSpec(lr=0.1, epochs=5.0))


@pytest.fixture
def setup():
    splits = load_dataset("synthetic", n_train=96, n_test=44, image_size=28, in_channels=1)  # 5 batches of 8 + 4
    built = build_peer_model(SPEC.model, splits, torch.device("cpu"))
    peer = build_peer(SPEC, "p0", (0, 1), splits, torch.device("cpu"), built)
    return peer, built.model, eval_loader(splits, torch.device("cpu"), batch_size=8)


def test_a_spread_evaluation_is_the_snapshots_evaluation_while_the_peer_trains(setup) -> None:
    peer, snapshot_model, test_set = setup
    peer.train_steps(2)
    evaluator = SpreadEvaluator(peer, snapshot_model, test_set, batches_per_round=2)
    assert evaluator.start(round_=7) is None
    peer.prepare_evaluation()
    expected = evaluate(copy.deepcopy(peer.model), test_set)  # the model as of the snapshot
    results, rounds = [], 0
    while not results:
        peer.train_steps(1)  # training goes on between the evaluation's batches
        rounds += 1
        results = [r for r in [evaluator.advance()] if r is not None]
    assert rounds == 3 and not evaluator.running  # 6 batches, 2 per round
    (finished,) = results
    assert (finished.result.round, finished.result.test_loss, finished.result.test_acc) == (7, *expected)
    peer.prepare_evaluation()
    assert evaluate(peer.model, test_set)[0] != expected[0]  # the peer's own model did move meanwhile


def test_a_new_evaluation_finishes_the_running_one_first(setup) -> None:
    peer, snapshot_model, test_set = setup
    evaluator = SpreadEvaluator(peer, snapshot_model, test_set, batches_per_round=1)
    peer.prepare_evaluation()
    expected = evaluate(copy.deepcopy(peer.model), test_set)
    evaluator.start(round_=1)
    assert evaluator.advance() is None
    peer.train_steps(1)
    finished = evaluator.start(round_=2)  # due again before the first one was done
    assert finished is not None and (finished.result.round, finished.result.test_loss) == (1, expected[0])
    assert evaluator.running and evaluator.finish().result.round == 2 and evaluator.finish() is None
