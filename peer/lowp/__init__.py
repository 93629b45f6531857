"""8-bit training (docs/method.md#8-bit-local-training, docs/method.md#normalisation-layers): quantizers, fused passes,
exact int8 kernels + probe, quantized layers, EvoNorms, 1-byte-mask pooling/activations/dropout, and the converter of
any model to them.

Names load on first use, so importing ``peer.lowp.kinds`` (config, CLI) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "NORM_KINDS": "kinds", "PRECISION_MODES": "kinds",
    "BatchNormAct": "evonorm", "EvoNormS0": "evonorm", "EvoNormS0Linear": "evonorm", "RangeEvoNorm": "evonorm",
    "RangeEvoNormLinear": "evonorm", "make_norm_act": "evonorm", "range_constant": "evonorm",
    "Conversion": "conversion", "LayerRow": "conversion", "MacCount": "conversion",
    "NORM_CHOICES": "convert",  # convert() itself: from peer.lowp.convert (the submodule shadows a package name)
    "ConvGeometry": "kernels", "FloatCodesKernel": "kernels", "IntMMKernel": "kernels", "OneDNNKernel": "kernels",
    "ProductKernel": "kernels", "all_kernels": "kernels",
    "MaskDropout": "masks", "MaskHardsigmoid": "masks", "MaskHardswish": "masks", "MaskMaxPool2d": "masks",
    "MaskReLU": "masks", "MaskReLU6": "masks",
    "QAdd": "layers", "QConv2d": "layers", "QLinear": "layers",
    "Codes": "qmath", "FusedPasses": "passes", "PassInfo": "passes", "passes_for": "passes",
    "Choice": "plan", "KernelPlan": "plan", "NoExactKernel": "plan", "default_plan": "plan",
    "OpCase": "probe", "check_exact": "probe",
    "PrecisionConfig": "precision", "ResolvedPrecision": "precision", "resolve_precision": "precision",
    "ActivationQuantizer": "quantize", "QParams": "quantize", "batch_range": "quantize", "dequantize": "quantize",
    "fake_quantize": "quantize", "qparams_from_range": "quantize", "quantize_codes": "quantize",
    "tensor_qparams": "quantize",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
