"""Compiled graphs of the passes, one per argument signature, and the race of a graph against its eager twin.

Why not torch.compile: it evaluates dynamo's guards on every call (20-70 us each, ~150 calls per ResNet-20 step);
here a graph is traced once with make_fx and compiled by inductor, and a call costs a dict look-up. Numbers and
history: docs/decisions/lowp-passes.md.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import Tensor

from peer.lowp.compiler_env import graph_lock
from peer.lowp.timing import fastest_times

log = logging.getLogger(__name__)

Result = TypeVar("Result")  # what a pass returns: a tensor or a tuple of them
#: What makes a pass graph: (pass function, example arguments) -> a callable taking an argument tuple of the same
#: signature (compile_graph, or the host's ahead-of-time store's AotGraphs.graph).
Compiler = Callable[[Callable[..., Any], tuple[object, ...]], Callable[[tuple[object, ...]], Any]]

RACE_REPS = 3  # timed runs of a compiled graph and of its eager twin at a signature's first call (after a warm-up)
EAGER_MARGIN = 0.9  # the eager twin replaces a compiled graph only if >= 10% faster (timing noise on shared cores)


@dataclass
class Traced:
    """A pass traced into one FX graph: ``graph`` takes the tensors of the call (``positions``: where they sit in
    its argument tuple; everything else is baked in) and returns the flat leaves of the result, whose structure is
    ``tree``."""

    graph: torch.fx.GraphModule
    example: list[Tensor]
    positions: list[int]
    tree: Any


def trace(fn: Callable[..., Result], args: tuple[object, ...]) -> Traced:
    """``fn`` traced on ``args`` with make_fx (no autograd: the passes run under no_grad)."""
    from torch.fx.experimental.proxy_tensor import make_fx
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

    example = [a for a in args if isinstance(a, Tensor)]  # the tensors at ``positions``
    with torch.no_grad():
        graph = make_fx(flat)(*example)
    return Traced(graph, example, positions, trees[-1])


def compile_graph(fn: Callable[..., Result], args: tuple[object, ...]) -> Callable[[tuple[object, ...]], Result]:
    """``fn`` traced on ``args`` (tensors become graph inputs, everything else is baked in) and compiled by inductor:
    a callable taking an argument tuple of the same signature. torch.compile would evaluate dynamo's guards on every
    call (20-70 us each, ~150 calls per ResNet-20 step); here the caller (StaticGraphs) dispatches on the signature."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from torch.utils import _pytree as pytree

    traced = trace(fn, args)
    positions, tree = traced.positions, traced.tree
    with torch.no_grad():
        # compiled against fake inputs with a (static) shape environment: inductor's on-disk graph cache keys on it,
        # so a restart loads the kernels instead of generating them again (without it: ~1 s per graph every start,
        # 42 graphs for the MNIST CNN's training and evaluation shapes)
        fake_mode = FakeTensorMode(shape_env=ShapeEnv())
        example = traced.example
        with graph_lock(graph_key(traced.graph.code, example)):  # one process of the host generates it, the rest load
            compiled = torch._inductor.compile(traced.graph,
                                               [fake_mode.from_tensor(t, static_shapes=True) for t in example])

    def call(call_args: tuple[object, ...]) -> Result:
        return pytree.tree_unflatten(list(compiled(*[call_args[i] for i in positions])), tree)

    return call


