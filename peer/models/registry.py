"""Model registry: build any supported architecture by name with one set of options."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from peer.lowp import NORM_KINDS, PrecisionConfig
from peer.models.mnist_cnn import MnistCNN
from peer.models.resnet import cifar_resnet, resnet18
from peer.models.vgg import VGG

_BUILDERS: dict[str, Callable[..., nn.Module]] = {
    "resnet20": lambda **kw: cifar_resnet(20, **kw),
    "resnet54": lambda **kw: cifar_resnet(54, **kw),
    "vgg11": lambda **kw: VGG(**kw),
    "resnet18": lambda **kw: resnet18(**kw),
    "mnist-cnn": lambda **kw: MnistCNN(**kw),
}


def available_models() -> list[str]:
    """Names accepted by build_model."""
    return list(_BUILDERS)


def build_model(name: str, *, num_classes: int = 10, in_channels: int = 3,
                norm: str = "range-evonorm", precision: PrecisionConfig = PrecisionConfig(),
                groups: int = 8) -> nn.Module:
    """Build model ``name``; ``precision`` should already be resolved (resolve_precision). A resolved int8 precision
    carries a step check: the model's second training step is then timed against an fp32 model of the same
    architecture (peer.lowp.steptime), for the log and the status."""
    if name not in _BUILDERS:
        raise ValueError(f"model must be one of {available_models()}, got {name!r}")
    if norm not in NORM_KINDS:
        raise ValueError(f"norm must be one of {NORM_KINDS}, got {norm!r}")
    for field, value in (("num_classes", num_classes), ("in_channels", in_channels),
                         ("groups", groups)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{field} must be a positive integer, got {value!r}")
    model = _BUILDERS[name](num_classes=num_classes, in_channels=in_channels, norm=norm,
                            precision=precision, groups=groups)
    if precision.step_check is not None:
        precision.step_check.attach(model, lambda: build_model(
            name, num_classes=num_classes, in_channels=in_channels, norm=norm,
            precision=PrecisionConfig("fp32", precision.bits), groups=groups))
    return model
