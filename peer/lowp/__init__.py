"""8-bit training (METHOD.md 5-6): quantizers, int8 kernels + probe, quantized layers, EvoNorms."""

from peer.lowp.evonorm import (
    NORM_KINDS,
    BatchNormAct,
    EvoNormS0,
    RangeEvoNorm,
    make_norm_act,
    range_constant,
)
from peer.lowp.layers import QAdd, QConv2d, QLinear
from peer.lowp.precision import (
    PRECISION_MODES,
    PrecisionConfig,
    ResolvedPrecision,
    resolve_precision,
)
from peer.lowp.probe import ProbeResult, probe_int8
from peer.lowp.quantize import (
    ActivationQuantizer,
    QParams,
    batch_range,
    dequantize,
    fake_quantize,
    qparams_from_range,
    quantize_codes,
    quantize_int8,
    tensor_qparams,
)

__all__ = [
    "NORM_KINDS",
    "PRECISION_MODES",
    "ActivationQuantizer",
    "BatchNormAct",
    "EvoNormS0",
    "PrecisionConfig",
    "ProbeResult",
    "QAdd",
    "QConv2d",
    "QLinear",
    "QParams",
    "RangeEvoNorm",
    "ResolvedPrecision",
    "batch_range",
    "dequantize",
    "fake_quantize",
    "make_norm_act",
    "probe_int8",
    "qparams_from_range",
    "quantize_codes",
    "quantize_int8",
    "range_constant",
    "resolve_precision",
    "tensor_qparams",
]
