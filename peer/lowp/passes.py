"""Fused quantization passes of the int8 mode (docs/method.md#8-bit-local-training numerics,
docs/design.md#int8-kernels): each quantization is one function of qmath.py, compiled or run eagerly.

The reference quantizer (quantize.py, used by sim8) runs range, scale, round, clamp and cast as separate full-size
tensor ops. With inductor (a C++ compiler on CPU, Triton on CUDA) each pass becomes one reduction kernel plus one
elementwise kernel (graphs.py); where compiling is impossible (no compiler on a Raspberry Pi), not wanted
(compile_policy.py) or fails, the same functions run eagerly (their eager twins, twins.py). The choice is made once,
at first use, by compiling a small case and checking it against the eager result; it is logged and reported.
Compiled graphs come from inductor just in time, or from the host's ahead-of-time store (aot_graphs.py), compiled
there by the process that needs them (``LPDL_LOWP_AOT=1``) or by a background process while the passes run eagerly
(``LPDL_LOWP_AOT=background``: the check then runs on the stored graphs once they are there).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from peer.lowp.aot_graphs import AotGraphs, aot_mode, graph_name, graph_ready
from peer.lowp.compile_policy import AOT_BACKGROUND, ENV_EAGER, operator_eager_reason, small_memory_reason
from peer.lowp.compiler_env import use_per_cpu_cache
from peer.lowp.counter_rng import sr_seed
from peer.lowp.graphs import Compiler, StaticGraphs, compile_graph
from peer.lowp.host_record import HostRecord
from peer.lowp.kinds import STORE_FILLING, STORE_NOT_PREPARED
from peer.lowp.qmath import (
    Codes,
    act_batch_codes,
    act_range_codes,
    centered,
    dequant_sum,
    grad_codes_hashed,
    gradient_codes_of,
    grid,
    to_channels_last,
    weight_codes_of,
)
from peer.lowp.torch_patches import use_fast_byte_loads
from peer.lowp.twins import (
    eager_body,
    raceable_twin,
)

log = logging.getLogger(__name__)

#: The host record's key (host_record.py) of the small-case check: once it passed on this host - CPU, torch and code
#: unchanged - later processes skip it. The check traces and loads three graphs: 7-10 s of each daemon's start in a
#: 4-daemon fleet on 2 cores, warm compile cache and all (bench/RESULTS-fleet.md). Only a pass is kept; a failure is
#: checked again by every process (a compiler installed since then is found).
CHECK_KEY = "quantization passes compiled bit-exact"

@dataclass(frozen=True)
class PassInfo:
    """Which implementation the quantization passes use, and why."""

    path: str  # "compiled" | "eager"
    reason: str
    label: str = ""  # what runs where ``path`` alone does not say it (background mode), for the log and records

    @property
    def kind(self) -> str:
        """What runs: the path, or the label where there is one."""
        return self.label or self.path


class FusedPasses:
    """The quantization passes of one precision config (PrecisionConfig.passes: every layer of a model built with it
    shares them), compiled (checked at first use) or eager.

    ``run(name, fn, *args)`` calls ``fn`` compiled (inductor, one graph per argument signature, created on first
    use) when the compiled path is in use, else eagerly. A compiled function that raises (a shape or op the compiler
    rejects) runs eagerly from then on; the fallback is logged and listed in ``fallbacks``.
    """

    def __init__(self, try_compile: bool = True, eager_why: str = "eager requested") -> None:
        self._lock = threading.Lock()
        self._info: PassInfo | None = None if try_compile else PassInfo("eager", eager_why)
        self._compiled: dict[str, StaticGraphs] = {}
        self.fallbacks: dict[str, str] = {}
        self.aot: AotGraphs | None = None  # the host's ahead-of-time graphs, where asked for (aot_graphs.py)
        self.background = False  # the store's graphs filled by a background process, none compiled here
        self._checked = False  # background mode: the stored graphs passed the bit-exactness check
        #: Why compiled passes cannot be used here: the small-case check failed (no C++ compiler, a disagreement);
        #: in background mode every pass then stays eager.
        self.check_failure: str | None = None

    def __deepcopy__(self, memo: dict) -> FusedPasses:
        """Shared, not copied: a copied model (peer replicas, evaluation copies) uses the same compiled graphs."""
        return self

    @property
    def info(self) -> PassInfo:
        """The path in use; decides it (compiling a small case) on first access."""
        with self._lock:
            if self._info is None:
                self._info = self._decide()
                (log.info if self._info.path == "compiled" else log.warning)(
                    "int8 quantization passes: %s (%s)", self._info.path, self._info.reason)
            return self._info

    @property
    def compiled(self) -> bool:
        """True when the compiled path is in use."""
        return self.info.path == "compiled"

    def waiting_graphs(self) -> int:
        """Background mode: the pass signatures met so far whose stored graph does not run yet (their eager passes
        stand in until the filler has compiled them); 0 in every other mode."""
        if not self.background:
            return 0
        return sum(g.waiting() for g in list(self._compiled.values()))

    def _decide(self) -> PassInfo:
        forced = operator_eager_reason()
        if forced is not None:
            return PassInfo("eager", forced)
        mode = aot_mode()
        small = small_memory_reason()  # no compiler here: stored graphs are still loaded in background mode
        if small is not None and mode != AOT_BACKGROUND:
            return PassInfo("eager", small)
        self.aot = AotGraphs.for_host() if mode else None
        if mode == AOT_BACKGROUND:
            if self.aot is None:
                return PassInfo("eager", "ahead-of-time store unavailable, and background mode compiles nothing here")
            self.background = True
            self.aot.load_only = small is not None
            store = f"ahead of time, stored in {self.aot.directory}"
            missing = (f"a graph not stored runs eagerly and is not compiled beside this process ({small}; "
                       "`lpdl-peer prepare` stores them)" if small else
                       "a graph not stored yet runs eagerly until a background process has compiled it")
            if self._stored_graphs_checked():
                return PassInfo("compiled", f"{store}; checked bit-exact against eager on a small case; {missing}",
                                "compiled ahead of time")
            if self.check_failure is not None:
                return PassInfo("eager", f"{store}; its graphs failed the bit-exactness check: {self.check_failure}")
            if small:
                return PassInfo("compiled", f"{store}; every pass runs eagerly: the store holds no checked graphs, "
                                            f"and {missing}", STORE_NOT_PREPARED)
            return PassInfo("compiled", f"{store} by a background process; every pass runs eagerly until the "
                                        "store's graphs are checked bit-exact against eager",
                            STORE_FILLING)
        # the store's set-up names no compiler: a process whose graphs are all stored never imports it
        setup = f"compiled ahead of time, stored in {self.aot.directory}" if self.aot else self._compiler_setup()
        checked = f"inductor-compiled passes checked bit-exact against eager on a small case ({setup})"
        with HostRecord.for_device(torch.device("cpu")).slot(f"{CHECK_KEY} ({setup})") as slot:
            label = "compiled ahead of time" if self.aot else ""
            if slot.value is not None and slot.value.get("exact") is True:
                return PassInfo("compiled", f"{checked} [host probe record]", label)
            failure = self._check_small_case(self.aot.graph if self.aot else compile_graph)
            if failure is not None:
                self.check_failure = failure
                return PassInfo("eager", failure)
            slot.save({"exact": True})
        return PassInfo("compiled", checked, label)

    def _stored_graphs_checked(self) -> bool:
        """Background mode: whether the store's graphs passed the small-case check - by the host record, or now,
        where the check's graphs are stored (else they are queued, and the check runs at a later look)."""
        if self._checked or self.check_failure is not None:
            return self._checked
        assert self.aot is not None
        aot = self.aot
        key = f"{CHECK_KEY} (compiled ahead of time, stored in {aot.directory})"
        record = HostRecord.for_device(torch.device("cpu"))
        verdict = record.peek(key)
        if verdict is None or verdict.get("exact") is not True:
            missing = [(graph_name(fn, args), fn, args) for _, fn, args in _small_cases()]
            missing = [(name, fn, args) for name, fn, args in missing if not aot.holds(name)]
            if missing:
                for name, fn, args in missing:
                    aot.queue(fn, args, name)
                return False
            with record.slot(key) as slot:
                if slot.value is None or slot.value.get("exact") is not True:
                    failure = self._check_small_case(lambda fn, args: _require(aot.stored(graph_name(fn, args))))
                    if failure is not None:
                        log.warning("int8 quantization passes stay eager: %s", failure)
                        self.check_failure = failure
                        return False
                    slot.save({"exact": True})
        self._checked = True
        return True

    @staticmethod
    def _check_small_case(compiler: Compiler) -> str | None:
        """Compile each kind of pass on a small case with ``compiler`` and compare it with the eager result, bit for
        bit; why the compiled path cannot be used, or None if it can."""
        try:
            for name, fn, args in _small_cases():
                got, want = compiler(fn, args)(args), fn(*args)  # the graph itself, never its twin
                if not all(torch.equal(a, b) for a, b in zip(got, want)):
                    return f"compiled {name} disagreed with eager; not used"
        except Exception as exc:  # no compiler, unsupported platform: any failure means eager
            return f"torch.compile unavailable: {type(exc).__name__}: {str(exc)[:200]}"
        return None

    @staticmethod
    def _compiler_setup() -> str:
        """The per-CPU cache (compiler_env.py) and the AVX2 byte loads (torch_patches.py); what was set up, for the
        log. A failure here is logged and leaves inductor's defaults: the compiled path is still checked and used."""
        try:
            isa, cache = use_per_cpu_cache()
            byte_loads = ", byte loads direct" if use_fast_byte_loads() and isa == "avx2" else ""
            return f"vector ISA {isa or 'none'}{byte_loads}; cache {cache}"
        except Exception as exc:
            log.warning("inductor set-up skipped (%s: %s): its defaults are used", type(exc).__name__, exc)
            return "inductor defaults"

    def _compile(self, name: str, fn: Callable) -> StaticGraphs:
        """``fn`` compiled per argument signature (static shapes: kernels specialised per shape were 3-10x faster than
        dynamic-shape ones here); see :class:`StaticGraphs`."""
        if name not in self._compiled:
            if self.background:
                assert self.aot is not None
                aot = self.aot

                def compiler(fn: Callable, args: tuple[object, ...]) -> Callable:
                    return aot.background_graph(fn, args, usable=self._stored_graphs_checked)
                self._compiled[name] = StaticGraphs(fn, raceable_twin(fn), name, compiler, ready=graph_ready)
            else:
                self._compiled[name] = StaticGraphs(fn, raceable_twin(fn), name,
                                                    self.aot.graph if self.aot else None)
        return self._compiled[name]

    def run(self, name: str, fn: Callable, *args):
        """``fn(*args)``, compiled if the compiled path is in use and ``name`` has not failed before, else eagerly
        (its eager twin where it has one)."""
        if self.compiled and name not in self.fallbacks:
            try:
                return self._compile(name, fn)(*args)
            except Exception as exc:
                reason = f"{type(exc).__name__}: {str(exc)[:200]}"
                log.warning("compiled %s failed, running it eagerly from now on: %s", name, reason)
                self.fallbacks[name] = reason
        return eager_body(fn)(*args)

    def ready(self, name: str, fn: Callable, *args) -> bool:
        """Whether ``run(name, fn, *args)`` would run a compiled graph: for a pass that only the compiled path uses
        (its eager stand-in is slower than the eager path's own formula). False in background mode until the
        store holds that graph, which this asks for. Not for a pass with a raceable twin: in background mode its
        signatures wait for their graph behind a wrapper that this would read as ready."""
        if not self.compiled or name in self.fallbacks:
            return False
        graphs = self._compile(name, fn)
        assert graphs.rival is None, f"ready() asked of {name}, a pass with a raceable eager twin"
        return not self.background or graph_ready(graphs.graph_for(args))

    def activation(self, x: Tensor, bits: int, lo: Tensor | None = None, hi: Tensor | None = None,
                   channels_last: bool = False) -> tuple[Codes, Tensor, Tensor]:
        """Asymmetric nearest-rounding codes of ``x``: batch range if ``lo``/``hi`` are None, else [lo, hi].

        Returns the codes (channels_last if asked and ``x`` is 4-D) and the range used (the batch range, for the
        running estimate).
        """
        qmin, qmax = grid(bits, symmetric=False)
        x = x.detach()
        channels_last = channels_last and x.dim() == 4
        if lo is None or hi is None:
            data, scale, zp, lo, hi = self.run("act_batch", act_batch_codes, x, qmin, qmax, channels_last)
        else:
            data, scale, zp = self.run("act_range", act_range_codes, x, lo, hi, qmin, qmax, channels_last)
        return Codes(data, scale, zp, qmin, qmax), lo, hi

    def gradient(self, g: Tensor, bits: int, channels_last: bool = False) -> Codes:
        """Symmetric stochastic-rounding codes of a layer gradient (uint8, zero point 128)."""
        _, qmax = grid(bits, symmetric=True)
        channels_last = channels_last and g.dim() == 4
        data, scale = self.run("grad_sr", grad_codes_hashed, g, sr_seed(g.device), qmax, channels_last)
        return gradient_codes_of(data, scale, bits)

    def centered(self, codes: Codes) -> Tensor:
        """fp32 ``codes.data - codes.zero_point`` (exact integers), in the codes' layout, one pass."""
        return self.run("centered", centered, codes.data, codes.zero_point)

    def channels_last(self, t: Tensor) -> Tensor:
        """4-D ``t`` in channels_last layout (itself if it already is)."""
        if t.dim() != 4 or t.is_contiguous(memory_format=torch.channels_last):
            return t
        return self.run("to_channels_last", to_channels_last, t)

    def dequant_sum(self, a: Codes, b: Codes) -> Tensor:
        """Sum of the values of two code tensors of the same shape (one pass)."""
        return self.run("dequant_sum", dequant_sum, a.data, a.scale, a.zero_point, b.data, b.scale, b.zero_point)



