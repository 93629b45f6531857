"""Names the low-precision room defines (torch-free, so config and CLI can import them)."""

from __future__ import annotations

#: Training precision: fp32 baseline, sim8 (fake-quant reference numerics), int8 (int8 codes and kernels).
PRECISION_MODES = ("fp32", "sim8", "int8")
#: Normalisation-activation layers (docs/method.md#normalisation-layers).
NORM_KINDS = ("evonorm", "range-evonorm", "batchnorm")
