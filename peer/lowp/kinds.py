"""Names the low-precision room defines (torch-free, so config and CLI can import them)."""

from __future__ import annotations

#: Training precision: fp32 baseline, sim8 (fake-quant reference numerics), int8 (int8 codes and kernels).
PRECISION_MODES = ("fp32", "sim8", "int8")
#: Normalisation-activation layers (docs/method.md#normalisation-layers).
NORM_KINDS = ("evonorm", "range-evonorm", "batchnorm")
#: What a daemon's passes say while they run eagerly for want of stored graphs (passes.py, background mode): the
#: host's store being filled behind it, or not filled at all (a machine that compiles nothing beside its daemons).
STORE_FILLING = "eager while the host's store is filled"
STORE_NOT_PREPARED = "eager: the host's store is not prepared"
