"""Bind a model's parameters (and their gradients) to one flat fp32 buffer each.

Gossip, compression and the push-sum optimizer all work on one flat vector laid out by
:class:`~peer.compress.layout.Layout`; making the parameters views into it means "load z into the model" and
"read the gradient" cost nothing instead of a copy of the whole model per step.
"""

from __future__ import annotations

import torch
from torch import nn

from peer.compress.layout import Layout


class FlatModel:
    """A model whose parameters live in ``self.z`` and whose gradients land in ``self.grad``.

    Attributes:
        layout: parameter layout (named_parameters order).
        z: flat fp32 parameter vector; writing into it changes the model.
        grad: flat fp32 gradient vector, filled by backward().
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.layout = Layout.from_module(model)
        params = [p for _, p in model.named_parameters()]
        device = params[0].device if params else torch.device("cpu")
        self.z = self.layout.flatten([p.detach().float() for p in params]).to(device)
        self.grad = torch.zeros_like(self.z)
        self._params = params
        for p, zv, gv in zip(params, self.layout.views(self.z), self.layout.views(self.grad)):
            p.data = zv
            p.grad = gv

    def zero_grad(self) -> None:
        self.grad.zero_()

    def gradient(self) -> torch.Tensor:
        """The flat gradient after backward().

        Autograd accumulates in place into an existing ``.grad``; if anything replaced a ``.grad`` tensor (some
        kernels do), copy it back and re-bind, so the returned vector is always complete.
        """
        for p, gv in zip(self._params, self.layout.views(self.grad)):
            if p.grad is not gv:
                if p.grad is not None:
                    gv.copy_(p.grad.reshape(gv.shape))
                p.grad = gv
        return self.grad
