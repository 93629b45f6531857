"""Energy prices of the operation counts (Horowitz, ISSCC 2014, 45 nm; picojoules per operation) and the ways the
8-bit model can be priced. Torch-free, so the CLI can offer the choices without importing torch."""

from __future__ import annotations

PJ_FP32_ADD = 0.9
PJ_FP32_MULT = 3.7
PJ_INT8_ADD = 0.03
PJ_INT8_MULT = 0.2

#: "quant-fp32": quantization arithmetic and pooling of the 8-bit model at fp32 prices (the default);
#: "paper": every add and multiply of the 8-bit model at the int8 price (the paper's section 5).
PRICINGS = ("quant-fp32", "paper")
