"""Which pulled model a joining peer starts from (docs/design.md#exactly-once-mass-transfer, "Leaving and joining").

A peer without a checkpoint pulls the de-biased model of live neighbours (GetModel). One neighbour may be a
compromised device (issue 23: an insider drained the GetModel budget so a joiner pulled its poisoned model), so the
joiner pulls from up to :data:`JOIN_SOURCES` neighbours and checks what it got:

- a model with a non-finite value, or whose L2 norm is more than :data:`MAX_NORM_RATIO` times the joiner's own
  initial model's (same architecture and seed as every peer's start; training moves a model's norm by a small
  factor, a poisoned one by orders of magnitude), is refused;
- of the rest, the medoid - the model with the smallest summed distance to the others - is chosen, so one outlier
  among three cannot be picked (with two left, the one nearer the initial model's norm).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from peer.finite import all_finite

#: Neighbours a joiner pulls the model from.
JOIN_SOURCES = 3
#: Largest ratio of a pulled model's norm to the joiner's initial model's norm that is accepted.
MAX_NORM_RATIO = 100.0


@dataclass
class JoinChoice:
    """The model chosen (None when every candidate was refused) and why the others were refused."""

    chosen: str | None
    refused: dict[str, str] = field(default_factory=dict)


def choose_model(candidates: dict[str, torch.Tensor], initial: torch.Tensor,
                 max_norm_ratio: float = MAX_NORM_RATIO) -> JoinChoice:
    """Pick the model to start from among ``candidates`` (peer id -> model vector); ``initial`` is the joiner's own
    initial model (the yardstick for norms)."""
    choice = JoinChoice(None)
    limit = max_norm_ratio * max(float(initial.double().norm()), 1e-12)
    sane: dict[str, torch.Tensor] = {}
    for peer_id, z in candidates.items():
        if not all_finite(z):
            choice.refused[peer_id] = f"{int((~torch.isfinite(z)).sum())} non-finite values"
            continue
        norm = float(z.double().norm())
        if norm > limit:
            choice.refused[peer_id] = f"norm {norm:.3g} is over {max_norm_ratio:g} x the initial model's"
            continue
        sane[peer_id] = z.double()
    if not sane:
        return choice
    if len(sane) == 2:
        reference = float(initial.double().norm())
        choice.chosen = min(sorted(sane), key=lambda p: abs(float(sane[p].norm()) - reference))
    else:
        choice.chosen = min(sorted(sane), key=lambda p: sum(float((sane[p] - z).norm()) for z in sane.values()))
    return choice
