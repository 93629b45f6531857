"""Rewrite any PyTorch model for a precision mode: the standard layers it can rewrite become peer.lowp's 8-bit layers
with the same parameters; everything else stays fp32 and is listed with the reason (conversion.py: rows, MACs,
table).

Rewritten module by module (the model's own ``forward`` is untouched):

* nn.Conv2d (any groups - depthwise included -, stride, dilation; padding_mode 'zeros'; numeric padding, or 'valid' /
  'same' where that is a symmetric numeric padding) -> QConv2d; nn.Linear -> QLinear. The new layer holds the SAME
  Parameter objects: names, values and optimizer state unchanged.
* nn.BatchNorm2d -> the chosen ``norm``:

  - followed by a rectifier-like activation (ReLU, ReLU6, LeakyReLU, Hardswish, SiLU, GELU, Mish) as the next module
    of an nn.Sequential (torchvision's Conv2dNormActivation: conv, bn, act): the pair becomes
    ``make_norm_act(norm, channels, precision, groups)`` - the norm's own gate (``x sigmoid(v x)``, ``x hsig(v x)``)
    stands in for the activation, as the paper's EvoNorms replace BN + ReLU - and the activation's slot becomes
    nn.Identity, so the Sequential's indices, hence the parameter names after it, stay;
  - not followed by one (MobileNetV3's linear projections, shortcut norms, and every BN whose activation is called
    from a ``forward`` method, e.g. torchvision's BasicBlock ``relu(bn1(x))``: invisible to a module rewrite) -> the
    same norm WITHOUT its activation (EvoNormS0Linear, RangeEvoNormLinear: ``v`` dropped, the gate fixed at 1).
    Adding a nonlinearity there would change what the architecture computes; the activation the forward applies
    afterwards is converted on its own (MaskReLU, ...);
  - either way the BN's weight and bias initialise gamma and beta (a zero-initialised residual BN stays a
    zero-initialised norm); its running statistics are dropped. Its parameter names change (``weight``, ``bias`` ->
    ``v``, ``gamma``, ``beta``): see Conversion.params_removed / params_added;
  - norm="batchnorm": BN + ReLU -> BatchNormAct around the SAME BatchNorm2d (``x.weight`` -> ``x.bn.weight``); a BN
    followed by anything else is kept (BatchNormAct's ReLU would replace its activation or add one);
  - norm="keep": every BatchNorm2d is kept (fp32), so with precision fp32 the model computes exactly what it did.

* ReLU, ReLU6, Hardsigmoid, Hardswish, MaxPool2d (dilation 1, floor mode, overlapping windows included) and Dropout
  -> their 1-byte-mask forms (masks.py): plain torch in fp32 and sim8; ``inplace`` kept.

Invisible to a module rewrite, so fp32 as written: tensor operations inside a ``forward`` (torchvision BasicBlock's
``out += identity``, MobileNetV3 SE block's ``scale * input`` - which saves its fp32 input for backward -, F.relu or
torch.flatten calls, attention products). Not rewritten, and listed: modules with forward/backward hooks (old-style
weight_norm, pruning: replacing them would drop the hooks), parametrized modules (weight_norm, spectral_norm),
subclasses of the rewritten types (their forward may differ), layers already low-precision (hand-written models:
listed as such), and every type without an 8-bit form here.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import chain
from typing import Any, TypeVar

import torch
from torch import nn
from torch.nn.utils import parametrize

from peer.lowp.conversion import Conversion, LayerRow
from peer.lowp.evonorm import (
    BatchNormAct,
    EvoNormS0,
    EvoNormS0Linear,
    RangeEvoNorm,
    RangeEvoNormLinear,
    make_norm_act,
)
from peer.lowp.kinds import NORM_KINDS
from peer.lowp.layers import QAdd, QConv2d, QLinear
from peer.lowp.masks import (
    MaskDropout,
    MaskHardsigmoid,
    MaskHardswish,
    MaskMaxPool2d,
    MaskReLU,
    MaskReLU6,
)
from peer.lowp.precision import PrecisionConfig

#: ``norm`` choices: a kind of NORM_KINDS, or "keep" (BatchNorm2d stays).
NORM_CHOICES = (*NORM_KINDS, "keep")
#: Activations an EvoNorm's gate stands in for when they directly follow a BatchNorm2d.
FOLDED_ACTIVATIONS = (nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.Hardswish, nn.SiLU, nn.GELU, nn.Mish)
AnyModule = TypeVar("AnyModule", bound=nn.Module)

_LINEAR_NORMS = {"evonorm": EvoNormS0Linear, "range-evonorm": RangeEvoNormLinear}
_NO_COMPUTE = (nn.Identity, nn.Flatten, nn.Unflatten)
_MASK_LAYERS = (MaskReLU, MaskReLU6, MaskHardsigmoid, MaskDropout, MaskMaxPool2d)
_CODE_LAYERS = (QConv2d, QLinear, QAdd, EvoNormS0, RangeEvoNorm, EvoNormS0Linear, RangeEvoNormLinear)


def convert(model: nn.Module, precision: PrecisionConfig, *, norm: str = "range-evonorm",
            groups: int = 8) -> Conversion:
    """Rewrite ``model`` in place for ``precision`` (a resolved config: ``ResolvedPrecision.config_in_use``) and
    return the :class:`Conversion` (its ``model`` is ``model``, or the new layer where ``model`` itself is one).

    ``norm`` in NORM_CHOICES picks what BatchNorm2d layers become; ``groups``: channel groups of the EvoNorms (the
    largest divisor of the channel count not above it). See the module docstring for every rule.
    """
    if not isinstance(precision, PrecisionConfig):
        raise TypeError(f"precision must be a PrecisionConfig (ResolvedPrecision.config_in_use), "
                        f"got {type(precision).__name__}")
    if norm not in NORM_CHOICES:
        raise ValueError(f"norm must be one of {NORM_CHOICES}, got {norm!r}")
    if groups < 1:
        raise ValueError(f"groups must be >= 1, got {groups}")
    params, buffers = _names(model)
    rewriter = _Rewriter(precision, norm, groups)
    model = rewriter.root(model)
    params_after, buffers_after = _names(model)
    return Conversion(model, precision, norm, rewriter.rows,
                      params_removed=tuple(n for n in params if n not in params_after),
                      params_added=tuple(n for n in params_after if n not in params),
                      buffers_removed=tuple(n for n in buffers if n not in buffers_after),
                      buffers_added=tuple(n for n in buffers_after if n not in buffers))


class _Rewriter:
    """One conversion: walks the module tree, replaces layers in their parents, and records one row per layer."""

    def __init__(self, precision: PrecisionConfig, norm: str, groups: int) -> None:
        self.precision = precision
        self.norm = norm
        self.groups = groups
        self.rows: list[LayerRow] = []
        self._done: dict[int, nn.Module] = {}  # id(original) -> what replaced it: a shared module is rewritten once

    def root(self, model: nn.Module) -> nn.Module:
        """The converted model: ``model`` with its layers replaced, or the replacement of ``model`` if it is one."""
        if _is_layer(model):
            return self._layer(model, "")
        self._children(model, "")
        return model

    def _children(self, parent: nn.Module, prefix: str) -> None:
        if parent._parameters and any(p is not None for p in parent._parameters.values()):
            own = sum(p.numel() for p in parent._parameters.values() if p is not None)
            self._row(prefix.rstrip("."), parent, parent, "fp32", own, "kept",
                      "own parameters used inline in its forward (no layer to rewrite)")
        items = [(name, child) for name, child in parent._modules.items() if child is not None]
        in_order = isinstance(parent, nn.Sequential) and type(parent).forward is nn.Sequential.forward
        folded: set[str] = set()
        for index, (name, child) in enumerate(items):
            if name in folded:
                continue
            if not _is_layer(child):
                self._children(child, f"{prefix}{name}.")
                continue
            if id(child) in self._done:
                setattr(parent, name, self._done[id(child)])
                continue
            after = items[index + 1] if in_order and index + 1 < len(items) else None
            if type(child) is nn.BatchNorm2d and after is not None and self._folds(child, after[1]):
                new = self._norm_act(child, f"{prefix}{name}", after[1], f"{prefix}{after[0]}")
                setattr(parent, after[0], nn.Identity())
                folded.add(after[0])
            else:
                new = self._layer(child, f"{prefix}{name}")
            self._done[id(child)] = new
            setattr(parent, name, new)

    # ---- one layer ------------------------------------------------------------------------------------------------

    def _layer(self, m: nn.Module, name: str) -> nn.Module:
        """``m``'s replacement (``m`` itself where kept), its row recorded."""
        params = sum(p.numel() for p in m.parameters())
        if isinstance(getattr(m, "precision", None), PrecisionConfig):
            self._row(name, m, m, precision_path(m), params, "low-precision")
            return m
        if _has_hooks(m):
            self._row(name, m, m, "fp32", params, "kept",
                      "has forward/backward hooks (weight_norm, pruning, ...): replacing it would drop them")
            return m
        if parametrize.is_parametrized(m):
            self._row(name, m, m, "fp32", params, "kept",
                      "parametrized (weight_norm, spectral_norm, ...): its weight is computed by the parametrization")
            return m
        if type(m) in _NO_COMPUTE:
            self._row(name, m, m, "-", params, "no compute")
            return m
        rule = _RULES.get(type(m))
        new, reason = rule(self, m) if rule is not None else (None, kept_reason(m))
        if new is None:
            self._row(name, m, m, "fp32", params, "kept", reason)
            return m
        self._row(name, m, new, precision_path(new), sum(p.numel() for p in new.parameters()), "converted")
        return new

    def _folds(self, bn: nn.BatchNorm2d, act: nn.Module) -> bool:
        """Whether ``act``, the module right after ``bn`` in a Sequential, goes into ``bn``'s replacement."""
        if _has_hooks(bn) or _has_hooks(act):
            return False
        if self.norm == "batchnorm":
            return type(act) is nn.ReLU
        return self.norm in _LINEAR_NORMS and type(act) in FOLDED_ACTIVATIONS

    def _norm_act(self, bn: nn.BatchNorm2d, name: str, act: nn.Module, act_name: str) -> nn.Module:
        """``bn`` and the activation ``act`` after it as one norm-activation layer; rows for both."""
        new = make_norm_act(self.norm, bn.num_features, self.precision, self.groups)
        if isinstance(new, BatchNormAct):
            new.bn = bn
            _adopt(new, bn, ())
        else:
            _init_from_batchnorm(_adopt(new, bn, ()), bn)
        self._row(name, bn, new, precision_path(new), sum(p.numel() for p in new.parameters()), "converted")
        self._row(act_name, act, nn.Identity(), "folded", 0, "folded", f"computed in {name} ({type(new).__name__})")
        return new

    def _row(self, name: str, before: nn.Module, after: nn.Module, path: str, params: int, status: str,
             reason: str = "") -> None:
        self.rows.append(LayerRow(name, type(before).__name__, type(after).__name__, path, params, status, reason))

    # ---- rules: (replacement or None, why kept) -------------------------------------------------------------------

    def _conv(self, m: nn.Conv2d) -> tuple[nn.Module | None, str]:
        if m.padding_mode != "zeros":
            return None, f"padding_mode {m.padding_mode!r}: the 8-bit convolution pads with zeros only"
        padding: tuple[int, int] | str | None = m.padding if isinstance(m.padding, str) else _pair(m.padding)
        if self.precision.quantized:
            if m.weight.dtype != torch.float32:
                return None, f"{m.weight.dtype} weights: 8-bit layers keep fp32 master weights"
            padding = numeric_padding(m)
        if padding is None:
            return None, "padding 'same' with an odd total (asymmetric): 8-bit convolutions take symmetric padding"
        new = QConv2d(m.in_channels, m.out_channels, _pair(m.kernel_size), _pair(m.stride), padding,
                      _pair(m.dilation), m.groups, m.bias is not None, precision=self.precision)
        return _adopt(new, m, ("weight", "bias")), ""

    def _linear(self, m: nn.Linear) -> tuple[nn.Module | None, str]:
        if self.precision.quantized and m.weight.dtype != torch.float32:
            return None, f"{m.weight.dtype} weights: 8-bit layers keep fp32 master weights"
        new = QLinear(m.in_features, m.out_features, m.bias is not None, precision=self.precision)
        return _adopt(new, m, ("weight", "bias")), ""

    def _batchnorm(self, m: nn.BatchNorm2d) -> tuple[nn.Module | None, str]:
        if self.norm == "keep":
            return None, "norm='keep': BatchNorm2d kept (saves its fp32 input for backward)"
        if self.norm == "batchnorm":
            return None, ("norm='batchnorm': BatchNormAct is BatchNorm2d + ReLU and no ReLU follows this one in an "
                          "nn.Sequential (kept as it is)")
        new = _LINEAR_NORMS[self.norm](m.num_features, self.groups, precision=self.precision)
        return _init_from_batchnorm(_adopt(new, m, ()), m), ""

    def _activation(self, m: nn.Module) -> tuple[nn.Module | None, str]:
        mask = {nn.ReLU: MaskReLU, nn.ReLU6: MaskReLU6, nn.Hardsigmoid: MaskHardsigmoid,
                nn.Hardswish: MaskHardswish}[type(m)]
        return _adopt(mask(self.precision, inplace=getattr(m, "inplace", False)), m, ()), ""

    def _max_pool(self, m: nn.MaxPool2d) -> tuple[nn.Module | None, str]:
        kernel = _pair(m.kernel_size)
        if _pair(m.dilation) != (1, 1) or m.ceil_mode or m.return_indices or kernel[0] * kernel[1] > 256:
            return None, ("dilated, ceil-mode, index-returning or > 256-tap windows: torch saves the fp32 input and "
                          "int64 indices")
        new = MaskMaxPool2d(kernel, self.precision, stride=m.stride, padding=m.padding)
        return _adopt(new, m, ()), ""

    def _dropout(self, m: nn.Dropout) -> tuple[nn.Module | None, str]:
        return _adopt(MaskDropout(m.p, self.precision, inplace=m.inplace), m, ()), ""


