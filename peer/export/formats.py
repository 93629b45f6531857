"""The three files an exported model is written as, each loadable without this package:

* ``model.safetensors``: the state dict (peer/export/rebuild.py says which class it loads into);
* ``model.torchscript.pt``: ``torch.jit.trace`` of the model in eval mode (``torch.jit.load``), fp32 tensors in the
  numerics peer/export/numerics.py chose (8-bit layers as fp32 quantize-dequantize ops);
* ``model.onnx``: the TorchScript-based ONNX exporter (``dynamo=False``: the dynamo one needs onnxscript), opset
  :data:`ONNX_OPSET`, input ``input`` [batch, C, H, W] float32 with a dynamic batch, output ``logits`` [batch,
  classes].

Both graphs are checked against the model's own forward on a second input of another batch size (a graph traced
through a data-dependent branch disagrees there) and a failure names the layer (peer/export/layers.py). safetensors,
onnx and onnxruntime come with the ``export`` extra and are imported only here, never by the daemon.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from peer.export.errors import ExportError
from peer.export.layers import LayerWatch, failing_layer, onnx_alone, trace_alone, watch_layers
from peer.export.numerics import inlined_for_tracing

#: Every format, in the order they are written.
FORMATS = ("safetensors", "torchscript", "onnx")
#: File name of each format in the output directory.
FILE_NAMES = {"safetensors": "model.safetensors", "torchscript": "model.torchscript.pt", "onnx": "model.onnx"}
#: Packages each format needs (the ``export`` extra).
NEEDS = {"safetensors": ("safetensors",), "torchscript": (), "onnx": ("onnx",)}
#: ONNX opset: 17 is read by onnxruntime >= 1.14 and by the mobile runtimes of 2023 on.
ONNX_OPSET = 17
#: Names of the graphs' input and output.
INPUT_NAME, OUTPUT_NAME = "input", "logits"
#: Largest disagreement tolerated between a graph and the model, relative to the largest logit (fp32 reordering
#: gives ~1e-6; a frozen branch gives O(1)).
MAX_RELATIVE_DIFF = 1e-3
#: The same for a graph in 8-bit numerics: a value on a rounding boundary, computed in another order, lands on the
#: neighbouring code and the step travels on (MobileNetV3-Small after a fleet run: 0.014 of the largest logit on
#: the random check input; onnxruntime's top-1 still agreed with the daemon's on every test image).
MAX_RELATIVE_DIFF_8BIT = 0.05


def available_formats() -> tuple[str, ...]:
    """The formats whose packages are installed here."""
    return tuple(f for f in FORMATS if all(importlib.util.find_spec(p) for p in NEEDS[f]))


def check_formats(formats: tuple[str, ...]) -> None:
    """Refuse unknown formats and formats whose packages are missing, in one line."""
    unknown = [f for f in formats if f not in FORMATS]
    if unknown or not formats:
        raise ExportError(f"formats: expected some of {', '.join(FORMATS)}, got {', '.join(formats) or 'none'}")
    missing = sorted({p for f in formats for p in NEEDS[f] if not importlib.util.find_spec(p)})
    if missing:
        raise ExportError(f"formats: {', '.join(missing)} not installed (pip install 'lpdl-peer[export]')")


def write_safetensors(weights: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> Path:
    """The state dict as safetensors, with ``metadata`` (strings) in its header."""
    from safetensors.torch import save_file

    save_file(weights, str(path), metadata=metadata)
    return path


def write_torchscript(model: nn.Module, example: torch.Tensor, check: torch.Tensor, path: Path,
                      tolerance: float = MAX_RELATIVE_DIFF) -> float:
    """Trace ``model`` on ``example`` and save it; returns the largest |difference| from the model on ``check``
    (over ``tolerance`` of the largest logit: an ExportError)."""
    with watch_layers(model) as seen, torch.no_grad(), inlined_for_tracing():
        try:
            traced = torch.jit.trace(model, example, check_trace=False)
            traced.save(str(path))
        except Exception as exc:  # noqa: BLE001 - any tracing failure becomes one line naming the layer
            path.unlink(missing_ok=True)
            raise _layer_error("TorchScript", seen, trace_alone, exc) from None
    with torch.no_grad():
        try:
            got = traced(check)
        except Exception as exc:  # noqa: BLE001 - the graph froze something of the trace input (a shape, a value)
            raise _broken_graph("TorchScript", "the traced graph fails on another input", exc, seen, path) from None
        return _agreement("TorchScript", model(check), got, seen.suspects(), path, tolerance)


def write_onnx(model: nn.Module, example: torch.Tensor, check: torch.Tensor, path: Path,
               tolerance: float = MAX_RELATIVE_DIFF) -> float | None:
    """Export ``model`` to ONNX; returns the largest |difference| from the model on ``check`` as onnxruntime
    computes it (None when onnxruntime is not installed: the file is then written unchecked; over ``tolerance``
    of the largest logit: an ExportError)."""
    with watch_layers(model) as seen, torch.no_grad(), inlined_for_tracing():
        try:
            torch.onnx.export(model, (example,), str(path), dynamo=False, opset_version=ONNX_OPSET,
                              input_names=[INPUT_NAME], output_names=[OUTPUT_NAME],
                              dynamic_axes={INPUT_NAME: {0: "batch"}, OUTPUT_NAME: {0: "batch"}})
        except Exception as exc:  # noqa: BLE001 - any exporter failure becomes one line naming the layer
            path.unlink(missing_ok=True)
            raise _layer_error("ONNX", seen, onnx_alone, exc) from None
    if importlib.util.find_spec("onnxruntime") is None:
        return None
    import onnxruntime

    try:
        session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        if INPUT_NAME not in [i.name for i in session.get_inputs()]:
            raise ValueError("the graph does not depend on its input (a layer computed it outside torch)")
        got = torch.from_numpy(session.run([OUTPUT_NAME], {INPUT_NAME: check.numpy()})[0])
    except Exception as exc:  # noqa: BLE001 - onnxruntime's own error types; any of them means a broken graph
        raise _broken_graph("ONNX", "onnxruntime cannot run the exported graph", exc, seen, path) from None
    with torch.no_grad():
        return _agreement("ONNX", model(check), got, seen.suspects(), path, tolerance)


def _layer_error(what: str, seen: LayerWatch, probe: Callable[[nn.Module, tuple[Any, ...]], None],
                 exc: Exception) -> ExportError:
    """One line: the format, the layer the failure points at, and the exporter's own first line."""
    layer = failing_layer(seen, probe) or "the model (no single layer fails alone)"
    return ExportError(f"{what}: cannot export {layer}: {_first_line(exc)}")


