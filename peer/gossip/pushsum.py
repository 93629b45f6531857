"""Push-sum state of one peer (docs/method.md#push-sum).

A peer keeps a numerator ``x`` (one flat fp32 vector laid out like the model's parameters) and a scalar weight ``w``
(starts at 1). The model it trains and evaluates is the de-biased ``z = x / w``. Mixing is column-stochastic: a
sender splits its own mass, so nobody needs to know its in-neighbours. The network's consensus value is
``sum_i x_i / sum_i w_i``; it changes only through gradient steps, never through gossip, as long as every unit of
mass a sender gives away is added exactly once somewhere (docs/design.md#exactly-once-mass-transfer).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: Below this push-sum weight a peer's de-biased model is numerically meaningless (it gave nearly all its mass away
#: and received none). Messages that would push a peer below it are still applied; ``z`` is then clamped.
MIN_WEIGHT = 1e-12
#: Below this push-sum weight a peer sends no mass: it keeps its whole share (a self-loop, still column-stochastic)
#: until a message brings weight back. A peer whose in-neighbours are all silent (one restarting on a directed ring)
#: otherwise hands half its weight on every round: on a 2-core Xeon it fell to 3e-23 in 75 rounds (5 s), under
#: MIN_WEIGHT where ``z`` is clamped to nonsense, and its sent weights underflowed the wire's float32 to 0 - both
#: read by its neighbours as a hostile peer (docs/decisions/daemon-lifecycle.md#a-stopping-peer-takes-in-no-mass).
#: 1e-6 of a fleet whose weights sum to its size is nothing any receiver's model would notice.
MIN_SEND_WEIGHT = 1e-6


@dataclass
class PushSumState:
    """Numerator and weight of one peer.

    Attributes:
        x: flat fp32 numerator, ``x = w * z``.
        w: push-sum weight (dimensionless, float64 on purpose: weights are summed over many rounds).
    """

    x: torch.Tensor
    w: float = 1.0

    @classmethod
    def from_model_vector(cls, z: torch.Tensor) -> "PushSumState":
        """Start with weight 1, so x equals the model's parameters."""
        return cls(x=z.detach().clone().to(torch.float32), w=1.0)

    def debiased(self) -> torch.Tensor:
        """The model this peer uses: ``z = x / w`` (a new tensor)."""
        return self.x / max(self.w, MIN_WEIGHT)

    def debias_into(self, z: torch.Tensor) -> None:
        """Write ``x / w`` into an existing buffer (the model's flat parameter storage) without allocating."""
        torch.div(self.x, max(self.w, MIN_WEIGHT), out=z)
