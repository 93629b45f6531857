"""Fused quantization passes of the int8 mode (docs/method.md#8-bit-local-training numerics, docs/design.md#int8-kernels
"fuse it").

The reference quantizer (quantize.py, used by sim8) runs range, scale, round, clamp and cast as separate full-size
tensor ops. Here each quantization is one function: with torch.compile (a C++ compiler on CPU, Triton on CUDA) it
becomes one reduction kernel plus one elementwise kernel; where compiling is impossible (no compiler on a Raspberry
Pi) or fails, the same functions run eagerly. The choice is made once, at first use, by compiling a small case and
checking it against the eager result; it is logged and reported by ``describe()``.

Code formats (what the int8 kernels consume, see kernels.py):

* activations (asymmetric): ``uint8`` codes ``u = c + 128`` where ``c`` is the signed code of quantize.py, with
  zero point ``zp + 128``; value ``(u - zero_point) * scale``.
* layer gradients (symmetric, stochastic rounding): ``uint8`` codes ``u = c + 128``, zero point 128.
* weights (symmetric, nearest): ``int8`` codes ``c``, zero point 0.

Stochastic rounding uses no full-size fp32 random tensor: compiled, the uniform draw is a counter-based hash of the
element index and a per-call seed taken from torch's generator (so runs repeat under ``torch.manual_seed``), computed
inside the kernel; eagerly, ``torch.rand`` fills one chunk of at most ``_SR_CHUNK`` elements at a time.

Eager twins: run eagerly, a pass body written as a chain of out-of-place ops allocates one full-size fp32 temporary
per op (memory traffic, and a step's peak working set: the eager int8 MNIST CNN step held 1.27x fp32's), where the
compiler fuses the same chain into one kernel. A body may therefore have an eager twin (``eager_twin``), used
instead of it on the eager path: the same operations in the same order, so the same bits (the tests check every
twin against its body run eagerly), but in place in one buffer, with casts and layout changes folded into an op.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from peer.lowp.compiler_env import use_fast_byte_loads, use_per_cpu_cache
from peer.lowp.layout import is_channels_last
from peer.lowp.quantize import batch_range
from peer.lowp.timing import fastest_times

log = logging.getLogger(__name__)

CODE_OFFSET = 128  # uint8 code = signed code + 128
_TINY_SCALE = 1e-12  # as quantize.py: all-zero tensors get a tiny positive scale
_SR_CHUNK = 1 << 16  # eager stochastic rounding: random numbers drawn per chunk of this many elements
_RACE_REPS = 3  # timed runs of a compiled graph and of its eager twin at a signature's first call (after a warm-up)
_EAGER_MARGIN = 0.9  # the eager twin replaces a compiled graph only if >= 10% faster (timing noise on shared cores)
_ENV_EAGER = "LPDL_LOWP_EAGER"  # 1: skip torch.compile; 0: compile even on a small machine (README "Precision")
#: Below this much physical memory (MiB) the passes run eagerly unless LPDL_LOWP_EAGER=0: torch.compile's stack
#: (dynamo, inductor, sympy, the generated kernels) stays resident, +180-240 MiB per process measured on a solo
#: mnist-cnn daemon (bench/RESULTS-fleet.md) - a tenth of a 2 GB board - for rounds about 2x shorter.
COMPILE_MIN_MEMORY_MIB = 4096


@dataclass(frozen=True)
class Codes:
    """A quantized tensor: integer ``data`` plus per-tensor ``scale`` and ``zero_point`` (0-d fp32 tensors).

    Value ``(data - zero_point) * scale``; ``qmin``/``qmax`` bound the signed code (``data - CODE_OFFSET`` for uint8).
    """

    data: Tensor
    scale: Tensor
    zero_point: Tensor
    qmin: int
    qmax: int

    def centered(self) -> Tensor:
        """fp32 integers ``data - zero_point`` (exact: |value| <= 255), eagerly (FusedPasses.centered compiles it)."""
        return _centered_eager(self.data, self.zero_point)


def physical_memory_mib(meminfo: str = "/proc/meminfo", cgroup: str = "/proc/self/cgroup",
                        cgroup_root: str = "/sys/fs/cgroup") -> float:
    """Memory this process may use (MiB): MemTotal, or its cgroup's memory.max where lower (a systemd unit's
    MemoryMax=, a container's limit; cgroup v2). 0 where unknown (not Linux)."""
    total = 0.0
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    total = int(line.split()[1]) / 1024
                    break
        with open(cgroup) as f:
            paths = [line.strip()[3:] for line in f if line.startswith("0::")]
        if paths:
            with open(os.path.join(cgroup_root, paths[0].lstrip("/"), "memory.max")) as f:
                limit = f.read().strip()
            if limit.isdigit():
                total = min(total, int(limit) / 2**20) if total else int(limit) / 2**20
    except OSError:
        pass
    return total


