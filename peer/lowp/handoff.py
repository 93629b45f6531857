"""Activation codes of the int8 mode, handed from one layer to the next instead of quantizing a tensor twice.

In training every quantizer of a tensor uses the same batch range (docs/method.md#8-bit-local-training), so all of them
produce the same codes: a residual block's input feeds its first convolution, the downsampling shortcut convolution and
the residual add, and the stem's output feeds the first block the same way. The first quantizer to see the tensor
computes its codes and attaches them to the tensor object (keyed by object identity and version counter, never by
data_ptr: reused memory would hand stale codes on); the others take them and update their own running range with the
same batch range. In evaluation each quantizer uses its own running range, so nothing is shared.

Layer gradients go the same way backwards: a norm whose input came from a product layer computes the stochastic-
rounding codes of its input gradient in its own fused backward pass and hands them to that layer's backward.
"""

from __future__ import annotations

from torch import Tensor

from peer.lowp.layout import is_channels_last
from peer.lowp.passes import Codes, FusedPasses
from peer.lowp.quantize import ActivationQuantizer

_ATTR = "_lowp_batch_codes"
_GRAD_ATTR = "_lowp_grad_codes"


def activation_codes(quant: ActivationQuantizer, x: Tensor, engine: FusedPasses,
                     channels_last: bool | None = False) -> Codes:
    """Codes of ``x`` under ``quant`` (asymmetric, nearest) by ``engine``'s passes; training updates ``quant``'s
    running range.

    ``channels_last``: the layout the consumer wants (True, False), or None for any (handed-on codes as they are).
    """
    layout = is_channels_last(x) if channels_last is None else channels_last  # any: no transposing copy
    if not quant.training:
        if bool(quant.initialized):
            return engine.activation(x, quant.bits, quant.running_lo, quant.running_hi, layout)[0]
        return engine.activation(x, quant.bits, channels_last=layout)[0]
    cached = getattr(x, _ATTR, None)
    if (cached is not None and cached[0] == (x._version, quant.bits)
            and (channels_last is None or is_channels_last(cached[1].data) == layout)):
        codes, lo, hi = cached[1:]
    else:
        codes, lo, hi = engine.activation(x, quant.bits, channels_last=layout)
        setattr(x, _ATTR, ((x._version, quant.bits), codes, lo, hi))
    quant.observe(lo, hi)
    return codes


def attach_activation_codes(x: Tensor, codes: Codes, lo: Tensor, hi: Tensor, bits: int) -> None:
    """Hand on the batch codes of ``x`` (training), computed by ``x``'s producer in the same fused pass as ``x`` (a
    norm whose output feeds an 8-bit layer): the consumers' quantizers take them as if they had computed them."""
    setattr(x, _ATTR, ((x._version, bits), codes, lo, hi))


def attach_gradient_codes(g: Tensor, codes: Codes, bits: int) -> None:
    """Hand the stochastic-rounding codes of a layer gradient ``g``, computed in the same fused pass as ``g`` (a
    norm's backward), to the product layer whose backward receives ``g`` and would quantize it anyway."""
    setattr(g, _GRAD_ATTR, ((g._version, bits), codes))


def gradient_codes(g: Tensor, bits: int, channels_last: bool, engine: FusedPasses) -> Codes:
    """Stochastic-rounding codes of the layer gradient ``g``: the ones handed on with it if any (same bits, layout,
    unmodified tensor), else computed now by ``engine``'s passes."""
    handed = getattr(g, _GRAD_ATTR, None)
    if (handed is not None and handed[0] == (g._version, bits)
            and (g.dim() != 4 or is_channels_last(handed[1].data) == channels_last)):
        return handed[1]
    return engine.gradient(g, bits, channels_last=channels_last)
