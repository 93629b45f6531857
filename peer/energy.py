"""Compute and energy model of one training step and one inference pass (docs/method.md#compute-and-energy, the paper's
section 5).

The model is walked once with forward hooks on a one-sample dummy batch to read each layer's geometry; the operation
counts of docs/method.md#compute-and-energy are then evaluated for batch b and priced with Horowitz (ISSCC 2014,
45 nm) energies.

Counts per layer (O = floor((L + 2P - K) / S) + 1, spatial sizes generalised to H x W, which is L^2 when square):
    term            training (forward + backward)                  inference
    conv            3 b Cout Cin/g K^2 O^2 adds, as many mults     b Cout Cin/g K^2 O^2 adds, as many mults
    linear          3 b Cout Cin adds, as many mults               b Cout Cin adds, as many mults
    act-quant       2 b Cin L^2 adds, 4 b Cin L^2 mults            b Cin L^2 adds, 2 b Cin L^2 mults  (*)
    weight-quant    2 Cout Cin/g K^2 adds, 4 Cout Cin/g K^2 mults  same
    range-BN+ReLU   9 b C L^2 adds, 6 b C L^2 + 7 C mults          3 b C L^2 adds, 2 b C L^2 + 3 C mults
    Range EvoNorm   6 b C L^2 adds, 10 b C L^2 + 5 C mults         2 b C L^2 adds, 4 b C L^2 + 2 C mults
    skip add        2 b C L^2 adds                                 same
    average pool    b C L^2 adds, 2 b C mults                      b C L^2 adds, b C mults
(*) The paper gives no inference count for activation quantization. Training quantizes the
activation in the forward pass and the layer gradient in the backward pass (gradient bifurcation), so inference is
counted as half. EvoNorm-S0 (fp32 models) has no formula there; it is counted with the Range EvoNorm formula (same
structure: gate, per-group statistic, divide, affine). BatchNorm(+ReLU) uses the range-BN+ReLU formula.

Where the 8-bit model's quantized tensors go (docs/method.md#8-bit-local-training), and so how each term is priced in
it:
    conv, linear         int8   (int8 x int8 products; accumulation priced as int8 adds, as the paper does)
    norm, skip add       int8   (their inputs are 8-bit: every norm input and both inputs of a residual add)
    average pool         fp32   (pooling stays in fp32)
    act-/weight-quant    fp32   (range, scale and rounding work on the fp32 tensor)
This is the "quant-fp32" pricing (the default). The "paper" pricing follows the paper's section 5: every add and
multiply of the 8-bit model, quantization arithmetic and pooling included, at the int8 price. Reports carry both.
The fp32 model has no quantization terms and prices everything in fp32. Activations quantized: every conv/linear
input, every norm input, both inputs of each residual add.
Not counted (the paper gives no formula): max pooling, ReLU outside a norm layer (VGG
classifier), dropout, biases. Counts are per training step of b samples; the fp32 model and the 8-bit model share the
walked architecture.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from peer.energy_prices import PJ_FP32_ADD, PJ_FP32_MULT, PJ_INT8_ADD, PJ_INT8_MULT, PRICINGS

__all__ = ["PJ_FP32_ADD", "PJ_FP32_MULT", "PJ_INT8_ADD", "PJ_INT8_MULT", "PRICINGS", "EnergyReport", "LayerShape",
           "OpCount", "PhaseCost", "energy_report", "format_report", "layer_terms", "model_figures", "phase_cost",
           "walk_model"]

#: Terms priced with int8 energies in the 8-bit model; every other term is priced in fp32 (see module docstring).
INT8_TERMS_IN_8BIT = frozenset({"conv", "linear", "norm", "skip"})
QUANT_TERMS = frozenset({"act-quant", "weight-quant"})

_EVONORM_NAMES = frozenset({"RangeEvoNorm", "EvoNormS0"})
_BATCHNORM_NAMES = frozenset({"BatchNormAct", "BatchNorm2d"})
_SKIP_NAMES = frozenset({"QAdd"})
_BLOCK_NAMES = frozenset({"BasicBlock", "Bottleneck"})


@dataclass(frozen=True)
class LayerShape:
    """Geometry of one counted layer, read from the dummy forward pass.

    kind: conv | linear | norm | skip | pool. norm_kind (norms only): range-evonorm | evonorm | batchnorm.
    h, w: input spatial size (linear: h = input rows per sample, 1 for a classifier head, w = 1);
    oh, ow: output spatial size from the O formula (conv only).
    """

    name: str
    kind: str
    cin: int
    cout: int = 0
    k: int = 1
    s: int = 1
    p: int = 0
    groups: int = 1
    h: int = 1
    w: int = 1
    oh: int = 1
    ow: int = 1
    norm_kind: str = ""
    quantized_inputs: int = 0  # activation tensors this layer quantizes in the 8-bit model


@dataclass
class OpCount:
    """Additions and multiplications of one term (plain integer counts)."""

    adds: int = 0
    mults: int = 0

    def __add__(self, other: OpCount) -> OpCount:
        return OpCount(self.adds + other.adds, self.mults + other.mults)

    def energy_pj(self, int8: bool) -> float:
        """Energy in picojoules at int8 or fp32 prices."""
        if int8:
            return self.adds * PJ_INT8_ADD + self.mults * PJ_INT8_MULT
        return self.adds * PJ_FP32_ADD + self.mults * PJ_FP32_MULT


def _norm_kind(module: nn.Module) -> str | None:
    name = type(module).__name__
    if name == "RangeEvoNorm":
        return "range-evonorm"
    if name in _EVONORM_NAMES:
        return "evonorm"
    if name in _BATCHNORM_NAMES or isinstance(module, nn.BatchNorm2d):
        return "batchnorm"
    return None


def _pair(v: int | str | tuple[int, ...]) -> int:
    """The single value of a square kernel/stride/padding; non-square ones (and padding given by name, 'same')
    are not modelled by the paper's counts."""
    if isinstance(v, str):
        raise ValueError(f"padding {v!r} by name is not covered by the energy model")
    if isinstance(v, tuple):
        if len(set(v)) != 1:
            raise ValueError(f"non-square kernel/stride/padding {v} is not covered by the energy model")
        return int(v[0])
    return int(v)


