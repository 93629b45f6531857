"""Precision modes and their resolution against what the device can really do (DESIGN.md 8).

* ``fp32``: the full-precision baseline.
* ``sim8``: the paper's 8-bit numerics simulated in fp32 (quantize-dequantize); any hardware.
* ``int8``: the same numerics with the matrix products computed by int8 kernels
  (``torch._int_mm``) and activations saved for backward as int8. Chosen only where the
  capability probe (probe.py) passes; otherwise ``resolve_precision`` falls back to ``sim8``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from peer.lowp.kinds import PRECISION_MODES
from peer.lowp.probe import ProbeResult, probe_int8
from peer.lowp.quantize import check_bits


log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrecisionConfig:
    """Requested (or resolved) precision: ``mode`` in PRECISION_MODES, ``bits`` in 2..8.

    ``bits`` applies to weights, activations and layer gradients in sim8/int8; it is ignored
    in fp32.
    """

    mode: str = "fp32"
    bits: int = 8

    def __post_init__(self) -> None:
        if self.mode not in PRECISION_MODES:
            raise ValueError(f"mode must be one of {PRECISION_MODES}, got {self.mode!r}")
        check_bits(self.bits)

    @property
    def quantized(self) -> bool:
        """True for the 8-bit modes (sim8, int8)."""
        return self.mode != "fp32"


@dataclass(frozen=True)
class ResolvedPrecision:
    """What a peer really runs: the config in use, the kernel backend and why."""

    config_in_use: PrecisionConfig
    backend: str
    reason: str


def resolve_precision(
    requested: PrecisionConfig,
    device: torch.device,
    probe: Callable[[torch.device], ProbeResult] = probe_int8,
) -> ResolvedPrecision:
    """Resolve ``requested`` on ``device``; int8 falls back to sim8 (logged) if the probe fails.

    ``probe`` is injectable so tests (and operators) can simulate an inexact kernel.
    """
    device = torch.device(device)
    if requested.mode == "fp32":
        return ResolvedPrecision(requested, "fp32", "fp32 requested")
    if requested.mode == "sim8":
        return ResolvedPrecision(requested, "fake-quant", "sim8 requested (fp32 kernels)")
    result = probe(device)
    if result.ok:
        return ResolvedPrecision(requested, "torch._int_mm", result.reason)
    fallback = PrecisionConfig("sim8", requested.bits)
    reason = f"int8 requested but unavailable on {device}, using sim8: {result.reason}"
    log.warning(reason)
    return ResolvedPrecision(fallback, "fake-quant", reason)
