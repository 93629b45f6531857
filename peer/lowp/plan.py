"""Per-op-kind, per-shape choice of the int8 product kernel, made by the probe and remembered
(docs/design.md#int8-kernels).

The first time a layer needs a product of a given op kind and shape, every kernel that supports it is checked for
exactness on full-range operands of that shape (probe.check_exact); the exact ones and the fp32 operation are timed
on that shape and the fastest exact kernel is used from then on, even if it is slower than fp32 (the int8 mode keeps
its memory saving; the measured ratio is reported). Weight gradients use the unquantized fp32 output gradient
(docs/method.md#8-bit-local-training): their product is fp32 on the activation codes; its cost against fp32 is measured
too.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Mapping, Sequence
from functools import partial
from dataclasses import dataclass, field
from typing import Any, TypedDict

import torch
from torch import Tensor
from torch.nn.grad import conv2d_weight

from peer.errors import PeerError
from peer.heap import trim_heap
from peer.lowp.host_record import HostRecord
from peer.lowp.kernels import OPS, ConvGeometry, ProductKernel, all_kernels
from peer.lowp.passes import Codes, FusedPasses
from peer.lowp.probe import (
    OpCase,
    as_in_use,
    check_exact,
    fp32_baseline,
    run_kernel,
    timing_operands,
)
from peer.lowp.timing import fastest_times

log = logging.getLogger(__name__)

WGRAD_OPS = ("conv.wgrad", "linear.wgrad")

#: Shapes probed at start-up, before any model shape is known: a middle stage of ResNet-20 (batch 32) and the
#: MNIST CNN's large linear layer (batch 64).
STARTUP_CASES = (
    OpCase("conv.fwd", (32, 32, 16, 16), (32, 32, 3, 3), ConvGeometry((3, 3), padding=(1, 1))),
    OpCase("conv.dgrad", (32, 32, 16, 16), (32, 32, 3, 3), ConvGeometry((3, 3), padding=(1, 1)), (32, 32, 16, 16)),
    OpCase("linear.fwd", (64, 3136), (128, 3136)),
    OpCase("linear.dgrad", (64, 128), (128, 3136)),
)


class OpSummary(TypedDict):
    """One op kind in :meth:`KernelPlan.describe`."""

    kernel: str
    speedup_vs_fp32: float
    shapes: list[dict[str, object]]


class PlanSummary(TypedDict):
    """:meth:`KernelPlan.describe`: JSON-ready."""

    device: str
    unavailable: dict[str, str]  # kernel name -> why it cannot run here
    ops: dict[str, OpSummary]


@dataclass
class Choice:
    """The kernel used for one OpCase and what the probe measured (times in ms, one thread)."""

    case: OpCase
    kernel: ProductKernel | None
    fp32_ms: float
    kernel_ms: float
    rejected: dict[str, str] = field(default_factory=dict)  # kernel name -> why not admitted
    timings_ms: dict[str, float] = field(default_factory=dict)  # every admitted kernel
    source: str = "model"
    recorded: bool = False  # read from the host's probe record (host_record.py), not probed by this process

    def product(self) -> ProductKernel:
        """The kernel of a product case (a weight-gradient case has none: ValueError)."""
        if self.kernel is None:
            raise ValueError(f"{self.case.op}: no product kernel (computed in fp32 from the codes)")
        return self.kernel

    @property
    def speedup(self) -> float:
        """fp32 time / chosen kernel time (> 1: faster than fp32)."""
        return self.fp32_ms / self.kernel_ms

    def to_dict(self) -> dict[str, object]:
        return {"case": self.case.label(), "kernel": self.kernel.name if self.kernel else "fp32",
                "speedup_vs_fp32": round(self.speedup, 3), "fp32_ms": round(self.fp32_ms, 4),
                "timings_ms": {k: round(v, 4) for k, v in self.timings_ms.items()},
                "rejected": self.rejected, "source": self.source, "recorded": self.recorded}

    def to_record(self) -> dict[str, object]:
        """What the host's probe record keeps of this choice (:meth:`KernelPlan.recorded_choice` reads it)."""
        return {"kernel": self.kernel.name if self.kernel else None, "fp32_ms": self.fp32_ms,
                "kernel_ms": self.kernel_ms, "rejected": self.rejected, "timings_ms": self.timings_ms}


class NoExactKernel(PeerError, RuntimeError):
    """No kernel is exact for an op on this device (the int8 mode is then refused)."""

    default_reason = "no_exact_kernel"


