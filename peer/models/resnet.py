"""ResNets built from quantized layers (docs/method.md#models-and-hyper-parameters): CIFAR ResNet-20/54 and a small-input ResNet-18.

Every conv/linear is a Q layer (first and last included), every norm+activation comes from
``make_norm_act`` and the residual add is a QAdd (both inputs 8-bit in sim8/int8). The
second norm of each block starts with gamma = 0, so every block starts as the identity on
its shortcut. Downsampling shortcuts are a strided 1x1 Q conv (no norm).
"""

from __future__ import annotations

from torch import Tensor, nn

from peer.lowp import PrecisionConfig, QAdd, QConv2d, QLinear, make_norm_act


class BasicBlock(nn.Module):
    """conv3x3 - norm_act - conv3x3 - norm_act(gamma=0), plus shortcut."""

    def __init__(self, c_in: int, c_out: int, stride: int, norm: str,
                 precision: PrecisionConfig, groups: int) -> None:
        super().__init__()
        self.conv1 = QConv2d(c_in, c_out, 3, stride, 1, bias=False, precision=precision)
        self.norm1 = make_norm_act(norm, c_out, precision, groups)
        self.conv2 = QConv2d(c_out, c_out, 3, 1, 1, bias=False, precision=precision)
        self.norm2 = make_norm_act(norm, c_out, precision, groups)
        self.norm2.zero_gamma_()
        for norm_act in (self.norm1, self.norm2):  # outputs read only by conv2 and the 8-bit residual add
            norm_act.output_quantized = True
        self.shortcut = (nn.Identity() if stride == 1 and c_in == c_out else
                         QConv2d(c_in, c_out, 1, stride, bias=False, precision=precision))
        self.add = QAdd(precision)

    def forward(self, x: Tensor) -> Tensor:
        out = self.norm2(self.conv2(self.norm1(self.conv1(x))))
        return self.add(out, self.shortcut(x))


class ResNet(nn.Module):
    """Stem conv3x3 (stride 1) - stages of BasicBlocks - global average pool - Q linear.

    The stride-1 3x3 stem without max-pool (CIFAR style) keeps ResNet-18 usable on 32x32
    inputs; the global average pool makes any input size >= 8x8 work (64x64 Imagenette too).
    """

    def __init__(self, widths: tuple[int, ...], blocks_per_stage: int, *, num_classes: int,
                 in_channels: int, norm: str, precision: PrecisionConfig, groups: int) -> None:
        super().__init__()
        self.stem = QConv2d(in_channels, widths[0], 3, 1, 1, bias=False, precision=precision)
        self.stem_norm = make_norm_act(norm, widths[0], precision, groups)
        self.stem_norm.output_quantized = True  # read by the first block's convolutions and residual add
        blocks: list[nn.Module] = []
        c_in = widths[0]
        for stage, width in enumerate(widths):
            for i in range(blocks_per_stage):
                stride = 2 if stage > 0 and i == 0 else 1
                blocks.append(BasicBlock(c_in, width, stride, norm, precision, groups))
                c_in = width
        self.blocks = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = QLinear(c_in, num_classes, precision=precision)

    def forward(self, x: Tensor) -> Tensor:
        x = self.blocks(self.stem_norm(self.stem(x)))
        return self.fc(self.pool(x).flatten(1))


def cifar_resnet(depth: int, **kwargs) -> ResNet:
    """CIFAR ResNet: 16/32/64 channels, n = (depth - 2) // 6 basic blocks per stage.

    The paper's "ResNet-54" is not of the form 6n + 2; as the spec says, (54 - 2) / 6 is
    rounded down, giving n = 8 blocks per stage (50 conv/linear layers on the main path,
    plus the two downsampling 1x1 shortcut convs).
    """
    if depth < 8:
        raise ValueError(f"depth must be >= 8, got {depth}")
    return ResNet((16, 32, 64), (depth - 2) // 6, **kwargs)


def resnet18(**kwargs) -> ResNet:
    """ResNet-18 (64/128/256/512 channels, 2 basic blocks per stage) with a small-input stem."""
    return ResNet((64, 128, 256, 512), 2, **kwargs)