def walk_model(model: nn.Module, input_shape: tuple[int, int, int]) -> list[LayerShape]:
    """Run one dummy sample of shape (C, H, W) through `model` in eval mode and list its counted layers in call order.

    Counted: nn.Conv2d and nn.Linear (including their quantized subclasses), norm layers (RangeEvoNorm, EvoNormS0,
    BatchNormAct or a bare BatchNorm2d), residual adds (QAdd modules; when a model has none, the output of each
    BasicBlock/Bottleneck module counts as one add) and nn.AdaptiveAvgPool2d / nn.AvgPool2d. Norm layers nested
    in another counted norm (the BatchNorm2d inside BatchNormAct) are counted once.
    """
    targets: dict[nn.Module, str] = {}
    norm_prefixes: list[str] = []
    has_qadd = any(type(m).__name__ in _SKIP_NAMES for m in model.modules())
    for name, module in model.named_modules():
        if any(name.startswith(prefix + ".") for prefix in norm_prefixes):
            continue
        if isinstance(module, (nn.Conv2d, nn.Linear, nn.AdaptiveAvgPool2d, nn.AvgPool2d)):
            targets[module] = name
        elif _norm_kind(module) is not None:
            targets[module] = name
            norm_prefixes.append(name)
        elif type(module).__name__ in (_SKIP_NAMES if has_qadd else _BLOCK_NAMES):
            targets[module] = name

    shapes: list[LayerShape] = []

    def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        shapes.append(_shape_of(targets[module], module, inputs, output))

    handles = [m.register_forward_hook(hook) for m in targets]
    was_training = model.training
    try:
        model.eval()
        param = next(model.parameters(), None)
        device = param.device if param is not None else torch.device("cpu")
        with torch.no_grad():
            model(torch.zeros((1, *input_shape), device=device))
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    return shapes


