"""Small CNN for 28x28x1 digits (>97% within one epoch on MNIST-size data)."""

from __future__ import annotations

from torch import Tensor, nn

from peer.lowp import MaskDropout, MaskMaxPool2d, MaskReLU, PrecisionConfig, QConv2d, QLinear, make_norm_act


class MnistCNN(nn.Module):
    """conv32 - norm_act - pool - conv64 - norm_act - pool - fc128 - ReLU - dropout - fc.

    Pooling, ReLU and dropout stay fp32 (docs/method.md#8-bit-local-training); in int8 mode they save 1-byte masks (peer.lowp.masks).
    """

    def __init__(self, *, num_classes: int, in_channels: int, norm: str,
                 precision: PrecisionConfig, groups: int) -> None:
        super().__init__()
        self.features = nn.Sequential(
            QConv2d(in_channels, 32, 3, padding=1, bias=False, precision=precision),
            make_norm_act(norm, 32, precision, groups), MaskMaxPool2d(2, precision),
            QConv2d(32, 64, 3, padding=1, bias=False, precision=precision),
            make_norm_act(norm, 64, precision, groups), MaskMaxPool2d(2, precision),
        )
        self.pool = nn.AdaptiveAvgPool2d(7)  # 28x28 -> 7x7 already; other sizes are pooled to it
        self.classifier = nn.Sequential(
            QLinear(64 * 7 * 7, 128, precision=precision), MaskReLU(precision), MaskDropout(0.25, precision),
            QLinear(128, num_classes, precision=precision),
        )

    def forward(self, x: Tensor) -> Tensor:
        x = self.features(x)
        if x.shape[-2:] != (7, 7):  # 28x28 inputs skip the (identity) pool: nothing saved for its backward
            x = self.pool(x)
        return self.classifier(x.flatten(1))
