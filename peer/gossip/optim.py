"""Local optimizer on the push-sum numerator (docs/method.md#push-sum, docs/method.md#models-and-hyper-parameters), as
pure tensor code.

The gradient is taken at the de-biased model z = x / w and the step moves z by ``-lr * d``, i.e. the numerator by
``x <- x - lr * w * d`` (``d`` is Nesterov momentum SGD with weight decay on z, the model actually used).
The paper writes the SGP step as ``x <- x - lr * d``; that makes the effective step on z ``lr / w``, and in an
asynchronous fleet a fast peer's w settles well below 1 (it gives weight away more often than it receives), so its
model took steps several times too large and diverged (docs/method.md#departures-from-the-paper). Stepping on z
is what the SGP reference code does (it re-biases the parameters by w after the optimizer step); the network's
consensus value then moves by the w-weighted mean of the peers' steps.

Quasi-global momentum (QGM, Lin et al. 2021) helps on non-IID data: the step uses d = g + beta*(beta*m + g), and
after the step AND the gossip the buffer tracks the model's total movement, m <- beta*m + (1-beta)*(z_before - z_after)/lr,
so local momentum does not keep pushing towards the peer's own data distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class OptimConfig:
    """Hyper-parameters (paper defaults: momentum 0.9 Nesterov, weight decay 1e-4).

    Attributes:
        momentum: beta, 0 disables.
        weight_decay: L2 coefficient added to the gradient (per unit of lr).
        nesterov: Nesterov form of the momentum step.
        qgm: quasi-global momentum instead of local momentum.
    """

    momentum: float = 0.9
    weight_decay: float = 1e-4
    nesterov: bool = True
    qgm: bool = False

    def __post_init__(self) -> None:
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"momentum: must be in [0, 1), got {self.momentum}")
        if self.weight_decay < 0.0:
            raise ValueError(f"weight_decay: must be >= 0, got {self.weight_decay}")


class PushSumSGD:
    """Momentum SGD whose step lands on the numerator x while gradients are taken at z."""

    def __init__(self, numel: int, config: OptimConfig, device: torch.device | str = "cpu") -> None:
        self.config = config
        self.buf = torch.zeros(numel, device=device)
        self._z_before: torch.Tensor | None = None
        self._steps_since_gossip = 0

    def step(self, x: torch.Tensor, z: torch.Tensor, grad: torch.Tensor, lr: float, w: float = 1.0) -> None:
        """x -= lr * w * d(grad at z), so that z = x / w moves by -lr * d. ``grad`` gets weight decay added."""
        c = self.config
        grad.add_(z, alpha=c.weight_decay)
        if c.momentum == 0.0:
            x.add_(grad, alpha=-lr * w)
            return
        if c.qgm:
            if self._z_before is None:
                self._z_before = z.clone()
            self._steps_since_gossip += 1
            direction = grad.add(self.buf, alpha=c.momentum).mul_(c.momentum).add_(grad)
        else:
            self.buf.mul_(c.momentum).add_(grad)
            direction = grad.add(self.buf, alpha=c.momentum) if c.nesterov else self.buf
        x.add_(direction, alpha=-lr * w)

    def after_gossip(self, z_after: torch.Tensor, lr: float) -> None:
        """QGM only: fold the model's total movement since the round began (local steps + gossip), per step, into
        the momentum buffer."""
        if not self.config.qgm or self._z_before is None or lr <= 0.0:
            return
        beta = self.config.momentum
        per_step = (1.0 - beta) / (lr * self._steps_since_gossip)
        self.buf.mul_(beta).add_(self._z_before.sub_(z_after), alpha=per_step)
        self._z_before = None
        self._steps_since_gossip = 0

    def reset(self) -> None:
        """Forget the momentum (after a roll-back: the buffer points where the diverged model went)."""
        self.buf.zero_()
        self._z_before = None
        self._steps_since_gossip = 0

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"buf": self.buf}

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        self.buf.copy_(sd["buf"])
