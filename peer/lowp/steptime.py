"""The int8 training step timed against fp32 on the model's own shapes (issue 9: int8 never silently slower).

The kernel probe (plan.py) times the products alone; a training step also runs the quantization passes, the norms
recomputed from codes and the fp32 weight gradients, and eagerly (no compiler) those can cost more than the products
save. So the verdict that the log and ``status`` give is a measured step: at the second training forward pass of a
model built with a :class:`StepCheck` (the first one has probed the kernels for the model's shapes, so the copies
below do not probe again, and that first step runs exactly as without the check), a copy of the int8 model and an
fp32 model of the same architecture each run one warm-up and ``steps`` timed forward+backward passes, interleaved,
on a random input of that forward's shape (under a forked RNG: the training's random stream is untouched). Measured
once per process (every replica of the model shares the check); its wall time is reported as ``measure_s``. The
fp32 step holds fp32's working set once (MNIST CNN batch 32: ~25 MiB more peak RSS than the int8 steps); freed heap
memory is handed back to the OS afterwards, or tcmalloc (what ``lpdl-peer start`` preloads) would keep it for the
daemon's whole life. With a host probe record (host_record.py) the verdict is measured once per host, model
architecture, input shape, quantizer path and thread count, and read by every later process: no fp32 twin, no
extra peak. A step measured while the path is not yet the one its key names - in the store's background mode, pass
graphs still being compiled and their eager passes standing in - is recorded as unsettled: read by processes
that meet the same state, measured again by the first one whose graphs are all there. The README fleet's second
run on a new store of an AMD EPYC (Zen 4) queued one graph, measured 1.36x fp32 with the filler starting beside
it, and every later daemon of the host read "int8 is SLOWER" where the settled path measures 0.62-0.68x.
"""

from __future__ import annotations

import copy
import gc
import hashlib
import logging
import math
import statistics
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from peer.heap import trim_heap
from peer.lowp.host_record import HostRecord

log = logging.getLogger(__name__)

#: Timed forward+backward passes per mode (median), after one untimed warm-up each.
DEFAULT_STEPS = 3
#: The training forward pass (counted over all replicas) at which the step is measured.
MEASURE_AT_FORWARD = 2
#: A recorded step's field: False where it was measured before its path settled (module docstring).
SETTLED = "settled"


@dataclass(frozen=True)
class StepTiming:
    """Median forward+backward time (ms) of the int8 model and of its fp32 twin on one input shape."""

    int8_ms: float
    fp32_ms: float
    input_shape: tuple[int, ...]
    measure_s: float  # wall time of the whole measurement (copies, warm-ups, timed passes)
    recorded: bool = False  # read from the host's probe record, measured by an earlier process

    @classmethod
    def from_record(cls, value: Mapping[str, Any] | None, input_shape: tuple[int, ...]) -> StepTiming | None:
        """The timing a probe-record entry (:meth:`to_dict`) holds, or None if it holds no usable one."""
        if value is None:
            return None
        try:
            int8_ms, fp32_ms, measure_s = float(value["int8_ms"]), float(value["fp32_ms"]), float(value["measure_s"])
        except (KeyError, TypeError, ValueError):
            return None
        if not all(math.isfinite(t) and t > 0 for t in (int8_ms, fp32_ms)):
            return None
        return cls(int8_ms, fp32_ms, input_shape, measure_s, recorded=True)

    @property
    def ratio(self) -> float:
        """int8 step time / fp32 step time (> 1: int8 slower)."""
        return self.int8_ms / self.fp32_ms

    @property
    def slower(self) -> bool:
        """True when the int8 step took longer than the fp32 one."""
        return self.ratio > 1.0

    def verdict(self) -> str:
        """One clause for the log and the precision summary: the measured ratio and what it means."""
        shape = "x".join(str(d) for d in self.input_shape)
        text = (f"training step {self.ratio:.2f}x fp32 time ({self.int8_ms:.1f} vs {self.fp32_ms:.1f} ms forward+"
                f"backward, this model, input {shape})")
        if self.slower:
            return (text + ": int8 is SLOWER than fp32 on this machine, kept for its memory saving (1-byte "
                           "activations saved for backward)")
        return text + ": int8 not slower than fp32 here"

    def to_dict(self) -> dict[str, object]:
        return {"ratio": round(self.ratio, 3), "int8_ms": round(self.int8_ms, 2), "fp32_ms": round(self.fp32_ms, 2),
                "input_shape": list(self.input_shape), "measure_s": round(self.measure_s, 2),
                "recorded": self.recorded}


def _forward_backward(model: nn.Module, x: Tensor) -> None:
    model.zero_grad(set_to_none=True)
    model(x).float().square().mean().backward()


