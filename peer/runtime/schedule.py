"""Learning-rate schedule of the paper (docs/method.md#models-and-hyper-parameters): warm-up, then step decay at 50% and
75% of training."""

from __future__ import annotations


def lr_at(epoch: float, base_lr: float, epochs: float, warmup_epochs: float = 1.0) -> float:
    """Learning rate at a (fractional) epoch.

    0.1 x base_lr during the first ``warmup_epochs`` (the paper's first-epoch warm-up), base_lr until 50% of
    ``epochs``, 0.1 x base_lr until 75%, then 0.01 x base_lr.
    """
    if epoch < min(warmup_epochs, 0.5 * epochs):
        return 0.1 * base_lr
    if epoch < 0.5 * epochs:
        return base_lr
    if epoch < 0.75 * epochs:
        return 0.1 * base_lr
    return 0.01 * base_lr