class KernelPlan:
    """Kernel choices of one device: probed lazily per OpCase, thread-safe, reported by ``describe()``."""

    def __init__(self, device: torch.device | str = "cpu", kernels: Sequence[ProductKernel] | None = None,
                 prefer: str | None = None, record: HostRecord | None = None) -> None:
        """``prefer`` names a kernel to use wherever it is exact, however fast (benchmarks of one kernel path);
        ``record`` keeps the verdicts for every process of the host (None: this plan probes for itself)."""
        self.device = torch.device(device)
        self.prefer = prefer
        self.record = record if prefer is None else None  # a preferred kernel is not the host's verdict
        self.unavailable: dict[str, str] = {}
        self.kernels: list[ProductKernel] = []
        for kernel in kernels if kernels is not None else all_kernels():
            reason = kernel.unavailable(self.device)
            if reason is None:
                self.kernels.append(kernel)
            else:
                self.unavailable[kernel.name] = reason
        self._choices: dict[OpCase, Choice] = {}
        self._lock = threading.RLock()
        self._probe_passes = FusedPasses(try_compile=False, eager_why="kernel probe")  # times products, not passes

    def __deepcopy__(self, memo: dict) -> KernelPlan:
        """Shared, not copied: a copied model (peer replicas, evaluation copies) uses the same probed choices."""
        return self

    # ---- probing ----------------------------------------------------------------------------------------------------

    def choose(self, case: OpCase, source: str = "model") -> Choice:
        """The kernel for ``case`` (probing it the first time)."""
        with self._lock:
            choice = self._choices.get(case)
            if choice is None:
                choice = self._choices[case] = self._recorded_or_probed(case, source)
                log.info("int8 kernel for %s: %s (%.2fx fp32)%s%s", case.label(),
                         choice.kernel.name if choice.kernel else "fp32", choice.speedup,
                         f"; rejected {choice.rejected}" if choice.rejected else "",
                         " [host probe record]" if choice.recorded else "")
            return choice

    def _recorded_or_probed(self, case: OpCase, source: str) -> Choice:
        """The host record's verdict for ``case``, else a probe (saved to the record for the host's other
        processes; while it runs they wait for it)."""
        if self.record is None:
            return self._probe_now(case, source)
        with self.record.slot(f"kernel {self.device} {case!r}") as slot:
            choice = self.recorded_choice(case, slot.value, source)
            if choice is None:
                choice = self._probe_now(case, source)
                slot.save(choice.to_record())
            return choice

    def _probe_now(self, case: OpCase, source: str) -> Choice:
        choice = self._probe_wgrad(case, source) if case.op in WGRAD_OPS else self._probe(case, source)
        trim_heap()  # the probe's operands and outputs: freed, handed back to the OS
        return choice

    def recorded_choice(self, case: OpCase, value: Mapping[str, Any] | None, source: str) -> Choice | None:
        """The choice a record entry (:meth:`Choice.to_record`) holds, or None if it holds none this plan can use
        (a kernel not available here, a product case without a kernel, a time that is not a positive number)."""
        if value is None:
            return None
        name = value.get("kernel")
        kernel = next((k for k in self.kernels if k.name == name), None)
        try:
            fp32_ms, kernel_ms = float(value["fp32_ms"]), float(value["kernel_ms"])
            rejected = {str(k): str(v) for k, v in dict(value.get("rejected", {})).items()}
            timings = {str(k): float(v) for k, v in dict(value.get("timings_ms", {})).items()}
        except (KeyError, TypeError, ValueError):
            fp32_ms = kernel_ms = math.nan
        usable = (kernel is None) == (case.op in WGRAD_OPS) and (name is None or kernel is not None) \
            and all(math.isfinite(t) and t > 0 for t in (fp32_ms, kernel_ms))
        if not usable:
            log.warning("probe record for %s unusable here (%s): probing it again", case.label(), value)
            return None
        return Choice(case, kernel, fp32_ms, kernel_ms, rejected, timings, source, recorded=True)

    def _probe(self, case: OpCase, source: str) -> Choice:
        rejected: dict[str, str] = {}
        admitted: list[ProductKernel] = []
        for kernel in sorted(self.kernels, key=lambda k: k.last_resort):  # last resorts after all the others
            if kernel.last_resort and admitted:
                break
            if not kernel.supports(case.op, case.geom):
                rejected[kernel.name] = "does not support this op/geometry"
                continue
            reason = check_exact(kernel, case, self.device)
            if reason is None:
                admitted.append(kernel)
            else:
                rejected[kernel.name] = reason
        if not admitted:
            raise NoExactKernel(f"no exact int8 kernel for {case.label()} on {self.device}: {rejected}")
        a, zp, w = timing_operands(case, self.device)
        thunks = {"fp32 (reference)": fp32_baseline(case, self.device)}
        for kernel in admitted:
            thunks[kernel.name] = partial(run_kernel, kernel, case, a, zp, w, 0.5)
        times = fastest_times(thunks, self.device)
        fp32_ms = times.pop("fp32 (reference)")
        preferred = [k for k in admitted if k.name == self.prefer]
        best = preferred[0] if preferred else min(admitted, key=lambda k: times[k.name])
        return Choice(case, best, fp32_ms, times[best.name], rejected, times, source)

    def _probe_wgrad(self, case: OpCase, source: str) -> Choice:
        """Weight gradient: fp32 on the activation codes (cast included) against fp32 on fp32 activations."""
        gen = torch.Generator().manual_seed(3)
        codes = as_in_use(torch.randint(0, 256, case.a_shape, dtype=torch.uint8, generator=gen).to(self.device))
        x = torch.randn(case.a_shape, generator=gen).to(self.device)
        g = torch.randn(case.out_shape(), generator=gen).to(self.device)
        xq = Codes(codes, torch.tensor(0.5, device=self.device), torch.tensor(128.0, device=self.device), -128, 127)
        if case.op == "conv.wgrad":
            geom, w_shape = case.conv_geom(), torch.Size(case.w_shape)
            thunks = {"fp32": lambda: _conv_wgrad(x, g, w_shape, geom),
                      "codes": lambda: conv_wgrad_from_codes(xq, g, w_shape, geom, self._probe_passes)}
        else:
            thunks = {"fp32": lambda: g.t() @ x, "codes": lambda: linear_wgrad_from_codes(xq, g)}
        times = fastest_times(thunks, self.device)
        return Choice(case, None, times["fp32"], times["codes"], {}, {"fp32 on codes": times["codes"]}, source)

    def warm_up(self, cases: Sequence[OpCase] = STARTUP_CASES) -> list[Choice]:
        """Probe ``cases`` now (start-up, before the model's own shapes are seen)."""
        return [self.choose(case, source="start-up probe") for case in cases]

    # ---- products used by the layers --------------------------------------------------------------------------------

    def conv_fwd(self, x: Codes, w: Codes, geom: ConvGeometry) -> Tensor:
        """fp32 ``conv(x_hat, w_hat)`` from codes, exact integer product times the two scales."""
        case = OpCase("conv.fwd", tuple(x.data.shape), tuple(w.data.shape), geom)
        scale = float(x.scale * w.scale)
        return self.choose(case).product().conv_fwd(x.data, int(x.zero_point), w.data, geom, scale)

    def conv_dgrad(self, g: Codes, w: Codes, geom: ConvGeometry, x_shape: torch.Size) -> Tensor:
        """fp32 input gradient ``conv_transpose(g_hat, w_hat)`` from codes."""
        case = OpCase("conv.dgrad", tuple(g.data.shape), tuple(w.data.shape), geom, tuple(x_shape))
        scale = float(g.scale * w.scale)
        return self.choose(case).product().conv_dgrad(g.data, int(g.zero_point), w.data, geom, x_shape, scale)

    def conv_wgrad(self, x: Codes, g: Tensor, w_shape: torch.Size, geom: ConvGeometry,
                   engine: FusedPasses) -> Tensor:
        """fp32 weight gradient from the activation codes and the unquantized fp32 output gradient (its layout
        passes by ``engine``)."""
        self.choose(OpCase("conv.wgrad", tuple(x.data.shape), tuple(w_shape), geom, tuple(g.shape)))
        return conv_wgrad_from_codes(x, g, w_shape, geom, engine)

    def linear_fwd(self, x: Codes, w: Codes) -> Tensor:
        """fp32 ``x_hat @ w_hat.T`` from codes (x 2-D)."""
        case = OpCase("linear.fwd", tuple(x.data.shape), tuple(w.data.shape))
        return self.choose(case).product().linear(x.data, int(x.zero_point), w.data, float(x.scale * w.scale))

    def linear_dgrad(self, g: Codes, w: Codes) -> Tensor:
        """fp32 ``g_hat @ w_hat`` from codes (g 2-D)."""
        case = OpCase("linear.dgrad", tuple(g.data.shape), tuple(w.data.shape))
        return self.choose(case).product().linear(g.data, int(g.zero_point), w.data.t(), float(g.scale * w.scale))

    def linear_wgrad(self, x: Codes, g: Tensor) -> Tensor:
        """fp32 ``g.T @ x_hat`` from the activation codes and the fp32 output gradient (both 2-D)."""
        self.choose(OpCase("linear.wgrad", tuple(x.data.shape), (g.shape[1], x.data.shape[1]), None,
                           tuple(g.shape)))
        return linear_wgrad_from_codes(x, g)

    # ---- reporting --------------------------------------------------------------------------------------------------

    def choices(self) -> list[Choice]:
        """Every choice made so far."""
        with self._lock:
            return list(self._choices.values())

    def describe(self) -> PlanSummary:
        """Per op kind: the kernel chosen (the one carrying most of the fp32 time), its speed-up over fp32 (total
        fp32 time / total kernel time over the shapes seen; the model's shapes once seen, else the start-up probe's)
        and every shape's detail. JSON-ready."""
        choices = self.choices()
        per_op: dict[str, OpSummary] = {}
        for op in OPS + WGRAD_OPS:
            of_op = [c for c in choices if c.case.op == op]
            model = [c for c in of_op if c.source == "model"]
            used = model or of_op
            if not used:
                continue
            weight: dict[str, float] = {}
            for c in used:
                name = c.kernel.name if c.kernel else "fp32"
                weight[name] = weight.get(name, 0.0) + c.fp32_ms
            per_op[op] = {"kernel": max(weight, key=weight.__getitem__),
                          "speedup_vs_fp32": round(sum(c.fp32_ms for c in used) / sum(c.kernel_ms for c in used), 3),
                          "shapes": [c.to_dict() for c in used]}
        return {"device": str(self.device), "unavailable": dict(self.unavailable), "ops": per_op}

    def product_speedup(self) -> float | None:
        """fp32 time / int8 time of all products measured (model shapes if seen), or None before any probe."""
        choices = self.choices()
        model = [c for c in choices if c.source == "model"] or choices
        if not model:
            return None
        return sum(c.fp32_ms for c in model) / sum(c.kernel_ms for c in model)