def time_steps(models: list[nn.Module], x: Tensor, steps: int,
               clock: Callable[[], float] = time.perf_counter) -> list[float]:
    """Median seconds of one forward+backward pass of each model on ``x``: one warm-up each, then ``steps`` rounds
    interleaved (every model sees the same background load)."""
    for model in models:
        _forward_backward(model, x)
    times: list[list[float]] = [[] for _ in models]
    for _ in range(steps):
        for model, spent in zip(models, times):
            start = clock()
            _forward_backward(model, x)
            spent.append(clock() - start)
    return [statistics.median(spent) for spent in times]


class StepCheck:
    """Measures, once, the int8 step time against fp32 at a model's second training forward (module docstring).

    ``timer(int8_model, fp32_model, x)`` returns the two median step times in seconds (injectable: tests pass fixed
    timings); ``result`` holds the :class:`StepTiming` once measured, None before. ``record`` shares the verdict
    with the host's other processes, under a key made of the model's architecture, the input shape, the thread
    count and ``context`` (what else decides the step's speed: the quantizers' path). ``waiting()`` counts what
    still keeps the path from being the one ``context`` names (pass graphs not compiled yet): a step measured while
    it is above 0 is recorded as unsettled, and measured again by the first process that finds it at 0.
    """

    def __init__(self, steps: int = DEFAULT_STEPS,
                 timer: Callable[[nn.Module, nn.Module, Tensor], list[float]] | None = None,
                 record: HostRecord | None = None, context: str = "",
                 waiting: Callable[[], int] = lambda: 0) -> None:
        self.steps = steps
        self.record, self.context, self.waiting = record, context, waiting
        self._timer = timer or (lambda a, b, x: time_steps([a, b], x, self.steps))
        self._lock = threading.Lock()
        self._forwards = 0  # training forward passes seen
        self._started = False
        self.result: StepTiming | None = None

    def __deepcopy__(self, memo: dict) -> StepCheck:
        """Shared, not copied (as the kernel plan): one measurement for every replica of the model."""
        return self

    def attach(self, model: nn.Module, make_fp32: Callable[[], nn.Module]) -> None:
        """Measure at the second training forward pass of ``model`` (or a copy of it); ``make_fp32`` builds its fp32
        twin (the same layers in fp32)."""
        check = self

        def training_forward(module: nn.Module, args: tuple) -> None:
            if not (module.training and torch.is_grad_enabled() and args) or check._started:
                return
            with check._lock:
                check._forwards += 1
                due = check._forwards >= MEASURE_AT_FORWARD
            if due:
                check.measure(module, make_fp32, args[0])

        model.register_forward_pre_hook(training_forward)

    def measure(self, model: nn.Module, make_fp32: Callable[[], nn.Module], like: Tensor) -> StepTiming | None:
        """Time a copy of ``model`` and its fp32 twin on a random input shaped as ``like`` - or read the host
        record's timing of the same case (once; later calls and calls made while measuring return the result or
        None)."""
        with self._lock:
            if self._started:
                return self.result
            self._started = True
        unsettled = 0
        if self.record is None:
            self.result = self._measure_now(model, make_fp32, like)
        else:
            with self.record.slot(self._record_key(model, like)) as slot:
                value = slot.value
                self.result = StepTiming.from_record(value, tuple(like.shape))
                if self.result is not None and value is not None and value.get(SETTLED) is False \
                        and self.waiting() == 0:
                    self.result = None  # measured before the path settled, and it has settled since
                if self.result is None:
                    self.result = self._measure_now(model, make_fp32, like)
                    unsettled = self.waiting()
                    slot.save({**self.result.to_dict(), SETTLED: not unsettled})
        how = ("read from the host probe record" if self.result.recorded
               else f"measured in {self.result.measure_s:.1f} s")
        if unsettled:
            how += (f" with {unsettled} pass graph(s) still compiling in the background, their eager passes standing "
                    "in: measured again once they are all compiled")
        (log.warning if self.result.slower else log.info)("precision: int8 %s (%s)", self.result.verdict(), how)
        return self.result

    def _record_key(self, model: nn.Module, like: Tensor) -> str:
        architecture = hashlib.sha256(repr(model).encode())
        for name, p in model.named_parameters():
            architecture.update(f"{name} {tuple(p.shape)} {p.dtype}".encode())
        return (f"step {like.device} {tuple(like.shape)} {like.dtype} threads {torch.get_num_threads()} "
                f"{self.context} model {architecture.hexdigest()[:24]}")

    def _measure_now(self, model: nn.Module, make_fp32: Callable[[], nn.Module], like: Tensor) -> StepTiming:
        start = time.perf_counter()
        devices = [like.device.index or 0] if like.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            int8_model = copy.deepcopy(model).train()
            fp32_model = make_fp32().to(like.device).train()
            x = torch.randn(like.shape, dtype=like.dtype, device=like.device)
            int8_s, fp32_s = self._timer(int8_model, fp32_model, x)
            del int8_model, fp32_model, x
        gc.collect()
        trim_heap()
        return StepTiming(int8_s * 1e3, fp32_s * 1e3, tuple(like.shape), time.perf_counter() - start)
