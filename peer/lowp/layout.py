"""Memory layout of 4-D activations and gradients, as the int8 mode's passes and kernels read it."""

from __future__ import annotations

from torch import Tensor, channels_last


def is_channels_last(t: Tensor) -> bool:
    """Whether ``t`` is a 4-D tensor laid out channels_last (NHWC in memory) and not also plain contiguous (a tensor
    with one channel or 1x1 pixels is both: it counts as NCHW)."""
    return t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(memory_format=channels_last)


def memory_order(t: Tensor) -> tuple[int, ...]:
    """The dim order in which ``t``'s elements lie in memory: (0, 2, 3, 1) for channels_last, else its dims in order
    (``t.permute(memory_order(t))`` is contiguous for NCHW and channels_last tensors)."""
    return (0, 2, 3, 1) if is_channels_last(t) else tuple(range(t.dim()))


def inverse_order(order: tuple[int, ...]) -> tuple[int, ...]:
    """The permutation that undoes ``permute(order)``."""
    return tuple(order.index(d) for d in range(len(order)))
