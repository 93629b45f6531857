"""``export_model``: a trained model out of the fleet - rebuilt from its checkpoint(s) or a live peer, written as
safetensors / TorchScript / ONNX with a card.

The TorchScript and ONNX graphs compute the numerics the model was trained in by default (``numerics="trained"``:
8-bit quantize-dequantize for a sim8 / int8 model, what the daemon evaluates); ``numerics="fp32"`` gives the graphs
of the fp32 master weights (peer/export/numerics.py). The safetensors file is the fp32 master weights either way.

Input normalisation is not part of the exported graphs by default: like the user's own model class, they take
``(x - mean) / std`` and the card says mean and std. ``normalize_in_graph=True`` bakes it into the TorchScript and
ONNX graphs (they then take x on the card's input scale, 0..1 for pixels); the safetensors file is always the bare
model's state dict.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from peer.export.card import build_card, file_entry, write_card
from peer.export.formats import (
    FILE_NAMES,
    FORMATS,
    MAX_RELATIVE_DIFF,
    MAX_RELATIVE_DIFF_8BIT,
    check_formats,
    write_onnx,
    write_safetensors,
    write_torchscript,
)
from peer.export.numerics import check_numerics
from peer.export.rebuild import Rebuilt, rebuild
from peer.export.sources import Trained, checkpoint_files, from_checkpoint, from_remote, from_run_dir

#: Batch sizes of the trace input and of the second input the graphs are checked on (a dynamic batch is checked).
TRACE_BATCH, CHECK_BATCH = 2, 3


@dataclass
class ExportResult:
    """What an export wrote: the output directory, the card (as written) and each file by format."""

    out_dir: Path
    card: dict[str, Any]
    card_path: Path
    files: dict[str, Path]


class Normalized(nn.Module):
    """``model((x - mean) / std)`` with per-channel mean and std: the input normalisation inside the graph."""

    mean: torch.Tensor  # buffers (1, C, 1, 1)
    std: torch.Tensor

    def __init__(self, model: nn.Module, mean: Sequence[float], std: Sequence[float]) -> None:
        super().__init__()
        self.model = model
        self.register_buffer("mean", torch.tensor(list(mean), dtype=torch.float32).view(1, -1, 1, 1))
        self.register_buffer("std", torch.tensor(list(std), dtype=torch.float32).view(1, -1, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model((x - self.mean) / self.std)


def export_model(source: str | Path, out_dir: str | Path, *, formats: Sequence[str] = FORMATS,
                 peer: str | None = None, tls_dir: str | Path | None = None,
                 model: Callable[..., nn.Module] | None = None, normalize_in_graph: bool = False,
                 test_acc: float | None = None, numerics: str = "trained") -> ExportResult:
    """Export the de-biased model z = x / w of a state directory, of the average of a fleet run directory's
    checkpoints, or of a remote peer, into ``out_dir``.

    Args:
        source: a state directory (``checkpoint.pt``), or a fleet run directory (``peer-<i>/checkpoint.pt``: their
            average). With ``peer``, the checkpoint (the first peer's of a run directory) gives the architecture.
        out_dir: created if missing; files of an earlier export there are replaced.
        formats: some of ``safetensors``, ``torchscript``, ``onnx``.
        peer: ``host:port`` of a remote peer whose live model is exported (GetModel).
        tls_dir: with ``peer``: a TLS directory holding an operator certificate (None: insecure).
        model: the callable that built the model, for a model given in code (``python:`` source), which a
            checkpoint cannot rebuild; the same callable the Python API trained.
        normalize_in_graph: bake the input normalisation into the TorchScript and ONNX graphs.
        test_acc: the averaged model's accuracy where the caller measured it (the fleet report) for the card.
        numerics: ``trained`` (the graphs compute the 8-bit numerics of a sim8 / int8 model, as the daemon
            evaluates it; fp32 for an fp32 model) or ``fp32`` (the graphs of the fp32 master weights).

    Raises:
        ExportError: one line naming the cause (missing directory, checkpoint of another schema or model, a peer
            refusing, a layer that cannot be exported, in 8-bit numerics included).
    """
    started = time.perf_counter()
    chosen = tuple(formats)
    check_formats(chosen)
    check_numerics(numerics)
    trained = load_trained(Path(source), peer, Path(tls_dir) if tls_dir else None, test_acc)
    rebuilt = rebuild(trained, model, numerics)
    return write_all(trained, rebuilt, Path(out_dir), chosen, normalize_in_graph, numerics, started)


def load_trained(source: Path, peer: str | None, tls_dir: Path | None, test_acc: float | None) -> Trained:
    """The model ``source`` (and ``peer``) name, as :func:`export_model` describes."""
    state_dirs = checkpoint_files(source)
    if peer:
        return from_remote(state_dirs[0], peer, tls_dir)
    if state_dirs == [source]:
        return from_checkpoint(source)
    return from_run_dir(source, state_dirs, test_acc)


def write_all(trained: Trained, rebuilt: Rebuilt, out_dir: Path, formats: tuple[str, ...],
              normalize_in_graph: bool, numerics: str, started: float) -> ExportResult:
    """Write every format and the card (the card last: a directory with a card holds a complete export)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    data = trained.data
    graph: nn.Module = Normalized(rebuilt.graph, data.mean, data.std).eval() if normalize_in_graph else rebuilt.graph
    draw = torch.rand if normalize_in_graph else torch.randn
    generator = torch.Generator().manual_seed(0)
    example = draw(TRACE_BATCH, *data.input_shape, generator=generator)
    check = draw(CHECK_BATCH, *data.input_shape, generator=generator)
    tolerance = MAX_RELATIVE_DIFF if rebuilt.graph is rebuilt.model else MAX_RELATIVE_DIFF_8BIT
    paths: dict[str, Path] = {}
    entries: dict[str, dict[str, Any]] = {}
    for fmt in formats:
        path = out_dir / FILE_NAMES[fmt]
        if fmt == "safetensors":
            write_safetensors(rebuilt.state_dict, path, {"format": "pt", "source": str(trained.info.get("source")),
                                                         "fingerprint": trained.fingerprint})
            entries[fmt] = file_entry(path)
        elif fmt == "torchscript":
            entries[fmt] = file_entry(path, write_torchscript(graph, example, check, path, tolerance), checked=True)
        else:
            entries[fmt] = file_entry(path, write_onnx(graph, example, check, path, tolerance), checked=True)
        paths[fmt] = path
    card = build_card(trained, rebuilt, entries, export_s=time.perf_counter() - started,
                      normalize_in_graph=normalize_in_graph, numerics=numerics)
    return ExportResult(out_dir, card, write_card(card, out_dir), paths)