#: The rewrite rule of each layer type (each takes a module of its key's type).
_RULES: dict[type[nn.Module], Callable[[_Rewriter, Any], tuple[nn.Module | None, str]]] = {nn.Conv2d: _Rewriter._conv, nn.Linear: _Rewriter._linear, nn.BatchNorm2d: _Rewriter._batchnorm,
          nn.ReLU: _Rewriter._activation, nn.ReLU6: _Rewriter._activation, nn.Hardsigmoid: _Rewriter._activation,
          nn.Hardswish: _Rewriter._activation, nn.MaxPool2d: _Rewriter._max_pool, nn.Dropout: _Rewriter._dropout}

#: Why a layer type without a rule stays fp32 (first match), after the subclass check.
_KEPT: tuple[tuple[tuple[type, ...], str], ...] = (
    ((nn.modules.conv._ConvNd,), "no 8-bit kernel for this convolution (2-D, non-transposed ones only)"),
    ((nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm),
     "no 8-bit form of this norm here (saves its fp32 input for backward)"),
    ((nn.SiLU, nn.GELU, nn.Sigmoid, nn.Tanh, nn.ELU, nn.SELU, nn.CELU, nn.Mish, nn.Softplus, nn.LeakyReLU, nn.PReLU,
      nn.Hardtanh, nn.Softmax, nn.LogSoftmax),
     "activation without a 1-byte form here (its gradient reads the fp32 input or output)"),
    ((nn.Embedding, nn.EmbeddingBag), "embedding lookup: no 8-bit form here"),
    ((nn.RNNBase, nn.MultiheadAttention, nn.Transformer, nn.TransformerEncoderLayer, nn.TransformerDecoderLayer),
     "no 8-bit form here (products inside its own forward)"),
)


