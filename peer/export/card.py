"""The exported model's card (``card.json``): what a consumer needs to use the files without this package.

    card_version       CARD_VERSION
    source             ref (``torchvision:mobilenet_v3_small``, ``mnist-cnn``, ``nets.py:Net``), kind, options
    origin             kind (checkpoint, average, remote) and where: checkpoint path(s), run directory, peer address
    fingerprint, round the model fingerprint peers agree on; the gossip round (the highest one for an average)
    test_acc           the peer's last test accuracy in [0, 1] (an average: the fleet report's), null if unknown
    precision          trained_in (fp32, sim8, int8) and bits; files: fp32 (every tensor and input/output);
                       numerics: the export's choice (trained, fp32) and graph_numerics: what the TorchScript and
                       ONNX graphs compute, in words (8-bit fake-quantized weights and activations as evaluated in
                       training, or fp32); the safetensors file is always the fp32 master weights
    norm, groups       the normalisation layers it was trained with
    data               dataset name, num_classes, classes (index -> name), input_shape [C, H, W]
    input              layout, dtype and dynamic batch of the graphs' input; normalization: mean, std (per channel),
                       input_scale (uint8 pixels / 255 or as given) and in_graph (true: the TorchScript and ONNX
                       graphs normalise themselves and take x on that scale; false: feed (x - mean) / std)
    state_dict         loads_into (the call whose module takes the safetensors file with strict=True),
                       loads_into_source (that is the user's own architecture) and reason (when not)
    files              per format: file name, bytes, sha256, and for the graphs the largest |difference| from the
                       PyTorch model on a check input (null: not checked, onnxruntime missing)
    export_s           seconds the export took (rebuild, writing and checking every file)
    exported_at, lpdl_peer_version
"""

from __future__ import annotations

import datetime
import hashlib
import json
from pathlib import Path
from typing import Any

from peer import __version__
from peer.export.rebuild import Rebuilt
from peer.export.sources import Trained

#: Version of the card layout above (2: the graphs compute the trained numerics by default, precision.numerics and
#: precision.graph_numerics say which).
CARD_VERSION = 2
#: The card's file name in the output directory.
CARD_NAME = "card.json"
_READ_BYTES = 1 << 20


def file_entry(path: Path, max_abs_diff: float | None = None, checked: bool = False) -> dict[str, Any]:
    """A written file: name, size in bytes, sha256 (hex) and, for a graph, its check against the model."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(_READ_BYTES):
            digest.update(block)
    entry: dict[str, Any] = {"file": path.name, "bytes": path.stat().st_size, "sha256": digest.hexdigest()}
    if checked:
        entry["max_abs_diff_vs_pytorch"] = max_abs_diff
    return entry


def build_card(trained: Trained, rebuilt: Rebuilt, files: dict[str, dict[str, Any]], *, export_s: float,
               normalize_in_graph: bool, numerics: str) -> dict[str, Any]:
    """The card of an export (see the module docstring for every field)."""
    spec, info, data = trained.spec.model, trained.info, trained.data
    return {
        "card_version": CARD_VERSION,
        "source": {"ref": info.get("source", spec.name), "kind": info.get("source_kind", "registry"),
                   "options": list(spec.options)},
        "origin": trained.origin,
        "fingerprint": trained.fingerprint,
        "round": trained.round,
        "test_acc": trained.test_acc,
        "precision": {"trained_in": spec.precision, "bits": spec.bits, "files": "fp32", "numerics": numerics,
                      "graph_numerics": rebuilt.graph_numerics},
        "norm": spec.norm,
        "groups": spec.groups,
        "data": {"dataset": data.name, "num_classes": data.num_classes, "classes": list(data.classes),
                 "input_shape": list(data.input_shape)},
        "input": {"layout": "NCHW", "dtype": "float32", "batch": "dynamic",
                  "normalization": {"mean": list(data.mean), "std": list(data.std),
                                    "input_scale": info.get("input_scale"), "in_graph": normalize_in_graph}},
        "state_dict": {"loads_into": rebuilt.loads_into, "loads_into_source": rebuilt.loads_into_source,
                       "reason": rebuilt.reason or None},
        "files": files,
        "export_s": round(export_s, 3),
        "exported_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "lpdl_peer_version": __version__,
    }


def write_card(card: dict[str, Any], out_dir: Path) -> Path:
    """Write ``card.json`` into ``out_dir``; returns its path."""
    path = out_dir / CARD_NAME
    path.write_text(json.dumps(card, indent=2) + "\n")
    return path
