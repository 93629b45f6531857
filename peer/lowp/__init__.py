"""8-bit training (METHOD.md 5-6): quantizers, fused passes, exact int8 kernels + probe, quantized layers, EvoNorms."""

from peer.lowp.evonorm import (
    NORM_KINDS,
    BatchNormAct,
    EvoNormS0,
    RangeEvoNorm,
    make_norm_act,
    range_constant,
)
from peer.lowp.kernels import ConvGeometry, ProductKernel, all_kernels
from peer.lowp.layers import QAdd, QConv2d, QLinear
from peer.lowp.passes import Codes, FusedPasses, PassInfo, passes, set_passes
from peer.lowp.plan import Choice, KernelPlan, NoExactKernel, default_plan
from peer.lowp.precision import (
    PRECISION_MODES,
    PrecisionConfig,
    ResolvedPrecision,
    resolve_precision,
)
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
    "Choice",
    "Codes",
    "ConvGeometry",
    "EvoNormS0",
    "FusedPasses",
    "KernelPlan",
    "NoExactKernel",
    "PassInfo",
    "PrecisionConfig",
    "ProductKernel",
    "QAdd",
    "QConv2d",
    "QLinear",
    "QParams",
    "RangeEvoNorm",
    "ResolvedPrecision",
    "all_kernels",
    "batch_range",
    "default_plan",
    "dequantize",
    "fake_quantize",
    "make_norm_act",
    "passes",
    "qparams_from_range",
    "quantize_codes",
    "quantize_int8",
    "range_constant",
    "resolve_precision",
    "set_passes",
    "tensor_qparams",
]
