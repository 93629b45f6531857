"""Evaluation-time max pooling, side by side: torch's NCHW pooling against the pooling the models' MaskMaxPool2d
runs without a gradient on CPU (peer/lowp/masks.py), and what it gives a whole test evaluation.

Contenders, interleaved in one process (the machine is shared: only the ratios mean anything):
  torch         F.max_pool2d on the NCHW tensor (what nn.MaxPool2d runs)
  ours          the models' MaskMaxPool2d without a gradient: for these non-overlapping 2x2 windows each window's
                rows first (whole rows, contiguous), then their columns (strided), NCHW throughout

Rows: each pooling shape of the MNIST CNN (batch 32, the daemon's evaluation batch) and of VGG-11 on 32x32 images,
then the README fleet daemon's whole test evaluation (mnist5k's 1,000 test images, MNIST CNN, fp32 and int8, after
a few training steps) with its pooling layers swapped to plain nn.MaxPool2d against the model as built.

    python bench/pool.py [--repeats 30] [--threads 1]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from peer.config import RunSpec
from peer.lowp.compiler_env import cpu_flags, cpuinfo_field
from peer.lowp.masks import MaskMaxPool2d
from peer.runtime.build import build_peer_model, eval_loader, load_splits
from peer.runtime.evaluation import evaluate

#: Pooling inputs [N, C, H, W]: the MNIST CNN's two (batch 32), VGG-11's first two at 32x32 (batch 32).
SHAPES = [(32, 32, 28, 28), (32, 64, 14, 14), (32, 64, 32, 32), (32, 128, 16, 16)]


def side_by_side(contenders: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds of each contender, their calls interleaved round-robin ``repeats`` times (after one warm-up)."""
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for fn in contenders.values():
        fn()
    for _ in range(repeats):
        for name, fn in contenders.items():
            started = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - started)
    return {name: statistics.median(t) for name, t in times.items()}


def with_torch_pooling(model: nn.Module) -> nn.Module:
    """``model`` with each MaskMaxPool2d replaced by the plain nn.MaxPool2d of the same geometry (in place)."""
    for name, child in list(model.named_children()):
        if isinstance(child, MaskMaxPool2d):
            setattr(model, name, nn.MaxPool2d(child.kernel_size, child.stride, child.padding))
        else:
            with_torch_pooling(child)
    return model


def trained_a_little(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], steps: int = 3) -> None:
    """A few SGD steps, as a daemon's model has taken before it evaluates: the freshly initialised MNIST CNN
    evaluates about 2x slower (0.54 s against 0.25 s, fp32; its elementwise ops about 8x slower per call), a model
    no daemon ever evaluates."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model.train()
    for x, y in batches[:steps]:
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()


def pooling_rows(repeats: int) -> list[str]:
    rows = []
    ours = MaskMaxPool2d(2).eval()
    for shape in SHAPES:
        x = torch.randn(*shape)
        with torch.no_grad():
            assert torch.equal(F.max_pool2d(x, 2), ours(x))
            t = side_by_side({"torch": lambda: F.max_pool2d(x, 2), "ours": lambda: ours(x)}, repeats)
        rows.append(f"| pool {'x'.join(map(str, shape))} | {t['torch'] * 1e3:.2f} | {t['ours'] * 1e3:.2f} | "
                    f"{t['ours'] / t['torch']:.2f}x |")
    return rows


def evaluation_rows(repeats: int) -> list[str]:
    rows = []
    base = RunSpec()
    splits = load_splits(base.data)
    batches = list(eval_loader(splits, torch.device("cpu"), base.data.batch_size))
    for precision in ("fp32", "int8"):
        spec = dataclasses.replace(base.model, precision=precision)
        ours = build_peer_model(spec, splits, torch.device("cpu")).model
        trained_a_little(ours, batches)
        theirs = with_torch_pooling(build_peer_model(spec, splits, torch.device("cpu")).model)
        theirs.load_state_dict(ours.state_dict())
        assert evaluate(ours, batches) == evaluate(theirs, batches)
        t = side_by_side({"torch": lambda: evaluate(theirs, batches), "ours": lambda: evaluate(ours, batches)},
                         max(3, repeats // 5))
        rows.append(f"| test evaluation, MNIST CNN {precision} | {t['torch'] * 1e3:.0f} | {t['ours'] * 1e3:.0f} | "
                    f"{t['ours'] / t['torch']:.2f}x |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    vector = sorted(set(cpu_flags().split()) & {"avx2", "avx512f", "avx512_vnni", "amx_int8", "asimd", "sve"})
    print(f"CPU: {cpuinfo_field(('model name', 'CPU part')) or 'unknown'} ({', '.join(vector) or 'no vector flags'});"
          f" torch {torch.__version__}; {args.threads} thread(s)")
    print("| case | torch ms | ours ms | ours / torch |\n|---|---|---|---|")
    for row in pooling_rows(args.repeats) + evaluation_rows(args.repeats):
        print(row)


if __name__ == "__main__":
    main()