_EAGER_TWINS: dict[Callable, Callable] = {}
_RACEABLE: set[Callable] = set()  # bodies whose twin equals the COMPILED body too (StaticGraphs may race them)


def eager_twin(body: Callable, same_as_compiled: bool = False) -> Callable[[Callable], Callable]:
    """Register the decorated function as ``body``'s eager twin (see the module docstring): what ``FusedPasses.run``
    calls instead of ``body`` when the passes run eagerly. It must return ``body``'s results run eagerly, bit for bit.

    ``same_as_compiled``: the twin also equals the compiled ``body`` by construction - integer arithmetic, max and
    selections, exact fp32 operations only; no reductions or chains whose rounding a compiler may reorder or fuse (a
    compiled norm pass differs from its twin by ~5e-7 after a sum in another order) - and draws no random numbers.
    Only then may the compiled graph and the twin race for speed (StaticGraphs), so the results never depend on
    which one won."""
    def register(twin: Callable) -> Callable:
        _EAGER_TWINS[body] = twin
        if same_as_compiled:
            _RACEABLE.add(body)
        return twin
    return register


def eager_body(body: Callable) -> Callable:
    """What runs for ``body`` on the eager path: its twin if it has one, else itself."""
    return _EAGER_TWINS.get(body, body)


def _grid(bits: int, symmetric: bool) -> tuple[int, int]:
    half = 2 ** (bits - 1)
    return (-(half - 1), half - 1) if symmetric else (-half, half - 1)


# ---- the pass bodies: plain tensor functions, compiled or run eagerly ----------------------------------------------

def _layout(codes: Tensor, channels_last: bool) -> Tensor:
    """Codes in the layout their consumer wants: channels_last for convolutions (what oneDNN's int8 convolution
    reads fastest), contiguous NCHW for the norms (per-group reductions are slow across channels_last strides)."""
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    return codes.contiguous(memory_format=fmt)


def _empty_in_layout(like: Tensor, channels_last: bool, dtype: torch.dtype = torch.float32) -> Tensor:
    """An uninitialised tensor of ``like``'s shape in the layout ``_layout`` gives: an op writing into it (``out=``)
    converts the layout while it computes, instead of a separate transposing copy."""
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    return torch.empty(like.shape, dtype=dtype, device=like.device, memory_format=fmt)


def _act_qparams(lo: Tensor, hi: Tensor, qmin: int, qmax: int) -> tuple[Tensor, Tensor]:
    """Step and signed zero point of the asymmetric grid of [lo, hi] widened to contain 0 (quantize.py's formulas)."""
    scale = ((hi.clamp(min=0.0) - lo.clamp(max=0.0)) / (qmax - qmin)).clamp_min(_TINY_SCALE)
    zero_point = (qmin - torch.round(lo.clamp(max=0.0) / scale)).clamp(qmin, qmax)
    return scale, zero_point


def _act_range_codes(x: Tensor, lo: Tensor, hi: Tensor, qmin: int, qmax: int,
                     channels_last: bool) -> tuple[Tensor, Tensor, Tensor]:
    """uint8 codes of ``x`` on the asymmetric grid of [lo, hi] (widened to contain 0); quantize.py's formulas."""
    scale, zero_point = _act_qparams(lo, hi, qmin, qmax)
    codes = (torch.round(x / scale) + zero_point).clamp(qmin, qmax) + CODE_OFFSET
    return _layout(codes.to(torch.uint8), channels_last), scale, zero_point + CODE_OFFSET