def _shape_of(name: str, module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> LayerShape:
    x = inputs[0]
    if isinstance(module, nn.Conv2d):
        k, s, p = _pair(module.kernel_size), _pair(module.stride), _pair(module.padding)
        h, w = int(x.shape[-2]), int(x.shape[-1])
        return LayerShape(name, "conv", module.in_channels, module.out_channels, k, s, p, module.groups, h, w,
                          (h + 2 * p - k) // s + 1, (w + 2 * p - k) // s + 1, quantized_inputs=1)
    if isinstance(module, nn.Linear):
        return LayerShape(name, "linear", module.in_features, module.out_features,
                          h=x.numel() // module.in_features, quantized_inputs=1)
    if isinstance(module, (nn.AdaptiveAvgPool2d, nn.AvgPool2d)):
        return LayerShape(name, "pool", int(x.shape[1]), h=int(x.shape[-2]), w=int(x.shape[-1]))
    norm = _norm_kind(module)
    if norm is not None:
        return LayerShape(name, "norm", int(x.shape[1]), h=int(x.shape[-2]), w=int(x.shape[-1]), norm_kind=norm,
                          quantized_inputs=1)
    # residual add: QAdd(a, b) or the output of a residual block
    return LayerShape(name, "skip", int(output.shape[1]), h=int(output.shape[-2]), w=int(output.shape[-1]),
                      quantized_inputs=2)


def layer_terms(layer: LayerShape, batch: int, training: bool) -> dict[str, OpCount]:
    """Operation counts per term ("conv", "act-quant", ...) of one layer for `batch` samples (formulas above)."""
    b, c, hw = batch, layer.cin, layer.h * layer.w
    volume = b * c * hw  # elements of the layer input (b Cin L^2)
    terms: dict[str, OpCount] = {}
    if layer.kind in ("conv", "linear"):
        weight = layer.cout * (layer.cin // layer.groups) * layer.k**2  # Cout Cin K^2 (K = 1 for linear)
        positions = layer.oh * layer.ow if layer.kind == "conv" else layer.h  # O^2, or rows per sample for linear
        macs = (3 if training else 1) * b * weight * positions
        terms[layer.kind] = OpCount(macs, macs)
        terms["weight-quant"] = OpCount(2 * weight, 4 * weight)
    elif layer.kind == "norm":
        if layer.norm_kind == "batchnorm":  # range-BN + ReLU
            train_ops, infer_ops = OpCount(9 * volume, 6 * volume + 7 * c), OpCount(3 * volume, 2 * volume + 3 * c)
        else:  # Range EvoNorm (also used for EvoNorm-S0)
            train_ops, infer_ops = OpCount(6 * volume, 10 * volume + 5 * c), OpCount(2 * volume, 4 * volume + 2 * c)
        terms["norm"] = train_ops if training else infer_ops
    elif layer.kind == "skip":
        terms["skip"] = OpCount(2 * volume, 0)
    elif layer.kind == "pool":
        terms["pool"] = OpCount(volume, (2 if training else 1) * b * c)
    if layer.quantized_inputs:
        per_input = OpCount(2 * volume, 4 * volume) if training else OpCount(volume, 2 * volume)
        terms["act-quant"] = OpCount(per_input.adds * layer.quantized_inputs, per_input.mults * layer.quantized_inputs)
    return terms


@dataclass
class PhaseCost:
    """Counts and energy of one layer (or the total) in one phase, for the fp32 and the 8-bit model.

    fp32_ops: all ops of the fp32 model. int8_ops / fp32_ops_8bit: the 8-bit model's ops priced at int8 / fp32.
    Energies in picojoules.
    """

    fp32_ops: OpCount = field(default_factory=OpCount)
    int8_ops: OpCount = field(default_factory=OpCount)
    fp32_ops_8bit: OpCount = field(default_factory=OpCount)

    @property
    def fp32_pj(self) -> float:
        return self.fp32_ops.energy_pj(int8=False)

    @property
    def lowp_pj(self) -> float:
        """The 8-bit model, quantization arithmetic and pooling priced in fp32 ("quant-fp32" pricing)."""
        return self.int8_ops.energy_pj(int8=True) + self.fp32_ops_8bit.energy_pj(int8=False)

    @property
    def lowp_pj_paper(self) -> float:
        """The 8-bit model with every add and multiply at the int8 price ("paper" pricing, its section 5)."""
        return (self.int8_ops + self.fp32_ops_8bit).energy_pj(int8=True)

    def lowp_pj_priced(self, pricing: str) -> float:
        """The 8-bit model's energy (pJ) under ``pricing`` in PRICINGS."""
        if pricing not in PRICINGS:
            raise ValueError(f"pricing must be one of {PRICINGS}, got {pricing!r}")
        return self.lowp_pj_paper if pricing == "paper" else self.lowp_pj

    def __add__(self, other: PhaseCost) -> PhaseCost:
        return PhaseCost(self.fp32_ops + other.fp32_ops, self.int8_ops + other.int8_ops,
                         self.fp32_ops_8bit + other.fp32_ops_8bit)

    def to_dict(self) -> dict[str, object]:
        return {"fp32_model": asdict(self.fp32_ops), "lowp_model_int8": asdict(self.int8_ops),
                "lowp_model_fp32": asdict(self.fp32_ops_8bit), "fp32_pj": self.fp32_pj,
                "lowp_pj_quant_fp32": self.lowp_pj, "lowp_pj_paper": self.lowp_pj_paper}


def phase_cost(layer: LayerShape, batch: int, training: bool) -> PhaseCost:
    """Split a layer's terms into the fp32 model's ops and the 8-bit model's int8 and fp32 ops."""
    cost = PhaseCost()
    for term, ops in layer_terms(layer, batch, training).items():
        if term not in QUANT_TERMS:
            cost.fp32_ops = cost.fp32_ops + ops
        if term in INT8_TERMS_IN_8BIT:
            cost.int8_ops = cost.int8_ops + ops
        else:
            cost.fp32_ops_8bit = cost.fp32_ops_8bit + ops
    return cost


@dataclass
class ModelFigures:
    """Sizes in bytes. int8 model: conv/linear weights as 1-byte codes plus a 4-byte scale each, other parameters
    (biases, norm parameters) fp32. Training memory = weights + gradients + momentum + activations saved for backward
    (the input of every conv, linear and norm layer, 4 bytes each in fp32, 1 byte in 8-bit); the 8-bit model keeps
    fp32 master weights, gradients and momentum (docs/method.md#8-bit-local-training) plus its int8 weight copy."""

    parameters: int
    quantized_parameters: int
    model_bytes_fp32: int
    model_bytes_int8: int
    saved_activations: int
    train_memory_bytes_fp32: int
    train_memory_bytes_int8: int


def model_figures(model: nn.Module, layers: Iterable[LayerShape], batch: int) -> ModelFigures:
    """Parameter count, model size and training-memory estimate for `batch` samples per step."""
    params = sum(p.numel() for p in model.parameters())
    quant_weights = [m.weight for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    quantized = sum(w.numel() for w in quant_weights)
    int8_bytes = quantized + 4 * len(quant_weights) + 4 * (params - quantized)
    saved = sum(batch * layer.cin * layer.h * layer.w for layer in layers if layer.kind in ("conv", "linear", "norm"))
    optimizer_state = 3 * 4 * params  # fp32 weights, gradients, momentum
    return ModelFigures(params, quantized, 4 * params, int8_bytes, saved,
                        optimizer_state + 4 * saved, optimizer_state + int8_bytes + saved)


@dataclass
class EnergyReport:
    """Per-layer costs of one training step (forward + backward of `batch` samples) and one inference pass."""

    batch: int
    layers: list[LayerShape]
    train: list[PhaseCost]
    infer: list[PhaseCost]
    figures: ModelFigures

    @property
    def train_total(self) -> PhaseCost:
        return sum(self.train, PhaseCost())

    @property
    def infer_total(self) -> PhaseCost:
        return sum(self.infer, PhaseCost())

    def to_dict(self) -> dict[str, object]:
        train, infer = self.train_total, self.infer_total
        return {
            "batch": self.batch,
            "prices_pj": {"fp32_add": PJ_FP32_ADD, "fp32_mult": PJ_FP32_MULT,
                          "int8_add": PJ_INT8_ADD, "int8_mult": PJ_INT8_MULT},
            "int8_terms_in_8bit_model": sorted(INT8_TERMS_IN_8BIT),
            "layers": [{**asdict(layer), "train": t.to_dict(), "inference": i.to_dict()}
                       for layer, t, i in zip(self.layers, self.train, self.infer)],
            "total": {"train": train.to_dict(), "inference": infer.to_dict()},
            "ratio_fp32_over_8bit_quant_fp32": {"train": train.fp32_pj / train.lowp_pj,
                                                "inference": infer.fp32_pj / infer.lowp_pj},
            "ratio_fp32_over_8bit_paper": {"train": train.fp32_pj / train.lowp_pj_paper,
                                           "inference": infer.fp32_pj / infer.lowp_pj_paper},
            "figures": asdict(self.figures),
        }


def energy_report(model: nn.Module, input_shape: tuple[int, int, int], batch: int = 32) -> EnergyReport:
    """Count and price `model` on inputs of shape (C, H, W) for `batch` samples per step."""
    if batch < 1:
        raise ValueError(f"batch: expected >= 1, got {batch}")
    layers = walk_model(model, input_shape)
    return EnergyReport(
        batch=batch,
        layers=layers,
        train=[phase_cost(layer, batch, training=True) for layer in layers],
        infer=[phase_cost(layer, batch, training=False) for layer in layers],
        figures=model_figures(model, layers, batch),
    )


def _geometry(layer: LayerShape) -> str:
    if layer.kind == "conv":
        return f"{layer.cin}->{layer.cout} k{layer.k} s{layer.s} p{layer.p} {layer.h}x{layer.w}->{layer.oh}x{layer.ow}"
    if layer.kind == "linear":
        return f"{layer.cin}->{layer.cout}"
    extra = f" {layer.norm_kind}" if layer.kind == "norm" else ""
    return f"{layer.cin}x{layer.h}x{layer.w}{extra}"


def _size(n_bytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n_bytes >= scale:
            return f"{n_bytes / scale:.2f} {unit}"
    return f"{n_bytes} B"


def format_report(report: EnergyReport, pricing: str = "quant-fp32") -> str:
    """Human-readable table: per layer the fp32 model's training ops, the 8-bit model's extra quantization ops and
    the energies (uJ) of a training step and an inference pass with the 8-bit model priced by ``pricing``; then
    totals, fp32/8-bit ratios under both pricings and model figures."""
    uj = 1e-6  # pJ -> uJ
    if pricing not in PRICINGS:
        raise ValueError(f"pricing must be one of {PRICINGS}, got {pricing!r}")

    def lowp(cost: PhaseCost) -> float:
        return cost.lowp_pj_priced(pricing)
    header = (f"{'layer':<24} {'kind':<6} {'geometry':<28} {'train adds':>13} {'train mults':>13} {'quant ops':>11} "
              f"{'train fp32':>11} {'train 8bit':>11} {'infer fp32':>11} {'infer 8bit':>11}")
    rule = "-" * len(header)
    title = (f"operations and energy (uJ) per training step (forward + backward) and per inference pass, "
             f"batch {report.batch}; quant ops = extra adds + mults of the 8-bit model; 8-bit priced: {pricing}")
    lines = [title, header, rule]
    for layer, train, infer in zip(report.layers, report.train, report.infer):
        quant = train.int8_ops + train.fp32_ops_8bit
        extra = quant.adds + quant.mults - train.fp32_ops.adds - train.fp32_ops.mults
        lines.append(f"{layer.name:<24.24} {layer.kind:<6} {_geometry(layer):<28.28} {train.fp32_ops.adds:>13,} "
                     f"{train.fp32_ops.mults:>13,} {extra:>11,} {train.fp32_pj * uj:>11.3f} "
                     f"{lowp(train) * uj:>11.3f} "
                     f"{infer.fp32_pj * uj:>11.3f} {lowp(infer) * uj:>11.3f}")
    lines.append(rule)
    train, infer = report.train_total, report.infer_total
    lines.append(f"{'total':<24} {'':<6} {'':<28} {train.fp32_ops.adds:>13,} {train.fp32_ops.mults:>13,} {'':>11} "
                 f"{train.fp32_pj * uj:>11.3f} {lowp(train) * uj:>11.3f} {infer.fp32_pj * uj:>11.3f} "
                 f"{lowp(infer) * uj:>11.3f}")
    figures = report.figures
    lines += [
        "",
        (f"energy ratio fp32 / 8-bit, quant-fp32 pricing (conv/linear/norm/skip in int8; pooling and quantization "
         f"arithmetic in fp32): training {train.fp32_pj / train.lowp_pj:.2f}x, "
         f"inference {infer.fp32_pj / infer.lowp_pj:.2f}x"),
        (f"energy ratio fp32 / 8-bit, paper pricing (every op of the 8-bit model at int8, section 5): "
         f"training {train.fp32_pj / train.lowp_pj_paper:.2f}x, inference {infer.fp32_pj / infer.lowp_pj_paper:.2f}x"),
        f"parameters: {figures.parameters:,} ({figures.quantized_parameters:,} in conv/linear weights)",
        (f"model size: fp32 {_size(figures.model_bytes_fp32)}, int8 {_size(figures.model_bytes_int8)} "
         f"({figures.model_bytes_fp32 / figures.model_bytes_int8:.2f}x)"),
        (f"training memory (weights + grads + momentum + {figures.saved_activations:,} saved activations): "
         f"fp32 {_size(figures.train_memory_bytes_fp32)}, 8-bit {_size(figures.train_memory_bytes_int8)} "
         f"({figures.train_memory_bytes_fp32 / figures.train_memory_bytes_int8:.2f}x)"),
    ]
    return "\n".join(lines)
