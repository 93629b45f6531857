"""What :func:`peer.lowp.convert.convert` did to a model: one row per layer, the fp32 leftovers and why, the
multiply-adds per layer and the share of them that runs in 8-bit, as a plain-text table (start, simulate, train,
status print it).

Multiply-adds (MACs) are those of convolutions and linear layers, counted on one forward pass of a zero batch of the
given input shape: conv ``output elements x C_in/groups x kernel taps``, transposed conv ``input elements x
C_out/groups x taps``, linear ``output elements x in_features``. Norms, activations and pooling are elementwise (a
few operations per element against hundreds per output of a product layer) and products written inline in a
``forward`` (``x @ w``, attention) are not seen by module hooks: neither is counted. The pass runs on a copy of the
model on the ``meta`` device in fp32 mode (shapes only: no memory, no kernel probing, the model's parameters, running
statistics and quantizer ranges untouched).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from itertools import chain

import torch
from torch import Tensor, nn

from peer.lowp.precision import PrecisionConfig

#: Row statuses: rewritten for the precision, an activation folded into the norm before it, a layer that was
#: already a low-precision one (hand-written models), kept in fp32 (a leftover), or a layer without compute.
STATUSES = ("converted", "folded", "low-precision", "kept", "no compute")
#: Precision paths whose products count as 8-bit.
EIGHT_BIT_PATHS = ("int8 codes", "sim8")


@dataclass
class LayerRow:
    """One layer of the model: its name, type before -> after, precision path, parameter count and status.

    ``path``: "int8 codes" (8-bit products / norms on 1-byte codes), "sim8" (8-bit numerics simulated in fp32),
    "1-byte mask" / "1-byte code" (fp32 output, 1 byte per element saved for backward), "fp32", "folded" (an
    activation computed inside the norm before it), "-" (no compute). ``reason`` says why a kept layer stays fp32.
    """

    name: str
    before: str
    after: str
    path: str
    params: int
    status: str
    reason: str = ""

    @property
    def counted(self) -> bool:
        """Whether the row counts as a layer in "N of M layers converted" (layers without compute do not)."""
        return self.status != "no compute"

    @property
    def converted(self) -> bool:
        """Converted, folded into a norm, or low-precision already."""
        return self.status in ("converted", "folded", "low-precision")


@dataclass(frozen=True)
class MacCount:
    """Multiply-adds of one forward pass of a batch of ``input_shape`` (module doc), per layer and in all.

    ``error`` is set (and the counts are empty) where the forward pass could not run on the meta device (a forward
    that reads tensor values, or inputs other than one tensor).
    """

    input_shape: tuple[int, ...]
    per_layer: dict[str, int] = field(default_factory=dict)
    eight_bit: int = 0
    error: str | None = None

    @property
    def total(self) -> int:
        return sum(self.per_layer.values())

    @property
    def share_8bit(self) -> float:
        """Fraction of the counted multiply-adds that run in 8-bit (0.0 where none were counted)."""
        return self.eight_bit / self.total if self.total else 0.0


@dataclass
class Conversion:
    """The converted ``model`` and what was done to it (see :func:`peer.lowp.convert.convert`).

    Parameter names and values of convolutions and linear layers are unchanged (the same Parameter objects). A
    replaced BatchNorm's parameters get the norm's names (``weight``, ``bias`` -> ``gamma``, ``beta`` and ``v``;
    ``bn.weight``, ``bn.bias`` inside a BatchNormAct): listed in ``params_removed`` / ``params_added``, as are the
    buffers (running statistics removed, the 8-bit layers' quantizer ranges added).
    """

    model: nn.Module
    precision: PrecisionConfig
    norm: str
    rows: list[LayerRow]
    params_removed: tuple[str, ...] = ()
    params_added: tuple[str, ...] = ()
    buffers_removed: tuple[str, ...] = ()
    buffers_added: tuple[str, ...] = ()
    macs: MacCount | None = None

    @property
    def leftovers(self) -> list[LayerRow]:
        """Layers kept in fp32, each with its reason."""
        return [row for row in self.rows if row.status == "kept"]

    def count_macs(self, input_shape: Sequence[int]) -> MacCount:
        """Multiply-adds per layer for one forward pass of a batch of ``input_shape`` (batch dimension included),
        remembered for :meth:`render` and :meth:`to_dict`."""
        self.macs = count_macs(self.model, tuple(input_shape), self._eight_bit_layers())
        return self.macs

    def _eight_bit_layers(self) -> set[str]:
        return {row.name for row in self.rows if row.path in EIGHT_BIT_PATHS}

    def summary(self) -> str:
        """One line: "N of M layers converted; X% of multiply-adds in 8-bit; fp32 leftovers: ..."."""
        counted = [row for row in self.rows if row.counted]
        text = f"{sum(row.converted for row in counted)} of {len(counted)} layers converted; "
        if self.macs is None:
            text += "multiply-adds not counted"
        elif self.macs.error is not None:
            text += f"multiply-adds not counted ({self.macs.error})"
        else:
            text += (f"{100.0 * self.macs.share_8bit:.1f}% of multiply-adds in 8-bit "
                     f"({_si(self.macs.total)} MACs at input {'x'.join(map(str, self.macs.input_shape))})")
        return text + "; fp32 leftovers: " + (_leftover_groups(self.leftovers) or "none")

    def render(self, max_rows: int = 40) -> str:
        """Plain-text table (layer, type, precision path, parameters, MACs), consecutive identical rows merged and at
        most ``max_rows`` of them shown; a line on renamed norm parameters, then :meth:`summary`."""
        macs = self.macs.per_layer if self.macs is not None else {}
        lines = [(f"{len(run)}x {run[0].name} .. {run[-1].name}" if len(run) > 1 else run[0].name,
                  _type_change(run[0]), run[0].path, f"{run[0].params:,}",
                  _si(macs[run[0].name]) if run[0].name in macs else "-")
                 for run in _runs(self.rows, macs)]
        shown = lines[:max_rows]
        header = ("layer", "type", "precision", "params", "MACs")
        widths = [min(max(len(line[i]) for line in [header, *shown]), 48) for i in range(5)]
        out = [_row_text(header, widths)] + [_row_text(line, widths) for line in shown]
        if len(lines) > max_rows:
            out.append(f"... {len(lines) - max_rows} more rows")
        renamed = self._renamed()
        if renamed:
            out.append(renamed)
        out.append(f"precision {self.precision.mode}, norm {self.norm}: {self.summary()}")
        return "\n".join(out)

    def _renamed(self) -> str:
        """One line on the parameter names the conversion changed ("" if none)."""
        if not self.params_removed and not self.params_added:
            return ""
        return (f"parameter names changed (replaced norms; all others unchanged): {len(self.params_removed)} removed "
                f"({_suffixes(self.params_removed)}), {len(self.params_added)} added ({_suffixes(self.params_added)})")

    def to_dict(self) -> dict[str, object]:
        """JSON-ready: modes, the summary line, every row, the leftovers, renamed names and the MAC count."""
        return {"precision": self.precision.mode, "norm": self.norm, "summary": self.summary(),
                "rows": [asdict(row) for row in self.rows],
                "leftovers": [{"name": row.name, "type": row.before, "reason": row.reason} for row in self.leftovers],
                "params_removed": list(self.params_removed), "params_added": list(self.params_added),
                "buffers_removed": list(self.buffers_removed), "buffers_added": list(self.buffers_added),
                "macs": None if self.macs is None else {
                    "input_shape": list(self.macs.input_shape), "total": self.macs.total,
                    "eight_bit": self.macs.eight_bit, "share_8bit": self.macs.share_8bit, "error": self.macs.error,
                    "per_layer": self.macs.per_layer}}


# ---- counting -------------------------------------------------------------------------------------------------------

def product_macs(module: nn.Module, inputs: tuple, output: object) -> int:
    """Multiply-adds of one call of a convolution or linear layer (module doc); 0 for any other module."""
    if not isinstance(output, Tensor):
        return 0
    if isinstance(module, nn.modules.conv._ConvTransposeNd):
        return inputs[0].numel() * math.prod(module.weight.shape[1:])
    if isinstance(module, nn.modules.conv._ConvNd):
        return output.numel() * math.prod(module.weight.shape[1:])
    if isinstance(module, nn.Linear):
        return output.numel() * module.in_features
    return 0


def count_macs(model: nn.Module, input_shape: tuple[int, ...], eight_bit: set[str]) -> MacCount:
    """:class:`MacCount` of ``model`` for a zero batch of ``input_shape``; ``eight_bit`` names the layers whose
    products run in 8-bit. Runs on a meta-device fp32 copy (module doc): ``model`` is untouched."""
    try:
        shadow = _meta_copy(model)
    except Exception as exc:  # an attribute deepcopy cannot copy (a lock, a file): report, never break the caller
        return MacCount(input_shape, error=f"model not copyable: {type(exc).__name__}: {exc}"[:200])
    per_layer: dict[str, int] = {}
    names = {module: name for name, module in shadow.named_modules()}

    def hook(module: nn.Module, inputs: tuple, output: object) -> None:
        macs = product_macs(module, inputs, output)
        if macs:
            per_layer[names[module]] = per_layer.get(names[module], 0) + macs

    for module in names:
        module.register_forward_hook(hook)
    try:
        with torch.no_grad():
            shadow.eval()(torch.zeros(input_shape, device="meta"))
    except Exception as exc:  # a forward that reads values (.item(), data-dependent control flow) cannot run on meta
        return MacCount(input_shape, error=f"forward failed on the meta device: {type(exc).__name__}: {exc}"[:200])
    return MacCount(input_shape, per_layer, sum(n for name, n in per_layer.items() if name in eight_bit))


_FP32 = PrecisionConfig()


def _meta_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with every parameter and buffer on the meta device (nothing allocated) and every layer's
    precision set to fp32 (shapes as in any mode, no kernels probed, no quantizer touched), without hooks."""
    memo: dict[int, object] = {}
    for module in model.modules():
        precision = getattr(module, "precision", None)
        if isinstance(precision, PrecisionConfig):
            memo[id(precision)] = _FP32
    for t in chain(model.parameters(), model.buffers()):
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(meta, t.requires_grad) if isinstance(t, nn.Parameter) else meta
    shadow = copy.deepcopy(model, memo)
    for module in shadow.modules():
        for hooks in (module._forward_pre_hooks, module._forward_hooks, module._backward_hooks):
            hooks.clear()
    return shadow


# ---- text -----------------------------------------------------------------------------------------------------------

def _si(n: int) -> str:
    """``n`` with a k / M / G suffix (3 significant digits)."""
    for factor, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if n >= factor:
            return f"{n / factor:.3g}{suffix}"
    return str(n)


def _type_change(row: LayerRow) -> str:
    return row.before if row.after == row.before else f"{row.before} -> {row.after}"


def _runs(rows: list[LayerRow], macs: dict[str, int]) -> list[list[LayerRow]]:
    """``rows`` cut into runs of consecutive rows identical but for their names (and MACs equal)."""
    runs: list[list[LayerRow]] = []
    for row in rows:
        key = (row.before, row.after, row.path, row.params, row.status, macs.get(row.name))
        last = runs[-1][0] if runs else None
        if last is not None and key == (last.before, last.after, last.path, last.params, last.status,
                                        macs.get(last.name)):
            runs[-1].append(row)
        else:
            runs.append([row])
    return runs


def _row_text(cells: Sequence[str], widths: list[int]) -> str:
    name, kind, path, params, macs = (_clip(c, w) for c, w in zip(cells, widths))
    return (f"{name:<{widths[0]}}  {kind:<{widths[1]}}  {path:<{widths[2]}}  {params:>{widths[3]}}  "
            f"{macs:>{widths[4]}}").rstrip()


def _clip(text: str, width: int) -> str:
    """``text`` cut to ``width`` characters, its middle elided."""
    if len(text) <= width:
        return text
    keep = width - 3
    return text[:keep // 2] + "..." + text[len(text) - (keep - keep // 2):]


def _leftover_groups(rows: list[LayerRow]) -> str:
    """Leftovers grouped by type and reason: "3x AdaptiveAvgPool2d (reason); MaxPool2d maxpool (reason)"."""
    groups: dict[tuple[str, str], list[str]] = {}
    for row in rows:
        groups.setdefault((row.before, row.reason), []).append(row.name)
    return "; ".join(f"{len(names)}x {kind} ({reason})" if len(names) > 1 else f"{kind} {names[0]} ({reason})"
                     for (kind, reason), names in groups.items())


def _suffixes(names: tuple[str, ...]) -> str:
    """The distinct last components of dotted ``names``, e.g. "weight, bias"."""
    return ", ".join(dict.fromkeys(name.rsplit(".", 1)[-1] for name in names))
