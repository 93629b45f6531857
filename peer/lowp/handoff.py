"""Activation codes of the int8 mode, handed from one layer to the next instead of quantizing a tensor twice.

In training every quantizer of a tensor uses the same batch range (METHOD.md 5), so all of them produce the same
codes: a residual block's input feeds its first convolution, the downsampling shortcut convolution and the residual
add, and the stem's output feeds the first block the same way. The first quantizer to see the tensor computes its
codes and attaches them to the tensor object (keyed by object identity and version counter, never by data_ptr:
reused memory would hand stale codes on); the others take them and update their own running range with the same
batch range. In evaluation each quantizer uses its own running range, so nothing is shared.
"""

from __future__ import annotations

import torch
from torch import Tensor

from peer.lowp.passes import Codes, passes
from peer.lowp.quantize import ActivationQuantizer

_ATTR = "_lowp_batch_codes"


def activation_codes(quant: ActivationQuantizer, x: Tensor, channels_last: bool | None = False) -> Codes:
    """Codes of ``x`` under ``quant`` (asymmetric, nearest); training updates ``quant``'s running range.

    ``channels_last``: the layout the consumer wants (True, False), or None for any (handed-on codes as they are).
    """
    layout = bool(channels_last)
    if not quant.training:
        if bool(quant.initialized):
            return passes().activation(x, quant.bits, quant.running_lo, quant.running_hi, layout)[0]
        return passes().activation(x, quant.bits, channels_last=layout)[0]
    cached = getattr(x, _ATTR, None)
    if (cached is not None and cached[0] == (x._version, quant.bits)
            and (channels_last is None or _is_channels_last(cached[1].data) == layout)):
        codes, lo, hi = cached[1:]
    else:
        codes, lo, hi = passes().activation(x, quant.bits, channels_last=layout)
        setattr(x, _ATTR, ((x._version, quant.bits), codes, lo, hi))
    quant.observe(lo, hi)
    return codes


def _is_channels_last(t: Tensor) -> bool:
    return t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last)
