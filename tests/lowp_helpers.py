"""Helpers the 8-bit layer tests share: one product layer's quantization step, and one forward + backward."""

from __future__ import annotations

import torch
from torch import nn

from peer.lowp import batch_range, qparams_from_range, tensor_qparams


def product_step(x: torch.Tensor, w: torch.Tensor) -> float:
    """One quantization step of a product layer's output: input scale x weight scale (8 bits)."""
    lo, hi = batch_range(x)
    return (qparams_from_range(lo, hi, 8, False).scale * tensor_qparams(w, 8, True).scale).item()


def forward_backward(layer: nn.Module, x: torch.Tensor, dy: torch.Tensor,
                     seed: int = 3) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(y, dL/dx, dL/dW, dL/db) of one step with output gradient ``dy``; the backward's stochastic rounding draws
    from ``seed``."""
    x = x.clone().requires_grad_()
    y = layer(x)
    torch.manual_seed(seed)
    y.backward(dy)
    bias = getattr(layer, "bias", None)
    return y.detach(), x.grad, layer.weight.grad, None if bias is None else bias.grad
