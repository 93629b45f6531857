"""torchvision's MobileNetV3-Small trained in int8 on an image folder (``ROOT/train/<class>/*``, ``ROOT/val/...``).

Without ``--root`` it writes one from the bundled MNIST digits first. The same flags start a daemon on a device
(``lpdl-peer start --neighbors auto ...``); here one device trains alone.

    python examples/mobilenet_imagefolder.py [--root DIR] [--epochs 1] [--out-dir runs/mobilenet]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from digit_folders import write_digit_folders


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=None, help="image folder (default: MNIST digits written now)")
    parser.add_argument("--epochs", type=float, default=1.0)
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--out-dir", type=Path, default=Path("runs/mobilenet"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = args.root or write_digit_folders(Path(tmp), devices=1, per_device=1000, val=300)[0]
        command = [sys.executable, "-m", "peer.cli.main", "train",
                   "--model", "torchvision:mobilenet_v3_small", "--norm", "keep", "--precision", "int8",
                   "--dataset", "imagefolder", "--data-root", str(root), "--image-size", "32",
                   "--epochs", str(args.epochs), "--lr", "0.05", "--out", str(args.out_dir)]
        if args.max_steps:
            command += ["--max-steps", str(args.max_steps)]
        subprocess.run(command, check=True)


if __name__ == "__main__":
    main()