def kept_reason(m: nn.Module) -> str:
    """Why ``m`` (a layer no rule rewrites) stays fp32."""
    for base in _RULES:
        if isinstance(m, base):
            return f"subclass of nn.{base.__name__}: its own forward may differ"
    if isinstance(m, (nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d)):
        size = m.output_size if isinstance(m.output_size, tuple) else (m.output_size,)
        if all(s == 1 for s in size):
            return "global average pooling: a mean, saves nothing for backward"
        return "average pooling: fp32, its fp32 input is kept for backward (torch reads only its shape)"
    if isinstance(m, (nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d)):
        return "average pooling: fp32, its fp32 input is kept for backward (torch reads only its shape)"
    for types, reason in _KEPT:
        if isinstance(m, types):
            return reason
    return f"no 8-bit form for {type(m).__name__}"


def precision_path(m: nn.Module) -> str:
    """How a low-precision layer computes in its mode (LayerRow.path)."""
    precision = getattr(m, "precision", None)
    if not isinstance(precision, PrecisionConfig):
        raise ValueError(f"{type(m).__name__} is not a low-precision layer")
    mode = precision.mode
    if isinstance(m, _CODE_LAYERS):
        return "int8 codes" if mode == "int8" else mode
    if isinstance(m, BatchNormAct):
        return "fp32" if mode == "fp32" else "8-bit input, fp32 BN"
    if isinstance(m, MaskHardswish):
        return "1-byte code" if mode == "int8" else "fp32"
    if isinstance(m, MaskMaxPool2d) and m._window is None and m._strided is None:
        return "fp32"
    if isinstance(m, _MASK_LAYERS):
        return "1-byte mask" if mode == "int8" else "fp32"
    return mode


