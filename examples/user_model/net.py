"""A user's own model, outside the package: lpdl-peer builds it with ``--model examples/user_model/net.py:SmallNet``
and converts its Conv2d / Linear / BatchNorm / ReLU / MaxPool layers for 8-bit training.

    lpdl-peer train --model examples/user_model/net.py:SmallNet --model-options width=16 --epochs 1
"""

from __future__ import annotations

from torch import Tensor, nn


class SmallNet(nn.Module):
    """Two conv blocks (conv - BatchNorm - ReLU - max pool) and a linear head, for 28x28 digits or 32x32 images."""

    def __init__(self, num_classes: int = 10, in_channels: int = 1, width: int = 16) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1, bias=False), nn.BatchNorm2d(2 * width), nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
        )
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Sequential(nn.Dropout(0.1), nn.Linear(2 * width, num_classes))

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.pool(self.features(x)).flatten(1))
