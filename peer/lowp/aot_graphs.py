"""Pass graphs compiled ahead of time and kept per host: a process that finds a graph there loads it as a shared
library - no tracing, no compiler in the process - and only the first process of a host compiles it.

Why: the just-in-time path (graphs.py) traces every pass with make_fx and hands it to inductor at every start; even
with inductor's cache warm that keeps the compiler's stack resident (importing torch._inductor alone took a process
from 520 to 675 MiB here, its select_algorithm to 721 MiB, which every generated wrapper imports) and costs each
daemon of a 4-daemon fleet seconds before its first step (bench/RESULTS-fleet.md). A graph compiled by inductor's
ahead-of-time mode (its kernels and a C++ wrapper in one .so) is run by torch's own AOTI runner
(``torch._C._aoti``), which needs none of that: three pass graphs loaded in 0.06 s, +8 MiB, bit for bit the traced
graph's results. Compiling one takes 5-25 s (the C++ wrapper), a few times inductor's just-in-time graph: paid once
per host, CPU, torch version and pass code.

Where: beside the probe record (host_record.py :func:`cache_root`) under ``aot-graphs/<identity>``, the identity
the record's (CPU flags and model, torch version) with a digest of every peer/lowp module (a pass's code spans
several). Per graph: one record entry (the library's file name, where the call's tensors sit in its arguments, the
structure of its result) and the library, made under the host-wide lock of that graph: of N processes starting
together one compiles, the others wait and load. ``LPDL_LOWP_AOT=1`` turns it on (CPU passes; CUDA passes and a
record turned off keep the just-in-time path).

``LPDL_LOWP_AOT=background`` (the local fleet's default) never compiles in the process that runs the passes: a graph
not stored yet runs eagerly there - the same bits - and is queued for a background filler (aot_queue.py), and the
process looks again every ``recheck_s`` and switches to the stored graph once it is there. So the first run on a
host costs what an eager one does, and later runs (or a long-running daemon, minutes in) get the compiled passes.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor

from peer.lowp.aot_queue import Filler, write_request
from peer.lowp.compile_policy import AOT_BACKGROUND, AOT_INLINE, ENV_AOT
from peer.lowp.graphs import Result, compile_graph, trace
from peer.lowp.host_record import HostRecord, cache_root, host_identity
from peer.lowp.torch_patches import codegen_tag
from peer.lowp.twins import eager_body

log = logging.getLogger(__name__)

_LIBRARIES = "lib"
#: Seconds between two looks of a process at the store for a graph it runs eagerly meanwhile (background mode).
RECHECK_S = 30.0
#: The log line of a process that queued graphs (background mode; a process that logs none found all it ran stored).
QUEUED = "pass graphs not stored yet run eagerly and are queued for the background compile"


def aot_mode() -> str | None:
    """``AOT_INLINE`` or ``AOT_BACKGROUND`` where the operator asked for ahead-of-time pass graphs
    (``LPDL_LOWP_AOT``), else None (an unknown value is refused: a typo must not silently turn the store off)."""
    value = os.environ.get(ENV_AOT, "").strip()
    if value in ("", "0"):
        return None
    if value not in (AOT_INLINE, AOT_BACKGROUND):
        raise ValueError(f"{ENV_AOT}={value!r}: expected {AOT_INLINE!r}, {AOT_BACKGROUND!r} or 0")
    return value


def graph_name(fn: Callable, args: tuple[object, ...]) -> str:
    """What names one pass graph across processes: the function and each argument's signature (a tensor's dtype,
    device, shape and strides - ``-`` for a dimension of size 1, whose stride no element's address depends on; the
    value of anything else, which the graph bakes in).

    Why the ``-``: the MNIST CNN's one-channel input reached the first layer's ``centered`` pass with strides
    (784, 1, 28, 1) on the eager path and (784, 784, 28, 1) on the compiled one - the same memory, two names - so
    a fleet's second run on a new store queued one more graph and its filler imported torch and compiled beside the
    daemons (AMD EPYC Zen 4, 2026-12-05); a graph compiled for either layout gives the other's values bit for bit."""
    return f"aot graph {fn.__module__}.{fn.__qualname__}({', '.join(_stable(a) for a in args)})"


def _stable(a: object) -> str:
    if isinstance(a, Tensor):
        strides = ", ".join("-" if size == 1 else str(stride) for size, stride in zip(a.shape, a.stride()))
        return f"{a.dtype} {a.device} {tuple(a.shape)} ({strides}{',' if a.dim() == 1 else ''})"
    if a is None or isinstance(a, (bool, int, float, str)):
        return repr(a)
    if isinstance(a, (tuple, list)):  # a window's size, a shape
        inner = ", ".join(_stable(b) for b in a)
        return f"({inner},)" if isinstance(a, tuple) else f"[{inner}]"
    if callable(a) and hasattr(a, "__qualname__"):  # a formula or backward handed to a pass
        return f"{a.__module__}.{a.__qualname__}"
    raise TypeError(f"pass argument of type {type(a).__name__} has no name that holds across processes")


