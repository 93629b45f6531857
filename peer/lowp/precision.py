"""Precision modes and their resolution against what the device can really do (docs/design.md#int8-kernels).

* ``fp32``: the full-precision baseline.
* ``sim8``: the paper's 8-bit numerics simulated in fp32 (quantize-dequantize); any hardware; the reference
  numerics and the study tool for bit widths below 8.
* ``int8``: the same numerics (docs/method.md#8-bit-local-training) computed on integer codes: activations saved for
  backward as 1-byte codes everywhere, quantization in fused passes (passes.py), and each product by the fastest kernel
  the probe proves exact on this device, chosen per op kind and shape (plan.py). The verdict against fp32 is a measured
  training step on the model's own shapes (steptime.py, at the second training step): if int8 is slower than fp32 here
  it is still used (the memory saving stays) and the log and the summary say so with the measured ratio. Only if no
  kernel at all is exact does int8 fall back to sim8 (logged).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from peer.lowp.kinds import PRECISION_MODES
from peer.lowp.passes import FusedPasses, PassInfo
from peer.lowp.plan import KernelPlan, NoExactKernel, default_plan
from peer.lowp.quantize import check_bits
from peer.lowp.steptime import StepCheck, StepTiming

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrecisionConfig:
    """Requested (or resolved) precision: ``mode`` in PRECISION_MODES, ``bits`` in 2..8.

    ``bits`` applies to weights, activations and layer gradients in sim8/int8; it is ignored in fp32. ``plan`` (int8
    only, set by resolve_precision) holds the probed kernel choices; layers without one use the device's default.
    ``step_check`` (int8 only, set by resolve_precision) times the model's second training step against fp32; a model
    built without one is not timed. ``passes`` (int8) are the fused quantization passes every layer built with this
    config runs, compiled or eager (tests and converted models pass eager ones: passes.passes_for).
    """

    mode: str = "fp32"
    bits: int = 8
    plan: KernelPlan | None = field(default=None, compare=False, repr=False)
    step_check: StepCheck | None = field(default=None, compare=False, repr=False)
    passes: FusedPasses = field(default_factory=FusedPasses, compare=False, repr=False)

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
    """What a peer really runs: the config in use, the kernel backend, and why.

    ``reason`` is computed on every read: once the model's own shapes have been probed (first training step) it
    reports them, before that the start-up probe's; status and logs read it as one line.
    """

    config_in_use: PrecisionConfig
    backend: str
    note: str
    requested: PrecisionConfig | None = None
    quantizers: PassInfo | None = field(default=None, compare=False)

    @property
    def step(self) -> StepTiming | None:
        """The measured int8 / fp32 training step (None before the second training step, or where not measured)."""
        check = self.config_in_use.step_check
        return None if check is None else check.result

    @property
    def reason(self) -> str:
        """One line: why this mode, the verdict against fp32 (the measured training step once there is one, else the
        products' speed-up and that the step is not measured yet) and the kernel and speed-up per op kind."""
        plan = self.config_in_use.plan
        if self.config_in_use.mode != "int8" or plan is None:
            return self.note
        ops = plan.describe()["ops"]
        kernels = ", ".join(f"{op} {d['kernel']} {d['speedup_vs_fp32']:.2f}x" for op, d in ops.items())
        speedup = plan.product_speedup()
        products = "" if speedup is None else f" ({speedup:.2f}x fp32 speed in all)"
        step = self.step
        if step is not None:
            return f"{self.note}; {step.verdict()}; products vs fp32: {kernels}{products}"
        text = f"{self.note}; products vs fp32: {kernels}"
        if speedup is not None and speedup < 1.0:
            text += (f"; no integer product kernel beats fp32 here (products {speedup:.2f}x fp32 speed): int8 kept "
                     "for its memory saving (1-byte activations saved for backward)")
        elif speedup is not None:
            text += f"; products {speedup:.2f}x fp32 speed"
        if self.config_in_use.step_check is not None:
            text += "; training step vs fp32 not measured yet (measured at the second training step)"
        return text

    def faster_than_fp32(self) -> bool | None:
        """Whether int8 beats or matches fp32 here: by the measured training step where there is one, else by the
        products alone; None before anything was measured."""
        step = self.step
        if step is not None:
            return not step.slower
        speedup = None if self.config_in_use.plan is None else self.config_in_use.plan.product_speedup()
        return None if speedup is None else speedup >= 1.0

    def describe(self) -> dict[str, object]:
        """JSON-ready detail: modes, backend, the one-line reason, per-op-kind kernels with every probed shape, the
        fused-quantizer path (compiled or eager, and why), the measured training step against fp32 and whether int8
        beats fp32 here."""
        out: dict[str, object] = {
            "requested": (self.requested or self.config_in_use).mode,
            "mode": self.config_in_use.mode,
            "bits": self.config_in_use.bits,
            "backend": self.backend,
            "reason": self.reason,
        }
        plan = self.config_in_use.plan
        if self.config_in_use.mode == "int8" and plan is not None:
            kernels = plan.describe()
            out["kernels"] = kernels["ops"]
            out["kernels_unavailable"] = kernels["unavailable"]
            speedup = plan.product_speedup()
            out["products_speedup_vs_fp32"] = None if speedup is None else round(speedup, 3)
            out["step_time_vs_fp32"] = None if self.step is None else self.step.to_dict()
            out["int8_faster_than_fp32"] = self.faster_than_fp32()
        if self.quantizers is not None:
            out["quantizers"] = {"path": self.quantizers.path, "kind": self.quantizers.kind,
                                 "reason": self.quantizers.reason}
        return out


def resolve_precision(
    requested: PrecisionConfig,
    device: torch.device,
    probe: Callable[[torch.device], KernelPlan] = default_plan,
) -> ResolvedPrecision:
    """Resolve ``requested`` on ``device``: for int8, probe the kernels (start-up shapes) and the fused passes.

    ``probe`` returns the KernelPlan to use (injectable: tests pass plans with a saturating kernel).
    """
    device = torch.device(device)
    if requested.mode == "fp32":
        return ResolvedPrecision(requested, "fp32", "fp32 requested", requested)
    if requested.mode == "sim8":
        return ResolvedPrecision(requested, "fake-quant", "sim8 requested (fp32 kernels)", requested)
    plan = probe(device)
    try:
        choices = plan.warm_up()
    except NoExactKernel as exc:
        fallback = PrecisionConfig("sim8", requested.bits)
        note = f"int8 requested but unavailable on {device}, using sim8: {exc}"
        log.warning(note)
        return ResolvedPrecision(fallback, "fake-quant", note, requested)
    quantizers = requested.passes.info
    kernels = sorted({c.kernel.name for c in choices if c.kernel is not None})
    step_check = StepCheck(record=plan.record, context=f"quantizers {quantizers.kind}",
                           waiting=requested.passes.waiting_graphs)
    resolved = ResolvedPrecision(replace(requested, plan=plan, step_check=step_check), "int8/" + "+".join(kernels),
                                 f"int8 on {device}, quantizers {quantizers.kind}", requested, quantizers)
    speedup = plan.product_speedup()
    (log.warning if speedup is not None and speedup < 1.0 else log.info)("precision: %s", resolved.reason)
    return resolved
