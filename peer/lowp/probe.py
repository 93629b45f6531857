"""Capability probe for the int8 backend (DESIGN.md 8, TESTBED.md "int8 kernels").

``torch._int_mm`` returns WRONG results on x86 CPUs without VNNI when products span the
full int8 range (int16 saturation in the u8 x s8 pair-add instruction), and it can be far
slower than fp32 where it falls back to a reference loop. The probe therefore checks
(1) exactness against an int64 reference on operands spanning all of [-128, 127],
including the worst case (all -128 times all -128), and (2) speed against an fp32 matmul
of the same shape. The int8 mode is chosen only if both pass.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from peer.lowp.kernels import int8_mm

# Exactness operands: big enough to exercise the blocked kernels.
_M, _K, _N = 64, 256, 64
# Timing operands: an im2col product of a CIFAR ResNet stage (rows x C*3*3 x C_out); the
# fastest of a few runs is compared, which is robust to other load on shared cores.
# Costs ~0.1 s on the slow reference path, ~1 ms where int8 is fast.
_TIMING_SHAPE = (256, 576, 64)
_TIMING_REPS = 5


@dataclass(frozen=True)
class ProbeResult:
    """Outcome of the int8 probe: ``ok`` only if exact and not slower than fp32."""

    ok: bool
    exact: bool
    speedup: float | None  # fp32 matmul time / int8 matmul time; None if not measured
    reason: str


def _speedup(fp32_fn: Callable[[], Tensor], int8_fn: Callable[[], Tensor],
             device: torch.device) -> float:
    """fp32 time / int8 time: fastest of interleaved single-thread runs.

    One thread on CPU: per-core kernel speed is what is compared, and multi-thread barriers
    on cores shared with other work made the ratio swing by 50x between runs.
    """
    best = {fp32_fn: float("inf"), int8_fn: float("inf")}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _time_interleaved(best, device)
    finally:
        torch.set_num_threads(threads)
    return best[fp32_fn] / best[int8_fn]


def _time_interleaved(best: dict[Callable[[], Tensor], float], device: torch.device) -> None:
    for rep in range(_TIMING_REPS + 1):  # rep 0 warms up
        for fn in list(best):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if rep:
                best[fn] = min(best[fn], time.perf_counter() - start)


def probe_int8(
    device: torch.device,
    matmul: Callable[[Tensor, Tensor], Tensor] | None = None,
    min_speedup: float = 1.0,
) -> ProbeResult:
    """Check that int8 matmul on ``device`` is exact over the full int8 range and fast enough.

    ``matmul`` (int8 [M,K] x int8 [K,N] -> int32) defaults to the kernel the layers use;
    tests pass a saturating one to exercise the fallback. ``min_speedup`` is the lowest
    acceptable fp32-time / int8-time ratio.
    """
    device = torch.device(device)
    mm = matmul or int8_mm
    gen = torch.Generator().manual_seed(0)
    a = torch.randint(-128, 128, (_M, _K), dtype=torch.int8, generator=gen)
    b = torch.randint(-128, 128, (_K, _N), dtype=torch.int8, generator=gen)
    a[0].fill_(-128)  # worst case for 16-bit pair saturation: 2 * 128 * 128 > 32767
    b[:, 0].fill_(-128)
    a[1].fill_(127)
    b[:, 1].fill_(127)
    expected = a.long() @ b.long()
    try:
        da, db = a.to(device), b.to(device)
        got = mm(da, db)
    except (RuntimeError, NotImplementedError) as exc:
        return ProbeResult(False, False, None, f"int8 matmul unsupported: {exc}")
    exact = bool((got.cpu().long() == expected).all())
    if not exact:
        wrong = int((got.cpu().long() != expected).sum())
        return ProbeResult(False, False, None,
                           f"int8 matmul inexact ({wrong}/{expected.numel()} entries wrong; "
                           "int16 saturation, CPU without VNNI?)")
    m, k, n = _TIMING_SHAPE
    ta = torch.randint(-128, 128, (m, k), dtype=torch.int8, generator=gen).to(device)
    tb = torch.randint(-128, 128, (k, n), dtype=torch.int8, generator=gen).to(device)
    fa, fb = ta.float(), tb.float()
    speedup = _speedup(lambda: fa @ fb, lambda: mm(ta, tb), device)
    if speedup < min_speedup:
        return ProbeResult(False, True, speedup,
                           f"int8 matmul exact but {1 / speedup:.1f}x slower than fp32 "
                           f"(needs >= {min_speedup:.2f}x speedup)")
    return ProbeResult(True, True, speedup, f"int8 matmul exact, {speedup:.1f}x fp32 speed")
