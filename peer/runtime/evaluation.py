"""Test-set evaluation of a model (loss and top-1 accuracy), and the BatchNorm statistics it needs first."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn


def evaluate(model: nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, float]:
    """Mean cross-entropy loss and accuracy in [0, 1] over ``batches``, all at once (:class:`Evaluation`)."""
    evaluation = Evaluation(model, batches)
    evaluation.advance(None)
    return evaluation.result()


class Evaluation:
    """One test evaluation of ``model`` that can run a few batches at a time (:meth:`advance`), so that a daemon
    spreads it over its rounds instead of stopping them (peer/daemon/node.py). The model must not change until it
    is done: the daemon evaluates a snapshot. Each call restores the model's train/eval mode.

    A batch shorter than the first (a test split's remainder: mnist5k's 1,000 images end in a batch of 8 at batch
    size 32) runs padded to the first's size with its own rows repeated, and only its own rows count: an int8
    model then meets no new shape, whose kernels it would plan and whose quantization pass graphs it would load or
    compile at the first evaluation (README fleet daemon: 0.76-1.02 s for its first evaluation against 0.59-0.66 s
    in fp32). The rows' results are the unpadded ones, bit for bit on the MNIST CNN in fp32 and int8: the model is
    per-sample (EvoNorms) and a batch's quantization range is its min / max, which repeated rows leave as they were.
    """

    def __init__(self, model: nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.model = model
        self._batches = iter(batches)
        self._next = next(self._batches, None)  # one batch ahead, so the call that takes the last one says done
        self._rows = 0  # the first batch's size, which every later batch is padded to
        self._loss_sum, self._correct, self._count = 0.0, 0, 0

    @property
    def done(self) -> bool:
        return self._next is None

    @torch.no_grad()
    def advance(self, n_batches: int | None) -> bool:
        """Evaluate up to ``n_batches`` more batches (None: all that are left); whether the evaluation is done."""
        was_training = self.model.training
        self.model.eval()
        try:
            taken = 0
            while self._next is not None and (n_batches is None or taken < n_batches):
                x, y = self._next
                self._next = next(self._batches, None)
                self._rows = self._rows or x.shape[0]
                logits = self.model(_padded(x, self._rows))[: x.shape[0]]
                self._loss_sum += float(nn.functional.cross_entropy(logits, y, reduction="sum"))
                self._correct += int((logits.argmax(dim=1) == y).sum())
                self._count += int(y.numel())
                taken += 1
        finally:
            self.model.train(was_training)
        return self.done

    def result(self) -> tuple[float, float]:
        """Mean loss and accuracy in [0, 1] over the batches evaluated (NaN, NaN for none)."""
        if self._count == 0:
            return float("nan"), float("nan")
        return self._loss_sum / self._count, self._correct / self._count


def _padded(x: torch.Tensor, rows: int) -> torch.Tensor:
    """``x`` with its rows repeated cyclically up to ``rows`` rows (``x`` itself when it has as many or more)."""
    n = x.shape[0]
    if n >= rows or n == 0:
        return x
    return x[torch.arange(rows, device=x.device) % n]


#: Training batches whose statistics a model's BatchNorm layers are recomputed from before an evaluation.
BATCHNORM_REFRESH_BATCHES = 16


@torch.no_grad()
def refresh_batchnorm(model: nn.Module, batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
                      n_batches: int = BATCHNORM_REFRESH_BATCHES) -> bool:
    """Recompute the running statistics of ``model``'s BatchNorm layers as the plain mean over ``n_batches`` of
    the peer's own training batches (what torch.optim.swa_utils.update_bn does); False if it has none.

    Why: a model that keeps its BatchNorm (``--norm keep``) evaluates with running averages that lag the weights -
    gossip moves the weights under them every round, and torchvision's MobileNetV3 updates them at momentum 0.01 -
    so a model whose training loss had fallen to 0.8 evaluated at chance (9.8%, MobileNetV3-Small on 1,300
    digits, 6 epochs, fp32). The batch-independent norms (EvoNorms) have no such statistics.
    """
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]
    if not norms:
        return False
    momenta = [m.momentum for m in norms]
    was_training = model.training
    model.train()
    try:
        for m in norms:
            m.reset_running_stats()
            m.momentum = None  # a cumulative average over the batches below
        for _ in range(n_batches):
            model(next(batches)[0])
    finally:
        for m, momentum in zip(norms, momenta):
            m.momentum = momentum
        model.train(was_training)
    return True
