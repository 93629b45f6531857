"""The trained model as a plain fp32 PyTorch module, rebuilt from a checkpoint's spec and ``info``.

The model is built in fp32 (the fp32 master weights are what every precision trains; the 8-bit layers are
nn.Conv2d / nn.Linear subclasses whose fp32 forward is the plain one), z is loaded through FlatModel and the
buffers by name. An fp32 model has no activation quantizers, so their range buffers, which an 8-bit checkpoint
holds, are left behind (load_buffers ignores names the model lacks): they are no part of the user's architecture.
Where the graphs are to compute the trained 8-bit numerics (peer/export/numerics.py) a second copy is built in sim8
with the same z and those range buffers: the graphs are traced from it, the state dict still comes from the fp32 one.

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
from peer.export.numerics import check_ranges, describe, graph_precision
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
        graph: the model the TorchScript and ONNX graphs are traced from: ``model``, or its sim8 twin (eval mode,
            the checkpoint's activation ranges) for the trained 8-bit numerics.
        graph_numerics: what the graphs compute, in words (the card's ``precision.graph_numerics``).
    """

    model: nn.Module
    state_dict: dict[str, torch.Tensor]
    loads_into: str
    loads_into_source: bool
    reason: str
    graph: nn.Module
    graph_numerics: str


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


def rebuild(trained: Trained, factory: Callable[..., nn.Module] | None = None,
            numerics: str = "trained") -> Rebuilt:
    """The fp32 model of ``trained`` with its weights, the state dict to write, and the model the graphs are traced
    from in ``numerics`` (peer/export/numerics.py).

    Raises:
        ExportError: the model cannot be built here (a missing module or file, the converter refusing), it is not
            the model the checkpoint holds (fingerprint, parameter count), or an 8-bit graph lacks an activation
            range.
    """
    source = model_source(trained, factory)
    spec = trained.spec.model
    model = _built(trained, source, "fp32")
    graph_mode = graph_precision(numerics, spec.precision)
    graph = model
    if graph_mode != "fp32":
        graph = _built(trained, source, graph_mode)
        check_ranges(graph)
    weights = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    data = trained.data
    if source.plugin:
        call, fits, reason = _plain_fit(weights, source, data.num_classes, data.in_channels, spec.norm)
    else:
        call = (f"peer.models.build_model({spec.name!r}, num_classes={data.num_classes}, "
                f"in_channels={data.in_channels}, norm={spec.norm!r}, groups={spec.groups})")
        fits, reason = True, ""
    return Rebuilt(model, weights, call, fits, reason, graph, describe(graph_mode, spec.precision, spec.bits))


def _built(trained: Trained, source: ModelSource, precision: str) -> nn.Module:
    """The model of ``trained`` built in ``precision`` (sim8 needs no kernel probe), z and buffers loaded, eval mode,
    no gradients."""
    spec = dataclasses.replace(trained.spec.model, precision=precision, weights=None)
    try:
        built = build_model_for(spec, trained.data, torch.device("cpu"), seed=trained.spec.data.seed, source=source)
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
    return model


def _plain_fit(weights: dict[str, torch.Tensor], source: ModelSource, num_classes: int, in_channels: int,
               norm: str) -> tuple[str, bool, str]:
    """Whether the trained weights load, strict, into the user's model as written (built afresh): (the call that
    builds it, as text; whether they load; why not, "" when they do)."""
    options = "".join(f", {k}={v!r}" for k, v in source.options.items())
    call = f"{_describe(source)}(num_classes={num_classes}{options})"
    own = source.build_plain(num_classes, in_channels).state_dict()
    missing = sorted(set(own) - set(weights))
    unknown = sorted(set(weights) - set(own))
    reshaped = sorted(k for k in set(own) & set(weights) if own[k].shape != weights[k].shape)
    if not (missing or unknown or reshaped):
        return call, True, ""
    if norm != KEEP_NORM:
        why = (f"norm {norm} replaced the model's normalisation layers (other parameter names); the TorchScript and "
               f"ONNX files carry the whole model, or train with --norm keep")
    else:
        first = (missing or unknown or reshaped)[0]
        why = (f"{len(missing)} of its entries missing, {len(unknown)} unknown, {len(reshaped)} of another shape "
               f"(e.g. {first})")
    return call, False, f"does not load into {call}: {why}"


def _describe(source: ModelSource) -> str:
    """How a user loads the state dict: torchvision's builder or the user's own callable, as text."""
    ref = parse_model_ref(source.ref)
    return f"torchvision.models.{ref.target}" if ref.kind == "torchvision" else source.ref
