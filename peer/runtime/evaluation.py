"""Test-set evaluation of a model (loss and top-1 accuracy)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


@torch.no_grad()
def evaluate(model: nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, float]:
    """Mean cross-entropy loss and accuracy in [0, 1] over ``batches``; restores the model's train/eval mode."""
    was_training = model.training
    model.eval()
    loss_sum, correct, count = 0.0, 0, 0
    try:
        for x, y in batches:
            logits = model(x)
            loss_sum += float(nn.functional.cross_entropy(logits, y, reduction="sum"))
            correct += int((logits.argmax(dim=1) == y).sum())
            count += int(y.numel())
    finally:
        model.train(was_training)
    if count == 0:
        return float("nan"), float("nan")
    return loss_sum / count, correct / count
