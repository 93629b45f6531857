"""The trained model as a plain fp32 PyTorch module, rebuilt from a checkpoint's spec and ``info``.

The model is built in fp32 (the fp32 master weights are what every precision trains; the 8-bit layers are
nn.Conv2d / nn.Linear subclasses whose fp32 forward is the plain one), z is loaded through FlatModel and the
buffers by name. An fp32 model has no activation quantizers, so their range buffers, which an 8-bit checkpoint
holds, are left behind (load_buffers ignores names the model lacks): they are no part of the user's architecture.

The state dict written for safetensors is the user's own architecture where it can be: the registry model's state
dict, or for a plug-in model the plain (unconverted) module's, checked by loading it with ``strict=True`` into a
freshly built one. Where the converter replaced the model's norms (Range EvoNorm for BatchNorm) the names differ:
the converted state dict is written anyway and :attr:`Rebuilt.loads_into_source` is False with the reason.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from peer.export.errors import ExportError
from peer.export.sources import Trained
from peer.models.kinds import KEEP_NORM, parse_model_ref, parse_options
from peer.models.source import ModelSource, ModelSourceError
from peer.runtime import state
from peer.runtime.build import build_model_for
from peer.runtime.flat import FlatModel


@dataclass
class Rebuilt:
    """The trained model, ready to export.

    Attributes:
        model: the fp32 model (converted structure for plug-ins), eval mode, z and buffers loaded.
        state_dict: what the safetensors file holds (contiguous copies, no shared storage).
        loads_into: the class the state dict loads into with ``strict=True`` (a call, as text).
        loads_into_source: whether that is the user's own architecture (False where norms were replaced).
        reason: why not, in one line ("" when it loads).
    """

    model: nn.Module
    state_dict: dict[str, torch.Tensor]
    loads_into: str
    loads_into_source: bool
    reason: str = ""


def model_source(trained: Trained, factory: Callable[..., nn.Module] | None) -> ModelSource:
    """The source to rebuild from: the checkpoint's ``--model`` (its weights file is not needed: every parameter
    comes from z), or ``factory`` for a model that was given in code."""
    spec = trained.spec.model
    kind = parse_model_ref(spec.name).kind
    if factory is not None:
        return ModelSource.from_callable(factory, parse_options(spec.options))
    if kind == "python":
        raise ExportError(f"model {spec.name} was given in code as a callable, which a checkpoint cannot rebuild: "
                          f"pass the same callable (peer.export.export_model(..., model=factory))")
    return ModelSource.parse(spec.name, spec.options)


def rebuild(trained: Trained, factory: Callable[..., nn.Module] | None = None) -> Rebuilt:
    """The fp32 model of ``trained`` with its weights, and the state dict to write.

    Raises:
        ExportError: the model cannot be built here (a missing module or file, the converter refusing) or it is
            not the model the checkpoint holds (fingerprint, parameter count).
    """
    source = model_source(trained, factory)
    spec = dataclasses.replace(trained.spec.model, precision="fp32", weights=None)
    data = trained.data
    try:
        built = build_model_for(spec, data, torch.device("cpu"), seed=trained.spec.data.seed, source=source)
    except (ModelSourceError, NotImplementedError, ValueError) as exc:
        raise ExportError(f"model {spec.name}: cannot be rebuilt here ({exc})") from None
    if built.fingerprint != trained.fingerprint:
        raise ExportError(f"model {spec.name} built here has fingerprint {built.fingerprint}, the checkpoint's is "
                          f"{trained.fingerprint}: the model's code differs from the one that trained it")
    flat = FlatModel(built.model)
    if flat.z.numel() != trained.z.numel():
        raise ExportError(f"model {spec.name} has {flat.z.numel()} parameters, the checkpoint {trained.z.numel()}")
    with torch.no_grad():
        flat.z.copy_(trained.z)
    state.load_buffers(built.model, trained.buffers)
    model = built.model.eval()
    for p in model.parameters():
        p.grad = None
        p.requires_grad_(False)
    weights = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    if not source.plugin:
        call = (f"peer.models.build_model({spec.name!r}, num_classes={data.num_classes}, "
                f"in_channels={data.in_channels}, norm={spec.norm!r}, groups={spec.groups})")
        return Rebuilt(model, weights, call, True)
    return _plain_fit(model, weights, source, data.num_classes, data.in_channels, spec.norm)


def _plain_fit(model: nn.Module, weights: dict[str, torch.Tensor], source: ModelSource, num_classes: int,
               in_channels: int, norm: str) -> Rebuilt:
    """Check that the trained weights load, strict, into the user's model as written (built afresh)."""
    options = "".join(f", {k}={v!r}" for k, v in source.options.items())
    call = f"{_describe(source)}(num_classes={num_classes}{options})"
    own = source.build_plain(num_classes, in_channels).state_dict()
    missing = sorted(set(own) - set(weights))
    unknown = sorted(set(weights) - set(own))
    reshaped = sorted(k for k in set(own) & set(weights) if own[k].shape != weights[k].shape)
    if not (missing or unknown or reshaped):
        return Rebuilt(model, weights, call, True)
    if norm != KEEP_NORM:
        why = (f"norm {norm} replaced the model's normalisation layers (other parameter names); the TorchScript and "
               f"ONNX files carry the whole model, or train with --norm keep")
    else:
        first = (missing or unknown or reshaped)[0]
        why = (f"{len(missing)} of its entries missing, {len(unknown)} unknown, {len(reshaped)} of another shape "
               f"(e.g. {first})")
    return Rebuilt(model, weights, call, False, f"does not load into {call}: {why}")


def _describe(source: ModelSource) -> str:
    """How a user loads the state dict: torchvision's builder or the user's own callable, as text."""
    ref = parse_model_ref(source.ref)
    return f"torchvision.models.{ref.target}" if ref.kind == "torchvision" else source.ref
