"""Side-by-side training benchmark of the precision modes: step time, memory, saved-for-backward bytes.

Contenders, per model (ResNet-20 batch 32 at 32x32, MNIST CNN batch 64 at 28x28):
  fp32          the baseline
  bf16          fp32 model under bf16 autocast (only where the CPU or GPU has bf16 kernels)
  sim8          the 8-bit reference numerics, simulated in fp32
  int8          what ``--precision int8`` runs here: each product on the kernel the probe chose, quantization passes
                compiled where this machine compiles them (eager under LPDL_LOWP_EAGER=1 or without a compiler)
  int8-eager    the same with the quantization passes forced eager (what a small board, or the README fleet's
                LPDL_LOWP_EAGER=1 daemons, run), in the same process, beside the compiled ones
  int8:<kernel> the same with one exact kernel path preferred wherever the probe admitted it (one per kernel found
                exact here), to show what each path gives

Timing: all contenders of a model live in ONE process and their steps are interleaved (fp32, bf16, ..., fp32, ...),
so every contender sees the same background load on a shared machine; each reports its median step and its ratio to
fp32's median. Memory: each contender also trains a few steps in a fresh subprocess (MALLOC_MMAP_THRESHOLD_=65536, so
freed activation memory goes back to the OS) that reports its whole-process peak RSS and its training
RSS: the peak during the measured steps minus the RSS just before them (the kernel's peak counter is reset there
through /proc/self/clear_refs), i.e. what one step holds on top of the model, optimizer and libraries. Saved bytes:
what autograd's saved-tensor hooks see in one step. On CUDA the memory figures are torch.cuda peak allocations.

    python bench/lowp.py --steps 10 --threads 1 [--models resnet20] [--modes fp32 int8 int8-eager] [--batch 32]
                         [--device cuda]

The last line names the mode the product would run here for ``--precision int8`` and its step-time ratio to fp32.

    python bench/lowp.py --rounding --threads 1

times only the eager stochastic rounding of ResNet-20's layer gradients (batch 32, channels_last), interleaved in one
process: the counter-based generator the passes use (counter_rng.py) against mt19937 ``torch.rand`` filling the same
blocks (the eager path before it); same block structure, same arithmetic otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
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
#: A user's model (torchvision:NAME, MODULE:CALLABLE, file.py:CALLABLE), optionally ``@SIZE`` pixels: 3 channels,
#: 32x32 and batch 32 unless given (``torchvision:resnet18@224`` with ``--batch 8``), converted by peer.lowp.convert.
PLUGIN_DEFAULTS = (32, 3, 32)
NORM = {"norm": "range-evonorm"}  # set from --norm: what a converted model's BatchNorms become


def model_shape(name: str) -> tuple[int, int, int]:
    """(batch, channels, size) of a registry model or a plug-in ``REF[@SIZE]``."""
    if name in MODELS:
        return MODELS[name]
    ref, _, size = name.partition("@")
    batch, channels, default_size = PLUGIN_DEFAULTS
    return batch, channels, int(size) if size else default_size


def build_contender_model(name: str, precision, channels: int):
    """A registry model, or a plug-in model built plain and converted (returns the model and the Conversion or
    None)."""
    from peer.models import build_model

    if name in MODELS:
        return build_model(name, in_channels=channels, precision=precision), None
    from peer.lowp.convert import convert
    from peer.models.source import ModelSource

    conversion = convert(ModelSource.parse(name.partition("@")[0]).build_plain(10, channels), precision,
                         norm=NORM["norm"])
    return conversion.model, conversion
BASE_MODES = ("fp32", "bf16", "sim8", "int8", "int8-eager")
EAGER_MODE = "int8-eager"
_MEMORY_STEPS = 2


def _rss_kib(field: str = "VmRSS") -> int:
    """A /proc/self/status memory field (VmRSS: current resident set, VmHWM: its peak since the last reset), KiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} missing from /proc/self/status")


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS counter (Linux >= 4.0); False where that is not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class Contender:
    """One mode's model, optimizer and step function on one device."""

    def __init__(self, model_name: str, mode: str, device, plans: dict, passes: dict) -> None:
        import torch

        from peer.lowp import PrecisionConfig

        batch, channels, size = model_shape(model_name)
        self.device, self.mode = device, mode
        precision = PrecisionConfig("fp32")
        if mode.startswith("int8"):
            precision = PrecisionConfig("int8", plan=plans[mode], passes=passes[mode])
        elif mode == "sim8":
            precision = PrecisionConfig("sim8")
        torch.manual_seed(0)
        model, self.conversion = build_contender_model(model_name, precision, channels)
        self.model = model.to(device)
        if self.conversion is not None:
            self.conversion.count_macs((batch, channels, size, size))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4)
        gen = torch.Generator().manual_seed(1)
        self.x = torch.randn(batch, channels, size, size, generator=gen).to(device)
        self.y = torch.randint(0, 10, (batch,), generator=gen).to(device)
        self.autocast = mode == "bf16"

    def _loss(self):
        import torch

        if self.autocast:
            with torch.autocast(self.device.type, dtype=torch.bfloat16):
                return torch.nn.functional.cross_entropy(self.model(self.x), self.y)
        return torch.nn.functional.cross_entropy(self.model(self.x), self.y)

    def step(self) -> float:
        """One training step; seconds."""
        import torch

        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        sync()
        start = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        self._loss().backward()
        self.opt.step()
        sync()
        return time.perf_counter() - start

    def saved_bytes(self) -> int:
        """Bytes autograd saves for backward in one training step."""
        import torch

        sizes: list[int] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            sizes.append(t.numel() * t.element_size())
            return t

        self.opt.zero_grad(set_to_none=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = self._loss()
        loss.backward()
        return sum(sizes)


def make_plans(modes: list[str], device) -> dict:
    """The KernelPlan of each int8 contender: the product's own (probe's choice) and one per preferred kernel."""
    from peer.lowp.plan import KernelPlan, default_plan

    return {mode: default_plan(device) if mode in ("int8", EAGER_MODE)
            else KernelPlan(device, prefer=mode.split(":", 1)[1]) for mode in modes if mode.startswith("int8")}


def make_passes(modes: list[str], compiled=None) -> dict:
    """The quantization passes of each int8 contender: eager ones for int8-eager, else one set shared by the others
    (``compiled``: the process's, decided once: compiled where this machine compiles)."""
    from peer.lowp.passes import FusedPasses

    compiled = compiled or FusedPasses()
    return {mode: FusedPasses(try_compile=False) if mode == EAGER_MODE else compiled
            for mode in modes if mode.startswith("int8")}


def time_side_by_side(model_name: str, modes: list[str], args: argparse.Namespace, device) -> dict[str, dict]:
    """Median step time and saved bytes of every mode, steps interleaved in one process."""
    plans, passes = make_plans(modes, device), make_passes(modes, args.passes)
    contenders = {mode: Contender(model_name, mode, device, plans, passes) for mode in modes}
    for _ in range(args.warmup):
        for c in contenders.values():
            c.step()
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    for _ in range(args.steps):
        for mode, c in contenders.items():
            times[mode].append(c.step())
    out: dict = {}
    converted = next((c.conversion for c in contenders.values() if c.conversion is not None and c.mode != "fp32"),
                     None)
    if converted is not None:
        out["conversion"] = converted.summary()
    for mode, c in contenders.items():
        out[mode] = {"step_ms": statistics.median(times[mode]) * 1e3, "saved_mib": c.saved_bytes() / 2**20}
        if mode.startswith("int8"):
            out[mode]["kernels"] = {op: d["kernel"] for op, d in plans[mode].describe()["ops"].items()}
    return out


def measure_memory(model_name: str, mode: str, args: argparse.Namespace) -> dict:
    """Child process body: peak and training memory of ``mode`` (MiB)."""
    import torch

    device = torch.device(args.device)
    c = Contender(model_name, mode, device, make_plans([mode], device), make_passes([mode]))
    for _ in range(args.warmup):
        c.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        for _ in range(_MEMORY_STEPS):
            c.step()
        peak = torch.cuda.max_memory_allocated()
        return {"peak_mib": peak / 2**20, "train_mib": (peak - before) / 2**20}
    before = _rss_kib()
    if not _reset_peak_rss():
        return {"peak_mib": float("nan"), "train_mib": float("nan")}
    for _ in range(_MEMORY_STEPS):
        c.step()
    return {"peak_mib": _rss_kib("VmHWM") / 1024, "train_mib": (_rss_kib("VmHWM") - before) / 1024}


def _child(model_name: str, mode: str, args: argparse.Namespace) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    if mode == EAGER_MODE:
        env["LPDL_LOWP_EAGER"] = "1"  # as a small board: the compiler's machinery is not even imported
    cmd = [sys.executable, __file__, "--child", model_name, mode, "--warmup", str(args.warmup),
           "--threads", str(args.threads), "--device", args.device]
    cmd += ["--batch", str(args.batch)] if args.batch else []
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def available_modes(requested: list[str] | None, device, plan) -> tuple[list[str], list[str]]:
    """The contenders to run here (requested or all) and notes on the ones left out."""
    import torch

    notes = []
    admitted = sorted({name for c in plan.choices() for name in c.timings_ms if name in
                       {k.name for k in plan.kernels}})
    everything = list(BASE_MODES) + [f"int8:{name}" for name in admitted]
    bf16 = (torch.cuda.is_bf16_supported() if device.type == "cuda"
            else torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if not bf16:
        notes.append("bf16 left out: no bf16 kernels on this device")
        everything.remove("bf16")
    modes = everything if requested is None else [m for m in requested if m in everything or m.startswith("int8")]
    for m in requested or []:
        if m not in everything:
            notes.append(f"{m} left out: not available here (available: {', '.join(everything)})")
    return ["fp32"] + [m for m in modes if m != "fp32" and m in everything], notes


#: ResNet-20's layer-gradient shapes at batch 32 (one per stage).
ROUNDING_SHAPES = ((32, 16, 32, 32), (32, 32, 16, 16), (32, 64, 8, 8))


def _mt19937_rounding(g, qmax: int):
    """The contender: stochastic-rounding codes of ``g`` with ``torch.rand`` (mt19937) filling each block, the rest
    as qmath.grad_codes_hashed_eager (the eager path before the counter-based generator)."""
    import torch

    from peer.lowp import qmath

    scale = (qmath._abs_max(g) / qmax).clamp_min(qmath.TINY_SCALE)
    order = qmath.memory_order(g)
    g = g.permute(order).contiguous()
    out = torch.empty(g.shape, dtype=torch.uint8)
    buf = torch.empty(min(g.numel(), qmath.SR_CHUNK))
    for index in qmath._blocks(tuple(g.shape), qmath.SR_CHUNK):
        part = g[index]
        y = torch.rand(part.numel(), out=buf[:part.numel()]).view(part.shape)
        out[index].copy_(y.addcdiv_(part, scale).floor_().clamp_(-qmax, qmax).add_(qmath.CODE_OFFSET))
    return out.permute(qmath.inverse_order(order)), scale


def time_rounding(args: argparse.Namespace) -> None:
    """Median ms of the two eager stochastic roundings per shape, calls interleaved, and their ratio."""
    import torch

    from peer.lowp import qmath
    from peer.lowp.counter_rng import sr_seed

    print(f"eager stochastic rounding, {args.threads} thread(s), {args.steps} interleaved calls per contender")
    for shape in ROUNDING_SHAPES:
        g = torch.randn(shape).contiguous(memory_format=torch.channels_last)
        thunks = {"mt19937": lambda: _mt19937_rounding(g, 127),
                  "counter": lambda: qmath.grad_codes_hashed_eager(g, sr_seed(g.device), 127, True)}
        times: dict[str, list[float]] = {name: [] for name in thunks}
        for _ in range(args.warmup + args.steps):
            for name, thunk in thunks.items():
                start = time.perf_counter()
                thunk()
                times[name].append(time.perf_counter() - start)
        mt, counter = (statistics.median(times[n][args.warmup:]) * 1e3 for n in ("mt19937", "counter"))
        print(f"{'x'.join(map(str, shape)):<14} mt19937 {mt:7.2f} ms  counter {counter:7.2f} ms  "
              f"counter/mt19937 {counter / mt:.2f}x")


def _row(model: str, mode: str, r: dict, base: dict) -> str:
    def ratio(key: str) -> str:
        return f"{r[key] / base[key]:>7.2f}" if base.get(key) else f"{'-':>7}"

    return (f"{model:<10} {mode:<13} {r['step_ms']:>9.1f} {ratio('step_ms')} {r['peak_mib']:>9.1f} {ratio('peak_mib')} "
            f"{r['train_mib']:>9.1f} {ratio('train_mib')} {r['saved_mib']:>9.2f} {ratio('saved_mib')}  "
            f"{' '.join(f'{op}={k}' for op, k in r.get('kernels', {}).items())}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per mode (interleaved)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first per mode (>= 1; compiles)")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--models", nargs="+", default=list(MODELS),
                        help=f"registry models ({', '.join(MODELS)}) or your own: torchvision:NAME[@SIZE], "
                             "MODULE:CALLABLE[@SIZE], file.py:CALLABLE[@SIZE]")
    parser.add_argument("--norm", default=NORM["norm"], help="what a converted model's BatchNorms become "
                        "(range-evonorm, evonorm, batchnorm, keep)")
    parser.add_argument("--modes", nargs="+", default=None,
                        help=f"subset of {', '.join(BASE_MODES)}, int8:<kernel> (default: all available here)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--batch", type=int, default=None, help="batch size of every model (default: per model)")
    parser.add_argument("--no-memory", action="store_true", help="skip the per-mode memory subprocesses")
    parser.add_argument("--rounding", action="store_true", help="time only the eager stochastic rounding")
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.warmup = max(args.warmup, 1)
    NORM["norm"] = args.norm
    if args.batch:
        for name, (_, channels, size) in MODELS.items():
            MODELS[name] = (args.batch, channels, size)
        globals()["PLUGIN_DEFAULTS"] = (args.batch, *PLUGIN_DEFAULTS[1:])

    import torch

    torch.set_num_threads(args.threads)
    if args.child:
        print(json.dumps(measure_memory(*args.child, args)))
        return
    if args.rounding:
        time_rounding(args)
        return

    from peer.lowp import PrecisionConfig, resolve_precision
    from peer.lowp.plan import default_plan

    device = torch.device(args.device)
    resolved = resolve_precision(PrecisionConfig("int8"), device)
    args.passes = passes = resolved.config_in_use.passes  # what the product runs here, shared by the int8 contenders
    modes, notes = available_modes(args.modes, device, default_plan(device))
    flags = " ".join(sorted(set(_cpu_flags()) & {"avx2", "avx512_vnni", "avx512_bf16", "amx_int8", "amx_bf16"}))
    print(f"torch {torch.__version__}, device {device}, cpu capability {torch.backends.cpu.get_cpu_capability()} "
          f"(flags: {flags or 'none of avx2/vnni/amx'}), threads {args.threads}, {args.steps} interleaved steps "
          f"(+{args.warmup} warm-up) per mode")
    print(f"resolve_precision(int8) here -> {resolved.config_in_use.mode} [{resolved.backend}]: {resolved.reason}")
    print(f"batch sizes: {', '.join(f'{name} {model_shape(name)[0]}' for name in args.models)}; int8 passes here: "
          f"{passes.info.path} ({passes.info.reason}); {EAGER_MODE}: eager passes in this process")
    for note in notes:
        print(note)
    header = (f"{'model':<10} {'mode':<13} {'step ms':>9} {'x fp32':>7} {'peak MiB':>9} {'x fp32':>7} "
              f"{'train MiB':>9} {'x fp32':>7} {'saved MiB':>9} {'x fp32':>7}  kernels (int8 modes)")
    print(header)
    print("-" * len(header))
    chosen: list[str] = []
    for model_name in args.models:
        rows = time_side_by_side(model_name, modes, args, device)
        if rows.get("conversion"):
            print(f"{model_name}: {rows.pop('conversion')}")
        for mode in modes:
            memory = ({"peak_mib": float("nan"), "train_mib": float("nan")} if args.no_memory
                      else _child(model_name, mode, args))
            rows[mode].update(memory)
            print(_row(model_name, mode, rows[mode], rows["fp32"]), flush=True)
        product = resolved.config_in_use.mode if resolved.config_in_use.mode in rows else None
        if product:
            chosen.append(f"{model_name} {rows[product]['step_ms'] / rows['fp32']['step_ms']:.2f}x fp32")
    print(f"product's choice here for --precision int8: {resolved.config_in_use.mode} [{resolved.backend}], "
          f"step time {', '.join(chosen) or 'not measured (mode not in --modes)'}")


def _cpu_flags() -> list[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return []


if __name__ == "__main__":
    main()
