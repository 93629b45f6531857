"""The daemon's memory breakdown and allocator settings (peer/daemon/memory.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from peer.compress import CodecConfig
from peer.compress.layout import Layout
from peer.gossip.algorithms import make_algorithm

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status (Linux only)")


@linux_only
def test_stage_records_what_it_allocated() -> None:
    """In a fresh process: in the suite's long-lived one, pages that earlier tests' garbage and threads gave back
    between the marks read the 64 MiB block as 43-48 MiB (two fresh-clone CI runs)."""
    code = ("import json; from peer.daemon.memory import MemoryStages, peak_rss_mib, rss_mib\n"
            "stages = MemoryStages(); stages.mark('before')\n"
            "block = bytearray(b'\\x01') * (64 * 2**20)  # written: every page resident\n"
            "stages.mark('block'); snap = stages.snapshot()\n"
            "print(json.dumps({'snap': snap, 'rss': rss_mib(), 'peak': peak_rss_mib()}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    snap = got["snap"]
    assert snap["added"]["block"] >= 56  # MiB; allow for pages the interpreter freed meanwhile
    assert snap["peak_mib"] >= snap["after"]["block"] and got["rss"] <= got["peak"]


@linux_only
def test_stages_time_from_the_process_start() -> None:
    """The first stage counts from the process's start (the interpreter and imports before the first mark), each
    later one from the previous mark; a process that sleeps 0.3 s before its first mark and 0.2 s between two
    marks reads at least that."""
    code = ("import json, time; time.sleep(0.3)\n"
            "from peer.daemon.memory import MemoryStages\n"
            "stages = MemoryStages(); stages.mark('imports'); time.sleep(0.2); stages.mark('wait')\n"
            "print(json.dumps(stages.snapshot()['seconds']))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    seconds = json.loads(out.stdout.strip().splitlines()[-1])
    assert list(seconds) == ["imports", "wait"]
    assert seconds["imports"] >= 0.3 and seconds["wait"] >= 0.2


def test_choco_state_bytes_count_two_replicas_per_peer() -> None:
    layout = Layout.from_named_shapes([("w", (100,)), ("b", (28,))])
    choco = make_algorithm("choco", layout, CodecConfig(compression=0.9, bits=8), torch.device("cpu"))
    assert choco.state_nbytes() == 0
    choco.replica_out("a")
    choco.replica_in("a")
    choco.replica_in("b")
    assert choco.state_nbytes() == 3 * layout.numel * 4
    choco.forget("a")
    assert choco.state_nbytes() == layout.numel * 4


@linux_only
def test_arena_cap_takes_effect_in_a_fresh_process() -> None:
    code = ("from peer.daemon.memory import limit_malloc_arenas; from peer.heap import trim_heap; "
            "print(limit_malloc_arenas(2), isinstance(trim_heap(), bool))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    if out[0] == "False":
        pytest.skip("not glibc: no malloc arenas to cap")
    assert out == ["True", "True"]


@pytest.mark.parametrize("precision", ["sim8", "int8"])
def test_training_imports_nothing_heavy(precision: str) -> None:
    """A training step of the default model must not pull in sympy (torch imports it for autograd.grad with
    grad_outputs and for F.max_unpool2d's size check: ~490 modules, ~35 MiB in every daemon). The eager
    quantization passes are forced: torch.compile, where the compiled passes are chosen, imports its own compiler
    stack (its cost is in bench/RESULTS-lowp.md)."""
    code = f"""
import sys
import torch
from peer.config import RunSpec, ModelSpec
from peer.data import load_dataset
from peer.runtime.build import build_peer, build_peer_model
splits = load_dataset("synthetic", num_classes=10, n_train=64, n_test=16, image_size=28, in_channels=1)
spec = RunSpec(model=ModelSpec(precision="{precision}"))
built = build_peer_model(spec.model, splits, torch.device("cpu"))
peer = build_peer(spec, "p", (0, 1), splits, torch.device("cpu"), built)
peer.train_steps(2)
print(sorted(m for m in ("sympy", "torch._dynamo", "torchvision") if m in sys.modules))
"""
    env = {**os.environ, "LPDL_LOWP_EAGER": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout
    assert out.strip().splitlines()[-1] == "[]"


_EXIT_PEAK = """
import os, subprocess, sys
proc = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE, text=True)
out = proc.stdout.read()
_, status, usage = os.wait4(proc.pid, 0)
print(os.waitstatus_to_exitcode(status), usage.ru_maxrss)
print(out, end="")
"""


def _exit_peak_mib(code: str) -> tuple[int, float, str]:
    """Run ``python -c code``; its exit status, its peak RSS including its exit (the kernel's maxrss of the
    reaped child, MiB) and its stdout. A small interpreter launches it: a child forked from this test process
    would start its maxrss at this process's RSS."""
    out = subprocess.run([sys.executable, "-c", _EXIT_PEAK, code], capture_output=True, text=True,
                         check=True).stdout
    first, _, rest = out.partition("\n")
    status, maxrss_kib = first.split()
    return int(status), int(maxrss_kib) / 1024, rest


@linux_only
def test_hard_exit_runs_atexit_flushes_and_keeps_the_exit_code() -> None:
    code = ("import atexit, sys; from peer.daemon.exit import hard_exit; "
            "atexit.register(lambda: print('atexit ran')); print('buffered,', end=''); hard_exit(7)")
    status, _, out = _exit_peak_mib(code)
    assert status == 7 and out == "buffered,atexit ran\n"


@linux_only
def test_hard_exit_skips_the_cuda_libraries_exit_handlers() -> None:
    """The reason for hard_exit: with the CUDA wheel, torch's CUDA libraries' exit handlers page in ~110 MiB on a
    CPU-only machine (peer/daemon/exit.py). The same import ends both ways; the hard exit must not pay for it."""
    import torch.version

    if torch.version.cuda is None:
        pytest.skip("CPU-only torch wheel: no CUDA libraries whose exit handlers page in memory")
    _, normal, _ = _exit_peak_mib("import torch; x = torch.ones(4) * 2")
    _, hard, _ = _exit_peak_mib("import torch; x = torch.ones(4) * 2; from peer.daemon.exit import hard_exit; "
                                "hard_exit(0)")
    assert hard < normal - 50, (hard, normal)