@eager_twin(_act_range_codes)
def _act_range_codes_eager(x: Tensor, lo: Tensor, hi: Tensor, qmin: int, qmax: int,
                           channels_last: bool) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`_act_range_codes` in one fp32 buffer of the output layout: divide into it, then round, shift and clamp
    in place (zero point and code offset added at once: all integers below 2^24, so exact) and cast straight to
    uint8 (integers in [0, 255] after the clamp: the cast is exact, no int32 step)."""
    scale, zero_point = _act_qparams(lo, hi, qmin, qmax)
    offset = zero_point + CODE_OFFSET
    codes = torch.div(x, scale, out=_empty_in_layout(x, channels_last))
    codes.round_().add_(offset).clamp_(qmin + CODE_OFFSET, qmax + CODE_OFFSET)
    return codes.to(torch.uint8), scale, offset


def _batch_codes_with(range_codes: Callable, x: Tensor, qmin: int, qmax: int,
                      channels_last: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Range = batch mean of per-sample min and max (docs/method.md#8-bit-local-training), then ``range_codes`` on it;
    also the range."""
    lo, hi = batch_range(x)
    codes, scale, zero_point = range_codes(x, lo, hi, qmin, qmax, channels_last)
    return codes, scale, zero_point, lo, hi


def _act_batch_codes(x: Tensor, qmin: int, qmax: int,
                     channels_last: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Training: the codes of ``x`` on its batch range (docs/method.md#8-bit-local-training); also returns the range."""
    return _batch_codes_with(_act_range_codes, x, qmin, qmax, channels_last)


@eager_twin(_act_batch_codes)
def _act_batch_codes_eager(x: Tensor, qmin: int, qmax: int,
                           channels_last: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """:func:`_act_batch_codes` with the codes of :func:`_act_range_codes_eager`."""
    return _batch_codes_with(_act_range_codes_eager, x, qmin, qmax, channels_last)


def _shr32(h: Tensor, bits: int) -> Tensor:
    """Logical right shift of the 32-bit patterns held in int32 ``h`` (torch's ``>>`` on int32 is arithmetic)."""
    return (h >> bits) & ((1 << (32 - bits)) - 1)


def _mix32(h: Tensor) -> Tensor:
    """A 32-bit integer hash (xor-shift-multiply, constants from Wellons' hash prospector) on int32 lanes holding
    32-bit patterns; products wrap modulo 2^32 (two's complement, the same in eager ATen, inductor's C++ and Triton).

    int32, not int64: AVX2 and NEON have no 64-bit vector multiply, so ATen's vector code emulates an int64 product
    lane by lane; the int64 form of this hash took 1.83 ms per 512K elements compiled for AVX2, this one 0.35 ms
    (0.50 -> 0.36 ms with AVX-512), the same bits."""
    h = h ^ _shr32(h, 16)
    h = h * 0x21F0AAAD
    h = h ^ _shr32(h, 15)
    h = h * 0x735A2D97
    return h ^ _shr32(h, 15)


def hash_uniform(shape: torch.Size, seed: Tensor, device: torch.device) -> Tensor:
    """Uniform [0, 1) fp32 with 24 random bits per element: a hash of (element index, 64-bit ``seed``: two int32)."""
    idx = torch.arange(shape.numel(), dtype=torch.int32, device=device).reshape(shape)
    h = _mix32(_mix32(idx ^ seed[0]) ^ seed[1])
    return _shr32(h, 8).to(torch.float32) * (1.0 / (1 << 24))


def grad_codes_hashed(g: Tensor, seed: Tensor, qmax: int, channels_last: bool) -> tuple[Tensor, Tensor]:
    """Symmetric stochastic-rounding codes of ``g`` (uint8, zero point 128), uniform draws from ``hash_uniform``."""
    scale = (g.abs().amax() / qmax).clamp_min(_TINY_SCALE)
    noise = hash_uniform(g.shape, seed, g.device)
    codes = torch.floor(g / scale + noise).clamp(-qmax, qmax) + CODE_OFFSET
    return _layout(codes.to(torch.uint8), channels_last), scale


def _blocks(shape: tuple[int, ...], limit: int) -> Iterator[tuple[slice, ...]]:
    """Index tuples of consecutive blocks of a tensor of ``shape``, in its logical (row-major) order, each of at
    most ``limit`` elements where one innermost row fits (whole leading-dim slices where they fit, else recursing
    into a slice's own leading dim), so a block of any layout is a view."""
    if not shape:
        yield ()
        return
    inner = math.prod(shape[1:])
    if inner <= limit:
        step = max(1, limit // max(inner, 1))
        for start in range(0, shape[0], step):
            yield (slice(start, start + step),)
        return
    for i in range(shape[0]):
        for rest in _blocks(shape[1:], limit):
            yield (slice(i, i + 1), *rest)


def _abs_max(t: Tensor) -> Tensor:
    """``t.abs().amax()`` without the full-size ``abs`` temporary: max(max, -min), exact (two reductions:
    ``torch.aminmax`` over a whole tensor was 40x slower than ``amax`` here)."""
    return torch.maximum(t.amax(), -t.amin())


def _memory_order(t: Tensor) -> tuple[int, ...]:
    """The dim order in which ``t``'s elements lie in memory (NCHW or channels_last), or its dims in order."""
    if is_channels_last(t):
        return (0, 2, 3, 1)
    return tuple(range(t.dim()))


def _grad_codes_chunked(g: Tensor, qmax: int, channels_last: bool) -> tuple[Tensor, Tensor]:
    """Eager stochastic rounding: ``torch.rand`` one block of at most ``_SR_CHUNK`` elements at a time into one
    reused buffer (no full-size random or fp32 tensor), drawn in ``g``'s memory order (the stream sim8's
    ``rand_like`` draws for ``g``, in either layout), each block written into the output in its layout."""
    scale = (_abs_max(g) / qmax).clamp_min(_TINY_SCALE)
    out = _empty_in_layout(g, channels_last and g.dim() == 4, torch.uint8)
    order = _memory_order(g)
    g = g.permute(order).contiguous()  # a view unless g is neither contiguous nor channels_last
    out = out.permute(order)
    buf = torch.empty(min(g.numel(), _SR_CHUNK), device=g.device)
    for index in _blocks(tuple(g.shape), _SR_CHUNK):
        part = g[index]
        y = torch.rand(part.numel(), out=buf[:part.numel()], device=g.device).view(part.shape)
        y.addcdiv_(part, scale).floor_().clamp_(-qmax, qmax).add_(CODE_OFFSET)  # floor(g / scale + U[0, 1))
        out[index].copy_(y)
    return out.permute(tuple(order.index(d) for d in range(len(order)))), scale


def sr_seed(device: torch.device) -> Tensor:
    """A fresh 64-bit seed of the hashed stochastic rounding as two int32, from torch's generator (runs repeat under
    a seed)."""
    return torch.randint(-2**31, 2**31, (2,), dtype=torch.int32).to(device)


def gradient_codes_of(data: Tensor, scale: Tensor, bits: int) -> Codes:
    """The Codes of symmetric gradient codes ``data`` (uint8, zero point 128) with step ``scale``."""
    qmin, qmax = _grid(bits, symmetric=True)
    return Codes(data, scale, torch.full_like(scale, CODE_OFFSET), qmin, qmax)


def gradient_grid_max(bits: int) -> int:
    """Largest symmetric code of ``bits`` (127 for 8 bits)."""
    return _grid(bits, symmetric=True)[1]


def _centered(data: Tensor, zero_point: Tensor) -> Tensor:
    """fp32 integers ``data - zero_point`` in one pass (the weight gradient's operand), layout kept."""
    return data.float() - zero_point


@eager_twin(_centered, same_as_compiled=True)
def _centered_eager(data: Tensor, zero_point: Tensor) -> Tensor:
    """:func:`_centered` as one op: uint8 minus a 0-d fp32 tensor promotes to fp32 inside the subtraction."""
    return torch.sub(data, zero_point)


def _to_channels_last(t: Tensor) -> Tensor:
    """``t`` in channels_last layout: compiled on its own, the copy is a tiled transpose (2-3x faster than aten's)."""
    return t.contiguous(memory_format=torch.channels_last)


def _dequant_sum(a: Tensor, a_scale: Tensor, a_zp: Tensor, b: Tensor, b_scale: Tensor, b_zp: Tensor) -> Tensor:
    """``(a - a_zp) * a_scale + (b - b_zp) * b_scale`` in one pass (the 8-bit residual add)."""
    return (a.float() - a_zp) * a_scale + (b.float() - b_zp) * b_scale


@eager_twin(_dequant_sum)
def _dequant_sum_eager(a: Tensor, a_scale: Tensor, a_zp: Tensor, b: Tensor, b_scale: Tensor,
                       b_zp: Tensor) -> Tensor:
    """:func:`_dequant_sum` in two fp32 buffers, in place (the first one returned)."""
    return torch.sub(a, a_zp).mul_(a_scale).add_(torch.sub(b, b_zp).mul_(b_scale))


# ---- static-shape compiled graphs ----------------------------------------------------------------------------------

def compile_graph(fn: Callable, args: tuple) -> Callable[[tuple], object]:
    """``fn`` traced on ``args`` (tensors become graph inputs, everything else is baked in) and compiled by inductor:
    a callable taking an argument tuple of the same signature. torch.compile would evaluate dynamo's guards on every
    call (20-70 us each, ~150 calls per ResNet-20 step); here the caller (StaticGraphs) dispatches on the signature."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from torch.utils import _pytree as pytree

    positions = [i for i, a in enumerate(args) if isinstance(a, Tensor)]
    trees: list = []

    def flat(*tensors: Tensor) -> list[Tensor]:
        full = list(args)
        for i, t in zip(positions, tensors):
            full[i] = t
        leaves, tree = pytree.tree_flatten(fn(*full))
        trees.append(tree)
        return leaves

    example = [args[i] for i in positions]
    with torch.no_grad():
        graph = make_fx(flat)(*example)
        # compiled against fake inputs with a (static) shape environment: inductor's on-disk graph cache keys on it,
        # so a restart loads the kernels instead of generating them again (without it: ~1 s per graph every start,
        # 42 graphs for the MNIST CNN's training and evaluation shapes)
        fake_mode = FakeTensorMode(shape_env=ShapeEnv())
        compiled = torch._inductor.compile(graph, [fake_mode.from_tensor(t, static_shapes=True) for t in example])
    tree = trees[-1]

    def call(call_args: tuple) -> object:
        return pytree.tree_unflatten(list(compiled(*[call_args[i] for i in positions])), tree)

    return call


def _signature(a: object) -> object:
    if isinstance(a, Tensor):
        return (a.dtype, a.device, tuple(a.shape), a.stride())
    return (type(a), a)


def _same_results(a: object, b: object) -> bool:
    """Whether two pass results (tensors, or tuples / lists of them) are equal bit for bit."""
    from torch.utils import _pytree as pytree

    leaves_a, leaves_b = pytree.tree_leaves(a), pytree.tree_leaves(b)
    return len(leaves_a) == len(leaves_b) and all(
        torch.equal(x, y) if isinstance(x, Tensor) and isinstance(y, Tensor) else x == y
        for x, y in zip(leaves_a, leaves_b))


class StaticGraphs:
    """``fn`` compiled once per argument signature (tensor dtypes, devices, shapes and strides; the values of all other
    arguments), the compiled graphs kept in a dict: a call costs a dict look-up, not a guard evaluation.

    With a ``rival`` (an eager twin equal to the compiled ``fn`` by construction, ``eager_twin(same_as_compiled=
    True)``), the first call of a signature also times both on its arguments, at the process's thread count, and
    keeps the twin where it is clearly faster and gave the very same results there: the generated code is not always
    the faster one (window max pooling: strided tap views compiled 4.3 ms, eagerly 2.2 ms at 64x32x28x28, on AVX-512
    and AVX2 alike), and which one wins depends on the CPU's vector ISA. ``choices`` records each signature's times."""

    def __init__(self, fn: Callable, rival: Callable | None = None, name: str = "") -> None:
        self.fn, self.rival, self.name = fn, rival, name or getattr(fn, "__name__", "pass")
        self.graphs: dict[tuple, Callable[[tuple], object]] = {}
        self.choices: dict[tuple, dict[str, float]] = {}
        self._lock = threading.Lock()

    def __call__(self, *args):
        key = tuple(_signature(a) for a in args)
        graph = self.graphs.get(key)
        if graph is None:
            with self._lock:
                graph = self.graphs.get(key)
                if graph is None:
                    graph = self.graphs[key] = self._build(key, args)
        return graph(args)

    def _build(self, key: tuple, args: tuple) -> Callable[[tuple], object]:
        graph = compile_graph(self.fn, args)
        rival = self.rival
        if rival is None:
            return graph
        device = next((a.device for a in args if isinstance(a, Tensor)), torch.device("cpu"))
        results: dict[str, object] = {}  # each contender's last output, compared below
        times = self.choices[key] = fastest_times(
            {"compiled": lambda: results.__setitem__("compiled", graph(args)),
             "eager": lambda: results.__setitem__("eager", rival(*args))}, device, reps=_RACE_REPS, one_thread=False)
        if times["eager"] >= _EAGER_MARGIN * times["compiled"]:
            return graph
        if not _same_results(results["compiled"], results["eager"]):
            log.warning("pass %s: its eager twin differs from the compiled graph; the compiled graph is kept",
                        self.name)
            return graph
        shapes = " ".join("x".join(map(str, a.shape)) for a in args if isinstance(a, Tensor))
        log.info("pass %s (%s): eager twin %.2f ms vs compiled %.2f ms: runs eagerly", self.name, shapes,
                 times["eager"], times["compiled"])
        return lambda call_args: rival(*call_args)


# ---- the fused-pass engine ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PassInfo:
    """Which implementation the quantization passes use, and why."""

    path: str  # "compiled" | "eager"
    reason: str


class FusedPasses:
    """The quantization passes of one process, compiled (checked at first use) or eager.

    ``run(name, fn, *args)`` calls ``fn`` compiled (inductor, one graph per argument signature, created on first
    use) when the compiled path is in use, else eagerly. A compiled function that raises (a shape or op the compiler
    rejects) runs eagerly from then on; the fallback is logged and listed in ``fallbacks``.
    """

    def __init__(self, try_compile: bool = True) -> None:
        self._lock = threading.Lock()
        self._info: PassInfo | None = None if try_compile else PassInfo("eager", "eager requested")
        self._compiled: dict[str, Callable] = {}
        self.fallbacks: dict[str, str] = {}

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

    def _decide(self) -> PassInfo:
        forced = os.environ.get(_ENV_EAGER, "")
        if forced not in ("", "0"):
            return PassInfo("eager", f"{_ENV_EAGER} set")
        memory = physical_memory_mib()
        if forced != "0" and 0 < memory < COMPILE_MIN_MEMORY_MIB:
            return PassInfo("eager", f"{memory:.0f} MiB of memory: the compiler's ~200 MiB per process is not spent "
                                     f"below {COMPILE_MIN_MEMORY_MIB} MiB ({_ENV_EAGER}=0 compiles anyway)")
        setup = self._compiler_setup()
        try:
            x = torch.linspace(-3.0, 5.0, 2 * 3 * 4 * 4).reshape(2, 3, 4, 4)
            seed = torch.tensor([12345, -67890], dtype=torch.int32)
            codes = torch.arange(2 * 3 * 5 * 5, dtype=torch.int32).mul_(37).remainder_(256).to(torch.uint8)
            codes = codes.reshape(2, 3, 5, 5)  # 150 codes: whole 8- and 16-lane byte loads and a tail
            for name, fn, args in (("act_batch", _act_batch_codes, (x, -128, 127, True)),
                                   ("grad_sr", grad_codes_hashed, (x, seed, 127, True)),
                                   ("centered", _centered, (codes, torch.tensor(131.0)))):
                got, want = compile_graph(fn, args)(args), fn(*args)  # the graph itself, never its twin
                if not all(torch.equal(a, b) for a, b in zip(got, want)):
                    return PassInfo("eager", f"compiled {name} disagreed with eager; not used")
        except Exception as exc:  # no compiler, unsupported platform: any failure means eager
            return PassInfo("eager", f"torch.compile unavailable: {type(exc).__name__}: {str(exc)[:200]}")
        return PassInfo("compiled", f"inductor-compiled passes checked bit-exact against eager on a small case "
                                    f"({setup})")

    @staticmethod
    def _compiler_setup() -> str:
        """The per-CPU cache and the AVX2 byte loads (compiler_env.py); what was set up, for the log. A failure here
        is logged and leaves inductor's defaults: the compiled path is still checked and used."""
        try:
            isa, cache = use_per_cpu_cache()
            byte_loads = ", byte loads direct" if use_fast_byte_loads() and isa == "avx2" else ""
            return f"vector ISA {isa or 'none'}{byte_loads}; cache {cache}"
        except Exception as exc:
            log.warning("inductor set-up skipped (%s: %s): its defaults are used", type(exc).__name__, exc)
            return "inductor defaults"

    def _compile(self, name: str, fn: Callable) -> Callable:
        """``fn`` compiled per argument signature (static shapes: kernels specialised per shape were 3-10x faster than
        dynamic-shape ones here); see :class:`StaticGraphs`."""
        if name not in self._compiled:
            self._compiled[name] = StaticGraphs(fn, _EAGER_TWINS.get(fn) if fn in _RACEABLE else None, name)
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

    def activation(self, x: Tensor, bits: int, lo: Tensor | None = None, hi: Tensor | None = None,
                   channels_last: bool = False) -> tuple[Codes, Tensor, Tensor]:
        """Asymmetric nearest-rounding codes of ``x``: batch range if ``lo``/``hi`` are None, else [lo, hi].

        Returns the codes (channels_last if asked and ``x`` is 4-D) and the range used (the batch range, for the
        running estimate).
        """
        qmin, qmax = _grid(bits, symmetric=False)
        x = x.detach()
        channels_last = channels_last and x.dim() == 4
        if lo is None or hi is None:
            data, scale, zp, lo, hi = self.run("act_batch", _act_batch_codes, x, qmin, qmax, channels_last)
        else:
            data, scale, zp = self.run("act_range", _act_range_codes, x, lo, hi, qmin, qmax, channels_last)
        return Codes(data, scale, zp, qmin, qmax), lo, hi

    def gradient(self, g: Tensor, bits: int, channels_last: bool = False) -> Codes:
        """Symmetric stochastic-rounding codes of a layer gradient (uint8, zero point 128)."""
        qmin, qmax = _grid(bits, symmetric=True)
        channels_last = channels_last and g.dim() == 4
        if self.compiled and "grad_sr" not in self.fallbacks:
            data, scale = self.run("grad_sr", grad_codes_hashed, g, sr_seed(g.device), qmax, channels_last)
        else:
            data, scale = _grad_codes_chunked(g, qmax, channels_last)
        return gradient_codes_of(data, scale, bits)

    def centered(self, codes: Codes) -> Tensor:
        """fp32 ``codes.data - codes.zero_point`` (exact integers), in the codes' layout, one pass."""
        return self.run("centered", _centered, codes.data, codes.zero_point)

    def channels_last(self, t: Tensor) -> Tensor:
        """4-D ``t`` in channels_last layout (itself if it already is)."""
        if t.dim() != 4 or t.is_contiguous(memory_format=torch.channels_last):
            return t
        return self.run("to_channels_last", _to_channels_last, t)

    def dequant_sum(self, a: Codes, b: Codes) -> Tensor:
        """Sum of the values of two code tensors of the same shape (one pass)."""
        return self.run("dequant_sum", _dequant_sum, a.data, a.scale, a.zero_point, b.data, b.scale, b.zero_point)


def _weight_codes(w: Tensor, qmin: int, qmax: int) -> tuple[Tensor, Tensor]:
    scale = (w.abs().amax() / qmax).clamp_min(_TINY_SCALE)
    return torch.round(w / scale).clamp(qmin, qmax).to(torch.int8), scale


def weight_codes(w: Tensor, bits: int) -> Codes:
    """Symmetric nearest-rounding int8 codes of a weight (a small tensor: one compiled call instead of six eager
    ones, where the passes are compiled)."""
    qmin, qmax = _grid(bits, symmetric=True)
    data, scale = passes().run("weight_codes", _weight_codes, w.detach(), qmin, qmax)
    return Codes(data, scale, torch.zeros_like(scale), qmin, qmax)


_PASSES = FusedPasses()


def passes() -> FusedPasses:
    """The process-wide fused passes."""
    return _PASSES


def set_passes(engine: FusedPasses) -> FusedPasses:
    """Replace the process-wide passes (tests force eager with ``FusedPasses(try_compile=False)``); returns the old."""
    global _PASSES
    old, _PASSES = _PASSES, engine
    return old
