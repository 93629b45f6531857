"""VGG-11 (configuration A) from quantized layers; classifier 512-512-classes with dropout."""

from __future__ import annotations

from torch import Tensor, nn

from peer.lowp import MaskDropout, MaskMaxPool2d, MaskReLU, PrecisionConfig, QConv2d, QLinear, make_norm_act

# Configuration A: channels of the 3x3 convs, "M" = 2x2 max-pool (kept in fp32; 1-byte masks in int8, lowp.masks).
VGG11_CONFIG: tuple[int | str, ...] = (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M")


class VGG(nn.Module):
    """VGG features + adaptive pool to 1x1 + 512-512-classes classifier (ReLU, dropout 0.5)."""

    def __init__(self, config: tuple[int | str, ...] = VGG11_CONFIG, *, num_classes: int,
                 in_channels: int, norm: str, precision: PrecisionConfig, groups: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        c_in = in_channels
        for item in config:
            if isinstance(item, str):  # "M"
                layers.append(MaskMaxPool2d(2, precision))
            else:
                layers += [QConv2d(c_in, item, 3, padding=1, bias=False, precision=precision),
                           make_norm_act(norm, item, precision, groups)]
                c_in = item
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(
            MaskDropout(0.5, precision), QLinear(c_in, 512, precision=precision), MaskReLU(precision),
            MaskDropout(0.5, precision), QLinear(512, 512, precision=precision), MaskReLU(precision),
            QLinear(512, num_classes, precision=precision),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.pool(self.features(x)).flatten(1))
