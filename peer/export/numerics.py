"""Which numerics the TorchScript and ONNX graphs compute: the ones the model was trained and evaluated in, or its
fp32 master weights without quantization.

``numerics="trained"`` (the default) traces a model trained in sim8 or int8 rebuilt in **sim8** precision: every
QConv2d / QLinear quantizes its input (the activation quantizer's running range from the checkpoint: eval mode uses
it, so the graph does not depend on the batch) and its weight (symmetric ``+-max|W|``) to ``bits`` bits with
round-to-nearest, and every EvoNorm / residual add quantizes its inputs the same way, all as fp32 quantize-dequantize
ops (ONNX Div, Round, Clip, Sub, Mul). That is the daemon's int8 evaluation up to fp32 rounding: int8 computes the
same codes and their products exactly in integers, sim8 sums the dequantized products in fp32
(docs/decisions/export-numerics.md#trained-numerics-against-fp32). ``numerics="fp32"`` (and any model trained in
fp32) traces the fp32 model: what the safetensors file computes in the user's own class, which for an 8-bit-trained
model disagrees with the daemon's evaluation on a few percent of images.

sim8's layers compute through custom autograd Functions (the straight-through / bifurcated backward), which
``torch.jit.trace`` and the TorchScript-based ONNX exporter cannot record (non-tensor arguments; a Python call in the
graph). :func:`inlined_for_tracing` has their ``apply`` run ``forward`` directly while a trace is being recorded -
the same fp32 ops, inlined - and leaves every other call (training in another thread included) to autograd.

A layer the 8-bit graph cannot hold is refused with its name (:func:`check_ranges`, peer/export/layers.py), never
silently exported in fp32: the card says which numerics the graphs compute, and ``numerics="fp32"`` exports the
fp32 graph on request.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from peer.export.errors import ExportError
from peer.lowp.layers import _Sim8ProductFn
from peer.lowp.quantize import ActivationQuantizer, _FakeQuantSTE

#: ``numerics`` choices: as trained (8-bit for sim8 / int8 models), or the fp32 master weights.
NUMERICS = ("trained", "fp32")
#: The autograd Functions a sim8 model's eval-mode forward calls (products, fake quantization): inlined when traced.
SIM8_FUNCTIONS: tuple[type[torch.autograd.Function], ...] = (_Sim8ProductFn, _FakeQuantSTE)
#: Held while the Functions are patched: two exports in two threads would otherwise restore each other's patch.
_PATCHING = threading.RLock()


def check_numerics(numerics: str) -> str:
    """``numerics`` if it is one of :data:`NUMERICS`, else an ExportError in one line."""
    if numerics not in NUMERICS:
        raise ExportError(f"numerics: expected one of {', '.join(NUMERICS)}, got {numerics!r}")
    return numerics


def graph_precision(numerics: str, trained_in: str) -> str:
    """The precision mode the graphs are traced in: sim8 for the trained numerics of a sim8 / int8 model (int8's
    numerics, in fp32 ops that every runtime has), else fp32."""
    return "sim8" if check_numerics(numerics) == "trained" and trained_in != "fp32" else "fp32"


def describe(graph_mode: str, trained_in: str, bits: int) -> str:
    """The card's ``graph_numerics``: what the graphs compute, in words."""
    if graph_mode == "sim8":
        return f"{bits}-bit (fake-quantized weights and activations, as evaluated in training)"
    if trained_in == "fp32":
        return "fp32 (as trained)"
    return f"fp32 (the master weights without the {bits}-bit quantization the model was trained and evaluated with)"


def check_ranges(model: nn.Module) -> None:
    """Refuse an 8-bit graph with an activation quantizer that never saw a training batch: in eval mode it would
    quantize with each batch's own range, so the graph's output would depend on the batch (and tracing freezes the
    batch size's reduction order).

    Raises:
        ExportError: naming the first such layer.
    """
    for name, module in model.named_modules():
        if isinstance(module, ActivationQuantizer) and not bool(module.initialized):
            raise ExportError(f"8-bit graph: cannot export layer '{name}' (ActivationQuantizer): its activation range "
                              f"was never measured in training (no running range in the checkpoint); export with "
                              f"numerics fp32 (--numerics fp32)")


class _NoBackward:
    """The ``ctx`` an inlined Function's forward gets: keeps nothing (a traced graph has no backward)."""

    def save_for_backward(self, *tensors: torch.Tensor) -> None:
        """Nothing to save: the graph is inference only."""


def _inlining_apply(original: Any) -> classmethod:
    """``apply`` that runs ``cls.forward`` directly while a trace is recorded, ``original`` otherwise."""

    def apply(cls: type[torch.autograd.Function], *args: Any) -> Any:
        if torch.jit.is_tracing():
            return cls.forward(_NoBackward(), *args)
        return original(*args)

    return classmethod(apply)


@contextmanager
def inlined_for_tracing(functions: tuple[type[torch.autograd.Function], ...] = SIM8_FUNCTIONS) -> Iterator[None]:
    """While the ``with`` body runs, a trace (``torch.jit.trace``, ``torch.onnx.export(dynamo=False)``) records the
    ops of ``functions``' forwards instead of the Functions themselves; untraced calls are unchanged."""
    with _PATCHING:
        own = {fn: fn.__dict__.get("apply") for fn in functions}
        for fn in functions:
            fn.apply = _inlining_apply(fn.apply)
        try:
            yield
        finally:
            for fn, apply in own.items():
                if apply is None:
                    del fn.apply
                else:
                    fn.apply = apply
