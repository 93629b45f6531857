"""Side-by-side fp32 / sim8 / int8 training benchmark (step time, peak memory, saved bytes).

Each (model, mode) trains the same model on the same synthetic batches in a FRESH
subprocess (clean peak RSS) with MALLOC_MMAP_THRESHOLD_=65536, so freed activation memory
goes back to the OS and peak RSS reflects what training really held (TESTBED.md).
"int8" is the real int8 path forced on (as if the probe had passed); the line above the
table says what resolve_precision would choose on this machine.

    python bench/lowp.py --steps 10 --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

MODELS = {  # name: (batch, channels, size)
    "resnet20": (32, 3, 32),
    "mnist-cnn": (64, 1, 28),
}
MODES = ("fp32", "sim8", "int8")


def _rss_kib() -> int:
    """Current resident set size in KiB (Linux /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def run_one(model_name: str, mode: str, steps: int, warmup: int, threads: int) -> dict:
    """Train ``model_name`` in ``mode`` for warmup + steps steps; return measurements."""
    import torch

    from peer.lowp import PrecisionConfig
    from peer.models import build_model

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    batch, channels, size = MODELS[model_name]
    model = build_model(model_name, in_channels=channels, precision=PrecisionConfig(mode))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True,
                          weight_decay=1e-4)
    x = torch.randn(batch, channels, size, size)
    y = torch.randint(0, 10, (batch,))
    saved: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel() * t.element_size())
        return t

    def step(measure_saved: bool) -> float:
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        if measure_saved:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = torch.nn.functional.cross_entropy(model(x), y)
        else:
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return time.perf_counter() - start

    rss_before = _rss_kib()
    step(measure_saved=True)
    for _ in range(warmup - 1):
        step(False)
    times = [step(False) for _ in range(steps)]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"model": model_name, "mode": mode, "step_ms": statistics.median(times) * 1e3,
            "peak_rss_mib": peak / 1024, "train_rss_mib": (peak - rss_before) / 1024,
            "saved_mib": sum(saved) / 2**20}


def _child(model_name: str, mode: str, args: argparse.Namespace) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    cmd = [sys.executable, __file__, "--child", model_name, mode, "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--threads", str(args.threads)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per mode")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (>= 1)")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.warmup = max(args.warmup, 1)
    if args.child:
        print(json.dumps(run_one(*args.child, args.steps, args.warmup, args.threads)))
        return

    import torch

    from peer.lowp import PrecisionConfig, resolve_precision

    resolved = resolve_precision(PrecisionConfig("int8"), torch.device("cpu"))
    print(f"torch {torch.__version__}, cpu capability {torch.backends.cpu.get_cpu_capability()}, "
          f"threads {args.threads}, steps {args.steps} (+{args.warmup} warm-up)")
    print(f"resolve_precision(int8) here -> {resolved.config_in_use.mode}: {resolved.reason}")
    header = (f"{'model':<10} {'mode':<5} {'step ms':>9} {'x fp32':>7} {'peak RSS MiB':>13} "
              f"{'x fp32':>7} {'train RSS MiB':>14} {'x fp32':>7} {'saved MiB':>10} {'x fp32':>7}")
    print(header)
    print("-" * len(header))
    for model_name in args.models:
        rows = [_child(model_name, mode, args) for mode in MODES]
        base = rows[0]
        for r in rows:
            print(f"{r['model']:<10} {r['mode']:<5} {r['step_ms']:>9.1f} "
                  f"{r['step_ms'] / base['step_ms']:>7.2f} {r['peak_rss_mib']:>13.1f} "
                  f"{r['peak_rss_mib'] / base['peak_rss_mib']:>7.2f} {r['train_rss_mib']:>14.1f} "
                  f"{r['train_rss_mib'] / base['train_rss_mib']:>7.2f} {r['saved_mib']:>10.2f} "
                  f"{r['saved_mib'] / base['saved_mib']:>7.2f}")


if __name__ == "__main__":
    main()
