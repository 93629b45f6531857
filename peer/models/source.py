"""A model source: the user's own architecture (torchvision, a module, a file, a callable) or a registry model.

Plug-in models are built as the user wrote them (``build_plain``: the unconverted module, with ``--model-weights``
loaded), then rewritten for the precision by :func:`peer.lowp.convert.convert`, which keeps parameter names and
values. The plain module is also what ``lpdl-peer export`` writes a state dict for, so the trained model loads back
into the user's class or torchvision's without this package.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from peer.errors import PeerError
from peer.models.kinds import ModelRef, parse_model_ref, parse_options
from peer.plugins import PluginError, accepted_kwargs, import_callable


class ModelSourceError(PeerError, ValueError):
    """A model source cannot be loaded or does not fit the data; the message is one line naming both sides."""

    default_reason = "model_source"


@dataclass
class ModelSource:
    """Where a peer's model comes from.

    Attributes:
        ref: the model as the user named it (``torchvision:resnet18``, ``nets.py:Net``, ``mnist-cnn``); for a
            callable given in code, ``python:<qualified name>``.
        kind: registry, torchvision, module, file or python (peer.models.kinds.MODEL_SOURCES).
        options: keyword options passed to the builder (``--model-options width_mult=0.5``).
        weights: a local state dict (safetensors or torch) loaded into the plain model before conversion.
        factory: the callable that builds the plain model (None for the registry).
    """

    ref: str
    kind: str
    options: dict[str, Any] = field(default_factory=dict)
    weights: str | None = None
    factory: Callable[..., nn.Module] | None = field(default=None, repr=False)

    @classmethod
    def parse(cls, ref: str, options: tuple[str, ...] = (), weights: str | None = None) -> ModelSource:
        """The source a ``--model`` value names (its callable is imported later, at build time)."""
        try:
            parsed = parse_model_ref(ref)
            opts = parse_options(options)
        except ValueError as exc:
            raise ModelSourceError(f"model: {exc}") from None
        return cls(ref=str(parsed), kind=parsed.kind, options=opts, weights=weights)

    @classmethod
    def from_callable(cls, factory: Callable[..., nn.Module], options: dict[str, Any] | None = None,
                      weights: str | None = None) -> ModelSource:
        """A source for a callable given in code (the Python API): ``factory(**accepted) -> nn.Module``."""
        if not callable(factory):
            raise ModelSourceError(f"model: expected a callable returning an nn.Module, got {factory!r}")
        name = re.sub(r"\W", "_", getattr(factory, "__qualname__", type(factory).__name__))
        return cls(ref=f"python:{name}", kind="python", options=dict(options or {}), weights=weights,
                   factory=factory)

    @property
    def plugin(self) -> bool:
        """True for the user's own models (converted), False for the hand-written registry architectures."""
        return self.kind != "registry"

    def build_plain(self, num_classes: int, in_channels: int) -> nn.Module:
        """The user's model as written (not converted), with ``weights`` loaded where given."""
        if not self.plugin:
            raise ModelSourceError(f"model {self.ref}: registry models are built by peer.models.registry")
        factory = self.factory or _import_factory(parse_model_ref(self.ref))
        offered = {"num_classes": num_classes, "in_channels": in_channels}
        if self.kind == "torchvision":  # its builders take num_classes and pass other keywords to the class
            del offered["in_channels"]
        kwargs = _call_kwargs(factory, offered, self.options, self.ref)
        try:
            model = factory(**kwargs)
        except TypeError as exc:
            raise ModelSourceError(f"model {self.ref}: calling it with {sorted(kwargs)} failed: {exc}") from None
        if not isinstance(model, nn.Module):
            raise ModelSourceError(f"model {self.ref}: expected an nn.Module, got {type(model).__name__}")
        if self.weights:
            load_weights(model, self.weights, self.ref)
        return model


def _import_factory(ref: ModelRef) -> Callable[..., nn.Module]:
    """The builder a parsed reference names: torchvision's, a module's attribute or a file's."""
    if ref.kind == "torchvision":
        return _torchvision_builder(ref.target)
    if ref.kind == "python":
        raise ModelSourceError(f"model {ref}: a model given in code as a callable; build it through peer.api "
                               f"(or name it as MODULE:CALLABLE)")
    try:
        return import_callable(ref.target, ref.attr, f"model {ref}")
    except PluginError as exc:
        raise ModelSourceError(str(exc)) from None


def _torchvision_builder(name: str) -> Callable[..., nn.Module]:
    try:
        from torchvision import models
    except ImportError:
        raise ModelSourceError("model torchvision:...: torchvision is not installed (pip install "
                               "'lpdl-peer[vision]')") from None
    known = models.list_models(module=models)
    if name not in known:
        raise ModelSourceError(f"model torchvision:{name}: not a torchvision classification model; e.g. "
                               f"{', '.join(k for k in known if k.startswith(('resnet1', 'mobilenet')))}")

    def build(num_classes: int, **options: Any) -> nn.Module:
        return models.get_model(name, weights=None, num_classes=num_classes, **options)

    return build


def _call_kwargs(factory: Callable[..., Any], offered: dict[str, Any], options: dict[str, Any],
                 ref: str) -> dict[str, Any]:
    """What ``factory`` is called with: ``num_classes`` / ``in_channels`` where accepted, and the user's options,
    every one of which it must accept."""
    kwargs = accepted_kwargs(factory, {**offered, **options})
    unknown = sorted(set(options) - set(kwargs))
    if unknown:
        raise ModelSourceError(f"model {ref}: does not accept option(s) {', '.join(unknown)}")
    return kwargs


def load_weights(model: nn.Module, path: str, ref: str) -> list[str]:
    """Load a state dict file (safetensors, or torch's format read weights-only) into ``model`` by name.

    Entries whose shape differs from the model's (a classifier head of another class count, when fine-tuning a
    pretrained model) are skipped; returns their names. A file sharing no entry with the model is an error.
    """
    state = read_state_dict(path)
    own = model.state_dict()
    matched = {k: v for k, v in state.items() if k in own and tuple(v.shape) == tuple(own[k].shape)}
    if not matched:
        raise ModelSourceError(f"model {ref}: weights file {path} shares no tensor (name and shape) with the model")
    model.load_state_dict(matched, strict=False)
    return sorted(k for k in state if k not in matched)


def read_state_dict(path: str) -> dict[str, torch.Tensor]:
    """A state dict from a ``.safetensors`` file or a torch file (a bare state dict, or one under
    ``state_dict`` / ``model``), read without running code."""
    file = Path(path)
    if not file.is_file():
        raise ModelSourceError(f"model weights: file {file} not found")
    if file.suffix == ".safetensors":
        try:
            from safetensors.torch import load_file
        except ImportError:
            raise ModelSourceError("model weights: .safetensors files need the `export` extra "
                                   "(pip install 'lpdl-peer[export]')") from None
        return load_file(str(file))
    try:
        obj = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ModelSourceError(f"model weights: {file} is not a readable state dict ({exc})") from None
    for key in ("state_dict", "model"):
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise ModelSourceError(f"model weights: {file} does not hold a state dict of tensors")
    return obj