def graph_key(code: str, example: list[Tensor]) -> str:
    """What names a traced graph across processes: its code (constants baked in) and its inputs' dtypes, devices,
    shapes and strides (the torch version and the code generator patches are in the cache directory's name)."""
    return code + repr([_signature(t) for t in example])


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
    the faster one, and which one wins depends on the CPU's vector ISA. ``choices`` records each signature's times.
    ``compiler`` makes each graph (default :func:`compile_graph`; the host's ahead-of-time store: aot_graphs.py).
    ``ready`` says whether a graph the compiler returned runs compiled code yet (the store's background mode hands
    back the eager pass until its filler has compiled the graph): until then the twin runs, and the race is held
    at the first call after that. Without it the background mode never raced, and the fleet's daemons ran the
    compiled window max pooling at twice its twin's time (4.2 vs 2.1 ms per MNIST CNN step, AMD EPYC Zen 4)."""

    def __init__(self, fn: Callable, rival: Callable | None = None, name: str = "",
                 compiler: Compiler | None = None, ready: Callable[[Callable], bool] | None = None) -> None:
        self.fn, self.rival, self.name, self.compiler = fn, rival, name or getattr(fn, "__name__", "pass"), compiler
        self.ready = ready
        self.graphs: dict[tuple, Callable[[tuple], object]] = {}
        self.choices: dict[tuple, dict[str, float]] = {}
        self._lock = threading.Lock()

    def __call__(self, *args):
        return self.graph_for(args)(args)

    def waiting(self) -> int:
        """The signatures met so far whose compiled graph does not run yet (``ready`` says so: the store's
        background mode, where the eager pass stands in meanwhile); 0 without a ``ready`` hook."""
        if self.ready is None:
            return 0
        waiting = 0
        for graph in list(self.graphs.values()):
            if isinstance(graph, _RaceWhenReady):
                inner = graph.graph
                waiting += graph.winner is None and inner is not None and not self.ready(inner)
            else:
                waiting += not self.ready(graph)
        return waiting

    def graph_for(self, args: tuple) -> Callable[[tuple], object]:
        """The graph for calls of ``args``' signature, made at the first."""
        key = tuple(_signature(a) for a in args)
        graph = self.graphs.get(key)
        if graph is None:
            with self._lock:
                graph = self.graphs.get(key)
                if graph is None:
                    graph = self.graphs[key] = self._build(key, args)
        return graph

    def _build(self, key: tuple, args: tuple) -> Callable[[tuple], object]:
        graph = (self.compiler or compile_graph)(self.fn, args)
        if self.rival is None:
            return graph
        if self.ready is not None and not self.ready(graph):
            return _RaceWhenReady(self, key, graph)
        return self.race(key, graph, args)

    def race(self, key: tuple, graph: Callable[[tuple], object], args: tuple) -> Callable[[tuple], object]:
        """``graph`` or the eager twin for ``key``'s calls, whichever ran ``args`` clearly faster with equal
        results (times in ``choices``)."""
        rival = self.rival
        assert rival is not None
        device = next((a.device for a in args if isinstance(a, Tensor)), torch.device("cpu"))
        results: dict[str, object] = {}  # each contender's last output, compared below
        times = self.choices[key] = fastest_times(
            {"compiled": lambda: results.__setitem__("compiled", graph(args)),
             "eager": lambda: results.__setitem__("eager", rival(*args))}, device, reps=RACE_REPS, one_thread=False)
        if times["eager"] >= EAGER_MARGIN * times["compiled"]:
            return graph
        if not _same_results(results["compiled"], results["eager"]):
            log.warning("pass %s: its eager twin differs from the compiled graph; the compiled graph is kept",
                        self.name)
            return graph
        shapes = " ".join("x".join(map(str, a.shape)) for a in args if isinstance(a, Tensor))
        log.info("pass %s (%s): eager twin %.2f ms vs compiled %.2f ms: runs eagerly", self.name, shapes,
                 times["eager"], times["compiled"])
        return lambda call_args: rival(*call_args)


class _RaceWhenReady:
    """A signature whose compiled graph is not there yet (background mode): the eager twin runs - equal to the
    graph by construction - until ``graphs.ready(graph)``; the first call after that races them
    (:meth:`StaticGraphs.race`) and puts the winner in the wrapper's place (later calls go straight to it, and a
    losing graph is no longer referenced)."""

    def __init__(self, graphs: StaticGraphs, key: tuple, graph: Callable[[tuple], object]) -> None:
        self.graphs, self.key = graphs, key
        self.graph: Callable[[tuple], object] | None = graph
        self.winner: Callable[[tuple], object] | None = None
        self._lock = threading.Lock()

    def __call__(self, call_args: tuple) -> object:
        if self.winner is None:
            rival, ready = self.graphs.rival, self.graphs.ready
            assert rival is not None and ready is not None
            graph = self.graph
            if graph is None or not ready(graph):
                return rival(*call_args)
            with self._lock:
                if self.winner is None:
                    self.winner = self.graphs.race(self.key, graph, call_args)
                    self.graphs.graphs[self.key], self.graph = self.winner, None
        return self.winner(call_args)
