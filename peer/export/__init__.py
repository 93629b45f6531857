"""A trained model out of the fleet (``lpdl-peer export``, ``fleet``'s end): the de-biased model of a state
directory, of the average of a fleet run's checkpoints or of a remote peer, as safetensors, TorchScript and ONNX
with a JSON card.

    sources.py   where the model comes from: checkpoint, average of checkpoints, GetModel
    rebuild.py   the fp32 module from the checkpoint's spec and info (no data), which class its state dict fits, and
                 the model the graphs are traced from
    numerics.py  which numerics the graphs compute: the trained 8-bit ones (sim8 twin) or fp32
    formats.py   the three writers, each graph checked against the model
    layers.py    which layer an export failed in
    card.py      card.json
    exporter.py  export_model: all of it

Usage from code (a model given in code as a callable needs it again: a checkpoint cannot rebuild it)::

    from peer.export import export_model
    result = export_model("runs/train", "exported", model=make_net)
    print(result.card["files"])
"""

from __future__ import annotations

from peer.export.errors import ExportError
from peer.export.exporter import ExportResult, export_model
from peer.export.formats import FORMATS, available_formats

__all__ = ["FORMATS", "ExportError", "ExportResult", "available_formats", "export_model"]