def _broken_graph(what: str, problem: str, exc: Exception, seen: LayerWatch, path: Path) -> ExportError:
    """A written graph that does not run: removed, and one line with the layers tracing warned about."""
    path.unlink(missing_ok=True)
    where = f"; the layers whose forward left torch or branched on values: {seen.suspects()}" if seen.suspects() \
        else ""
    return ExportError(f"{what}: {problem}: {_first_line(exc)}{where}")


def _first_line(exc: Exception) -> str:
    """``Type: first line of the message``: exporters' messages run to pages of graph dumps."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def _agreement(what: str, expected: torch.Tensor, got: torch.Tensor, suspects: str, path: Path,
               tolerance: float) -> float:
    """The largest |expected - got|; an ExportError naming the data-dependent layers when over the tolerance."""
    if got.shape != expected.shape:
        diff, problem = math.inf, f"output {list(got.shape)} where the model gives {list(expected.shape)}"
    else:
        diff = float((expected - got).abs().max())
        problem = f"max |difference| {diff:.3g}"
    if not diff <= tolerance * max(1.0, float(expected.abs().max())):
        path.unlink(missing_ok=True)
        where = (f"; the layers whose forward left torch or branched on values: {suspects}" if suspects
                 else "; no layer reported a data-dependent branch")
        raise ExportError(f"{what}: the exported graph disagrees with the model on another input ({problem}){where}")
    return diff