def _lowp_digest() -> str:
    """Digest of every peer/lowp module's source: a pass graph depends on code in several of them."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:16]


class AotGraphs:
    """The host's store of ahead-of-time pass graphs (module docstring); ``graph(fn, args)`` is a drop-in for
    graphs.compile_graph."""

    def __init__(self, directory: Path, recheck_s: float = RECHECK_S) -> None:
        self.directory = directory
        self.record = HostRecord(directory)
        self.recheck_s = recheck_s
        self.filler = Filler(directory)
        self.compiled = 0  # graphs this process compiled (the rest it loaded)
        self.loaded = 0
        self.requested = 0  # graphs this process ran eagerly and queued for the background filler
        #: Background mode on a machine too small to compile beside its daemons (compile_policy.py): stored graphs
        #: are loaded, missing ones run eagerly and are neither queued nor compiled (``lpdl-peer prepare`` is).
        self.load_only = False

    @classmethod
    def for_host(cls) -> AotGraphs | None:
        """This host's store, or None where the record is turned off or its directory cannot be made."""
        root = cache_root()
        if root is None:
            return None
        identity = f"{host_identity(torch.device('cpu'))} | lowp {_lowp_digest()} | {codegen_tag()}"
        directory = root / "aot-graphs" / hashlib.sha256(identity.encode()).hexdigest()[:16]
        try:
            (directory / _LIBRARIES).mkdir(parents=True, exist_ok=True)
            about = directory / "host.txt"
            if not about.exists():
                about.write_text(identity + "\n")
        except OSError as exc:
            log.warning("ahead-of-time pass graphs unavailable at %s (%s): compiled just in time", directory, exc)
            return None
        return cls(directory)

    def graph(self, fn: Callable[..., Result], args: tuple[object, ...]) -> Callable[[tuple[object, ...]], Result]:
        """``fn`` for calls of ``args``' signature: loaded from the store, or compiled into it first (under the
        graph's host-wide lock); passes on other devices than the CPU are compiled just in time."""
        if any(isinstance(a, Tensor) and a.device.type != "cpu" for a in args):
            return compile_graph(fn, args)
        name = graph_name(fn, args)
        with self.record.slot(name) as slot:
            if slot.value is not None:
                loaded = self._load(slot.value, name)
                if loaded is not None:
                    self.loaded += 1
                    return loaded
                self._remove(slot.value)
            entry = self._compile(fn, args, name)
            slot.save(entry)
        loaded = self._load(entry, name)
        if loaded is None:
            raise RuntimeError(f"ahead-of-time graph of {name} compiled but not loadable")
        self.compiled += 1
        return loaded

    def stored(self, name: str) -> Callable[[tuple[object, ...]], Any] | None:
        """The stored graph ``name``, loaded, or None where it is not stored (yet) or unusable (queued again)."""
        entry = self.record.peek(name)
        return None if entry is None else self._load(entry, name, again="queued again")

    def background_graph(self, fn: Callable[..., Result], args: tuple[object, ...],
                         usable: Callable[[], bool] = lambda: True) -> Callable[[tuple[object, ...]], Result]:
        """``fn`` for calls of ``args``' signature without compiling here: the stored graph where there is one and
        ``usable()`` (the passes' bit-exactness check passed), else the eager pass, queued for the background filler
        and replaced by the stored graph once it is there; passes on other devices than the CPU are compiled just in
        time, as in :meth:`graph`."""
        if any(isinstance(a, Tensor) and a.device.type != "cpu" for a in args):
            return compile_graph(fn, args)
        name = graph_name(fn, args)
        if self.holds(name):
            loaded = self.stored(name) if usable() else None
            if loaded is not None:
                self.loaded += 1
                return loaded
        else:
            self.queue(fn, args, name)
        return _Pending(self, name, eager_body(fn), usable)

    def holds(self, name: str) -> bool:
        """Whether the store has an entry for graph ``name`` (nothing loaded)."""
        return self.record.peek(name) is not None

    def queue(self, fn: Callable[..., Any], args: tuple[object, ...], name: str) -> None:
        """Ask the background filler for graph ``name`` (started where none works on the store); nothing where
        :attr:`load_only`."""
        if self.load_only:
            return
        if write_request(self.directory, name, fn, args):
            if not self.requested:
                log.info("%s (first: %s)", QUEUED, name)
            self.requested += 1
            self.filler.ensure()

    def _compile(self, fn: Callable, args: tuple[object, ...], name: str) -> dict[str, Any]:
        """Trace ``fn`` and compile it ahead of time into the store; its record entry. The compiler is imported
        here only: a process that finds every graph in the store never loads it."""
        from torch._inductor import aot_compile
        from torch.utils import _pytree as pytree

        from peer.lowp.compiler_env import use_per_cpu_cache
        from peer.lowp.torch_patches import use_fast_byte_loads

        use_per_cpu_cache()  # the just-in-time path's code generator set-up: the same kernels
        use_fast_byte_loads()
        traced = trace(fn, args)
        for node in traced.graph.graph.nodes:  # fake values a trace after an earlier compile carries from that one's
            node.meta.pop("val", None)         # fake mode: the compile would refuse them as another mode's
            node.meta.pop("tensor_meta", None)
        # a new file name per compile: a process that has the old library mapped keeps it, and a process that
        # loaded it by this name once would get the old one back from the dynamic loader
        library = f"{hashlib.sha256(name.encode()).hexdigest()[:24]}-{uuid.uuid4().hex[:8]}.so"
        work = Path(tempfile.mkdtemp(prefix=".compile-", dir=self.directory))
        try:
            with torch.no_grad():
                built = aot_compile(traced.graph, tuple(traced.example),
                                    options={"aot_inductor.output_path": str(work / library)})
            if not isinstance(built, str):
                raise RuntimeError(f"ahead-of-time compile of {name} gave {type(built).__name__}, not a library")
            os.replace(built, self.directory / _LIBRARIES / library)  # whole or absent for a reader
        finally:
            shutil.rmtree(work, ignore_errors=True)
        log.info("pass graph compiled ahead of time: %s", name)
        return {"library": library, "positions": traced.positions, "outputs": pytree.treespec_dumps(traced.tree)}

    def _remove(self, entry: dict[str, Any]) -> None:
        """Delete the library of an unusable entry (a process that has it mapped keeps its copy)."""
        with contextlib.suppress(OSError, KeyError, TypeError):
            (self.directory / _LIBRARIES / Path(str(entry["library"])).name).unlink()

    def _load(self, entry: dict[str, Any], name: str,
              again: str = "compiling it again") -> Callable[[tuple[object, ...]], Any] | None:
        """The callable of a stored graph, or None (logged) where its entry or library is unusable."""
        from torch.utils import _pytree as pytree

        try:
            path = self.directory / _LIBRARIES / Path(str(entry["library"])).name
            positions = [int(i) for i in entry["positions"]]
            tree = pytree.treespec_loads(str(entry["outputs"]))
            runner = torch._C._aoti.AOTIModelContainerRunnerCpu(str(path), 1)
        except Exception as exc:  # a missing or foreign library, a damaged entry: compiled again
            log.warning("ahead-of-time graph of %s unusable (%s: %s): %s", name, type(exc).__name__,
                        str(exc)[:200], again)
            return None

        def call(call_args: tuple[object, ...]) -> Any:
            return pytree.tree_unflatten(runner.run([cast(Tensor, call_args[i]) for i in positions]), tree)

        return call


