"""Memory layout of 4-D activations and gradients, as the int8 mode's passes and kernels read it."""

from __future__ import annotations

from torch import Tensor, channels_last


def is_channels_last(t: Tensor) -> bool:
    """Whether ``t`` is a 4-D tensor laid out channels_last (NHWC in memory) and not also plain contiguous (a tensor
    with one channel or 1x1 pixels is both: it counts as NCHW)."""
    return t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(memory_format=channels_last)
