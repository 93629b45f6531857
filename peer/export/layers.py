"""Which layer an export failed in: the innermost module whose forward was running when tracing raised, or, for a
failure after the trace (an op ONNX has no conversion for), the first module that fails to export on its own.

A traced graph can also be wrong without an error: a Python branch on a tensor's value is frozen at the trace
input's branch. Tracing reports those as TracerWarnings; :class:`LayerWatch` keeps each with the layer it came
from, so a graph that disagrees with the model on another input is reported with the layers to look at.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass
class LayerWatch:
    """Forward hooks on every module of a model, tracking which are running.

    Attributes:
        open: labels (``'features.3' (Conv2d)``) of the modules whose forward has started and not returned,
            outermost first.
        done: (label, module, positional inputs) of every module whose forward returned, in that order (inner
            before outer), first call only.
        warnings: (label, message) of every TracerWarning, ``label`` the innermost module running.
    """

    open: list[str] = field(default_factory=list)
    done: list[tuple[str, nn.Module, tuple[Any, ...]]] = field(default_factory=list)
    warnings: list[tuple[str, str]] = field(default_factory=list)

    def innermost(self) -> str | None:
        return self.open[-1] if self.open else None

    def suspects(self) -> str:
        """The layers that warned, as one phrase ("" if none)."""
        return ", ".join(sorted({layer for layer, _ in self.warnings}))


@contextmanager
def watch_layers(model: nn.Module) -> Iterator[LayerWatch]:
    """Track ``model``'s modules during the ``with`` body (TracerWarnings recorded, not printed)."""
    seen = LayerWatch()
    names = {m: f"layer '{name}' ({type(m).__name__})" if name else f"the model's own forward ({type(m).__name__})"
             for name, m in model.named_modules()}
    recorded: set[nn.Module] = set()

    def enter(module: nn.Module, args: tuple[Any, ...]) -> None:
        seen.open.append(names[module])

    def leave(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if seen.open:
            seen.open.pop()
        if module not in recorded:
            recorded.add(module)
            seen.done.append((names[module], module, args))

    handles = [h for m in names for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))]
    show = warnings.showwarning

    def record(message: Warning | str, category: type[Warning], *rest: Any, **kw: Any) -> None:
        if issubclass(category, torch.jit.TracerWarning):
            seen.warnings.append((seen.innermost() or names[model], str(message).splitlines()[0]))
        else:
            show(message, category, *rest, **kw)

    with warnings.catch_warnings():
        warnings.simplefilter("always", torch.jit.TracerWarning)
        warnings.filterwarnings("ignore", message=r".*torch\.jit\.trace.* is deprecated", category=FutureWarning)
        warnings.showwarning = record
        try:
            yield seen
        finally:
            for h in handles:
                h.remove()


def failing_layer(seen: LayerWatch, export_one: Callable[[nn.Module, tuple[Any, ...]], None]) -> str | None:
    """The layer a failed export points at: the innermost one running when it failed, else the first module (inner
    before outer) that ``export_one`` cannot export alone with the inputs it was called with."""
    if seen.open:
        return seen.innermost()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for label, module, args in seen.done:
            if not args or not all(isinstance(a, torch.Tensor) for a in args):
                continue
            try:
                export_one(module, args)
            except Exception:  # noqa: BLE001 - the first module that fails is the answer, whatever it raises
                return label
    return None


def onnx_alone(module: nn.Module, args: tuple[Any, ...]) -> None:
    """Export one module to ONNX in memory (the probe of :func:`failing_layer`)."""
    # torch annotates ``f`` as a path, but its TorchScript exporter writes to a binary file object as well
    torch.onnx.export(module, args, io.BytesIO(), dynamo=False)  # type: ignore[arg-type]


def trace_alone(module: nn.Module, args: tuple[Any, ...]) -> None:
    """Trace one module and serialize it in memory (the probe of :func:`failing_layer`; a Python call in the graph,
    such as a custom autograd Function, traces but fails to save)."""
    torch.jit.save(torch.jit.trace(module, args, check_trace=False), io.BytesIO())