def numeric_padding(conv: nn.Conv2d) -> tuple[int, int] | None:
    """``conv``'s padding as numbers: as is, 'valid' = 0, 'same' = half the total per side where the total
    (dilation x (kernel - 1)) is even; None where 'same' is asymmetric."""
    if not isinstance(conv.padding, str):
        return _pair(conv.padding)
    if conv.padding == "valid":
        return (0, 0)
    h, w = (d * (k - 1) for d, k in zip(conv.dilation, conv.kernel_size))
    return None if h % 2 or w % 2 else (h // 2, w // 2)


def _is_layer(m: nn.Module) -> bool:
    """A module the converter rewrites or keeps whole: a leaf, a low-precision layer (children: its quantizers) or a
    parametrized one (children: its parametrizations)."""
    return (not m._modules or isinstance(getattr(m, "precision", None), PrecisionConfig)
            or parametrize.is_parametrized(m))


def _has_hooks(m: nn.Module) -> bool:
    return bool(m._forward_pre_hooks or m._forward_hooks or m._backward_hooks or m._backward_pre_hooks)


def _pair(v: int | tuple[int, ...]) -> tuple[int, int]:
    """A 2-D layer's (height, width) setting, which torch types as an int or a tuple of any length."""
    return (v, v) if isinstance(v, int) else (v[0], v[1])


def _adopt(new: AnyModule, old: nn.Module, params: tuple[str, ...]) -> AnyModule:
    """``new`` on ``old``'s device, in its train / eval state, holding ``old``'s Parameter objects named ``params``."""
    like = next(chain(old.parameters(), old.buffers()), None)
    if like is not None:
        new.to(like.device)
    for name in params:
        if getattr(old, name, None) is not None:
            setattr(new, name, getattr(old, name))
    return new.train(old.training)


@torch.no_grad()
def _init_from_batchnorm(norm: nn.Module, bn: nn.BatchNorm2d) -> nn.Module:
    """``norm``'s gamma and beta set to ``bn``'s weight and bias (affine BNs)."""
    if bn.affine:
        gamma, beta = norm.get_parameter("gamma"), norm.get_parameter("beta")
        gamma.copy_(bn.weight.reshape(gamma.shape))
        beta.copy_(bn.bias.reshape(beta.shape))
    return norm


def _names(model: nn.Module) -> tuple[list[str], list[str]]:
    """Parameter names and persistent buffer names (state_dict keys that are not parameters) of ``model``."""
    params = [name for name, _ in model.named_parameters()]
    taken = set(params)
    return params, [key for key in model.state_dict() if key not in taken]