def _require(graph: Callable | None) -> Callable:
    if graph is None:
        raise RuntimeError("a stored graph of the check became unusable")
    return graph


def _small_cases() -> list[tuple[str, Callable, tuple[object, ...]]]:
    """The bit-exactness check's cases: each kind of pass (batch range, stochastic rounding, byte loads)."""
    x = torch.linspace(-3.0, 5.0, 2 * 3 * 4 * 4).reshape(2, 3, 4, 4)
    seed = torch.tensor([12345, -67890], dtype=torch.int32)
    codes = torch.arange(2 * 3 * 5 * 5, dtype=torch.int32).mul_(37).remainder_(256).to(torch.uint8)
    codes = codes.reshape(2, 3, 5, 5)  # 150 codes: whole 8- and 16-lane byte loads and a tail
    return [("act_batch", act_batch_codes, (x, -128, 127, True)),
            ("grad_sr", grad_codes_hashed, (x, seed, 127, True)),
            ("centered", centered, (codes, torch.tensor(131.0)))]


def weight_codes(w: Tensor, bits: int, engine: FusedPasses) -> Codes:
    """Symmetric nearest-rounding int8 codes of a weight (a small tensor: one compiled call instead of six eager
    ones, where ``engine``'s passes are compiled)."""
    qmin, qmax = grid(bits, symmetric=True)
    data, scale = engine.run("weight_codes", weight_codes_of, w.detach(), qmin, qmax)
    return Codes(data, scale, torch.zeros_like(scale), qmin, qmax)


def passes_for(why_eager: str | None = None) -> FusedPasses:
    """New passes for one precision config: eager for ``why_eager`` (a reason to skip the compiler, such as a
    converted model's many shapes) unless the operator asked to compile (LPDL_LOWP_EAGER=0), else compiled where
    this process may compile (decided at first use)."""
    if why_eager is None or os.environ.get(ENV_EAGER) == "0" or operator_eager_reason() is not None:
        return FusedPasses()
    return FusedPasses(try_compile=False, eager_why=why_eager)
