"""The Python API: simulate a fleet of 8 peers training your own model on your own tensors, in int8, with Choco at
99% compression over a ring - the runtime the daemon runs, in one process.

    python examples/python_api.py [--epochs 2] [--peers 8]
"""

from __future__ import annotations

import argparse

from torch import nn

from peer.api import simulate
from peer.data import load_dataset


def make_net(num_classes: int, in_channels: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(in_channels, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 7 * 7, num_classes))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=float, default=2.0)
    parser.add_argument("--peers", type=int, default=8)
    args = parser.parse_args()
    digits = load_dataset("mnist5k")  # any (images, labels) tensors or torch Datasets work here
    rows = simulate(make_net, (digits.train.images, digits.train.labels), (digits.test.images, digits.test.labels),
                    peers=args.peers, algorithm="choco", compression=0.99, precision="int8", epochs=args.epochs,
                    mean=[0.1307], std=[0.3081], skew=0.5)
    for row in rows:
        print(f"epoch {row['epoch']:.1f}  averaged model {row['avg_model_acc']:.1%}  "
              f"mean device model {row['mean_peer_acc']:.1%}  {row['bytes_per_peer'] / 1e6:.2f} MB/peer")


if __name__ == "__main__":
    main()
