"""Building a user's model for training: the plain module checked against the data, then converted for the precision.

The check runs the plain model once on a zero batch of the dataset's input shape (eval mode, no gradient), so a
model that cannot take the data, or gives another number of classes, is refused with one line naming both sides
before any training or gossip starts. The fingerprint covers the converted structure (module types, parameter names
and shapes, norm) rather than a name: two devices whose model code differs refuse each other at the handshake.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from peer.lowp.convert import Conversion, convert
from peer.lowp.precision import PrecisionConfig
from peer.models.source import ModelSource, ModelSourceError

_DIGEST_HEX_CHARS = 16
#: How the inputs are scaled before normalisation, as DataShape.as_dict writes it.
PIXEL_SCALE, FLOAT_SCALE = "uint8 pixels / 255", "as given (float)"


@dataclass(frozen=True)
class DataShape:
    """What the data says a model must take and give: ``name`` (for messages), classes and one input's [C, H, W]
    (pixels), and the input normalisation ``(x - mean) / std`` per channel (x on the 0..1 scale for uint8 pixels),
    which travels with an exported model."""

    name: str
    num_classes: int
    in_channels: int
    height: int
    width: int
    mean: tuple[float, ...] = ()
    std: tuple[float, ...] = ()
    classes: tuple[str, ...] = ()
    pixels: bool = True

    @property
    def input_shape(self) -> tuple[int, int, int]:
        return self.in_channels, self.height, self.width

    def as_dict(self) -> dict[str, object]:
        """Plain data for a checkpoint and an exported model's card."""
        return {"dataset": self.name, "num_classes": self.num_classes, "input_shape": list(self.input_shape),
                "mean": list(self.mean), "std": list(self.std), "classes": list(self.classes),
                "input_scale": PIXEL_SCALE if self.pixels else FLOAT_SCALE}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DataShape:
        """The inverse of :meth:`as_dict` (a checkpoint's ``info``)."""
        channels, height, width = (int(v) for v in d["input_shape"])
        return cls(str(d.get("dataset", "")), int(d["num_classes"]), channels, height, width,
                   mean=tuple(float(m) for m in d.get("mean", ())),
                   std=tuple(float(s) for s in d.get("std", ())),
                   classes=tuple(str(c) for c in d.get("classes", ())),
                   pixels=d.get("input_scale", PIXEL_SCALE) == PIXEL_SCALE)


def build_plugin(source: ModelSource, data: DataShape, *, norm: str, precision: PrecisionConfig,
                 groups: int) -> tuple[Conversion, str]:
    """The user's model converted for ``precision``, and its structural fingerprint."""
    plain = source.build_plain(data.num_classes, data.in_channels)
    check_fits(plain, source.ref, data)
    architecture = [[name, type(m).__name__] for name, m in plain.named_modules() if name]
    conversion = convert(plain, precision, norm=norm, groups=groups)
    conversion.count_macs((1, *data.input_shape))  # on a meta-device copy: no memory, no kernels probed
    return conversion, structure_fingerprint(architecture, conversion.model, data, norm=norm, groups=groups)


def check_fits(model: nn.Module, ref: str, data: DataShape) -> None:
    """Refuse, in one line, a model that cannot take ``data``'s input or gives another number of classes."""
    c, h, w = data.input_shape
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = model(torch.zeros(2, c, h, w))
    except Exception as exc:  # any failure of the user's forward is a mismatch to report, not a crash
        expects = _first_layer_inputs(model)
        detail = f"; its first layer {expects}" if expects else ""
        reason = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise ModelSourceError(f"model {ref} cannot take dataset {data.name}'s input {c}x{h}x{w}{detail} "
                               f"({type(exc).__name__}: {reason})") from None
    finally:
        model.train(was_training)
    if not isinstance(out, torch.Tensor) or out.dim() != 2:
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ModelSourceError(f"model {ref}: expected logits [batch, classes] for dataset {data.name}, got {shape}")
    if out.shape[1] != data.num_classes:
        raise ModelSourceError(f"model {ref} outputs {out.shape[1]} classes, dataset {data.name} has "
                               f"{data.num_classes}")


def _first_layer_inputs(model: nn.Module) -> str:
    for name, module in model.named_modules():
        if isinstance(module, nn.Conv2d):
            return f"{name} ({type(module).__name__}) expects {module.in_channels} input channels"
        if isinstance(module, nn.Linear):
            return f"{name} (Linear) expects {module.in_features} input features"
    return ""


def structure_fingerprint(architecture: list[list[str]], model: nn.Module, data: DataShape, *, norm: str,
                          groups: int) -> str:
    """16-hex-char sha256 of the user's module types (as written), the converted model's parameter names and
    shapes, the norm and the data's classes and channels. Not the precision: an fp32 master copy of the same
    parameters exists in every mode, so peers of different precisions average their models (as for the registry)."""
    params = [[n, list(p.shape)] for n, p in model.named_parameters()]
    blob = json.dumps({"source": "plugin", "modules": architecture, "params": params, "norm": norm,
                       "groups": groups, "num_classes": data.num_classes, "in_channels": data.in_channels},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:_DIGEST_HEX_CHARS]