class _Pending:
    """A pass graph the store does not hold yet (background mode): the eager pass until, at a look every
    ``store.recheck_s``, the stored graph is there and usable; that graph from then on."""

    def __init__(self, store: AotGraphs, name: str, eager: Callable[..., Any], usable: Callable[[], bool]) -> None:
        self.store, self.name, self.eager, self.usable = store, name, eager, usable
        self.graph: Callable[[tuple[object, ...]], Any] | None = None
        self._next_look = time.monotonic() + store.recheck_s
        self._lock = threading.Lock()

    def ready(self) -> bool:
        """Whether the stored graph runs (looking for it again where a look is due)."""
        if self.graph is None and time.monotonic() >= self._next_look and self._lock.acquire(blocking=False):
            try:
                self._next_look = time.monotonic() + self.store.recheck_s
                if self.usable():
                    self.graph = self.store.stored(self.name)
                    if self.graph is not None:
                        self.store.loaded += 1
                        log.info("pass graph now loaded from the store: %s", self.name)
            finally:
                self._lock.release()
        return self.graph is not None

    def __call__(self, call_args: tuple[object, ...]) -> Any:
        return self.graph(call_args) if self.ready() and self.graph is not None else self.eager(*call_args)


def graph_ready(graph: Callable[[tuple[object, ...]], Any]) -> bool:
    """Whether ``graph`` (what a compiler returned) runs a compiled graph, not the eager pass standing in for one."""
    return not isinstance(graph, _Pending) or graph.ready()