def _conv_wgrad(x: Tensor, g: Tensor, w_shape: torch.Size, geom: ConvGeometry) -> Tensor:
    return conv2d_weight(x, w_shape, g, geom.stride, geom.padding, geom.dilation, geom.groups)


def conv_wgrad_from_codes(x: Codes, g: Tensor, w_shape: torch.Size, geom: ConvGeometry,
                          engine: FusedPasses) -> Tensor:
    """``conv2d_weight(x_hat, g)`` as ``scale * conv2d_weight(codes - zp, g)``: the scale touches the small dW.

    Both operands in the codes' layout: oneDNN's weight gradient with channels_last input and NCHW output gradient
    (what an NCHW norm hands back) converted internally and ran 1.5-3x slower than with both channels_last. A
    one-channel input (an image's first layer) is contiguous in both layouts with either stride for its channel
    dimension, and oneDNN reads (H*W, H*W, W, 1) as NCHW: the MNIST CNN's first weight gradient took 1.16 ms
    against 0.37 ms with the channels_last stride (batch 32, one AMD EPYC Zen 4 core), and the just-in-time
    compiled passes hand it that stride - so it gets the channels_last one (the same memory)."""
    xf = engine.centered(x)
    if xf.dim() == 4 and xf.is_contiguous(memory_format=torch.channels_last):
        g = engine.channels_last(g)
        if xf.shape[1] == 1 and xf.stride(1) != 1:
            xf = xf.as_strided(xf.shape, (xf.stride(0), 1, xf.stride(2), xf.stride(3)))
    return _conv_wgrad(xf, g, w_shape, geom).mul_(x.scale)


def linear_wgrad_from_codes(x: Codes, g: Tensor) -> Tensor:
    """``g.T @ x_hat`` as ``scale * g.T @ (codes - zp)``."""
    return (g.t() @ x.centered()).mul_(x.scale)


_PLANS: dict[str, KernelPlan] = {}
_PLANS_LOCK = threading.Lock()


def default_plan(device: torch.device | str) -> KernelPlan:
    """The process-wide plan of ``device`` (all kernels; shared by every layer that was given no plan), whose
    verdicts the host's other processes share (host_record.py)."""
    key = str(torch.device(device))
    with _PLANS_LOCK:
        if key not in _PLANS:
            _PLANS[key] = KernelPlan(device, record=HostRecord.for_device(torch.device(device)))
        return _PLANS[key]
