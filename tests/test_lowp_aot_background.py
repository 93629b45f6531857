"""The ahead-of-time store filled in the background (``LPDL_LOWP_AOT=background``, peer/lowp/aot_queue.py and
aot_fill.py): a process that misses a graph runs the pass eagerly with the same bits, compiles nothing itself and
queues the graph; one filler process compiles the queue; a later process (and the first, once it looks again) loads
the graphs, checked bit-exact, without the compiler. The compiling test needs a C++ compiler (skipped, saying so,
without one)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from peer.lowp import aot_queue, compile_policy
from peer.lowp.aot_graphs import AotGraphs, aot_mode, graph_name, graph_ready
from peer.lowp.passes import FusedPasses
from peer.lowp.qmath import centered

ROOT = Path(__file__).resolve().parents[1]
NO_COMPILER = shutil.which("g++") is None and shutil.which("c++") is None
CODES = (torch.arange(2 * 3 * 5 * 5, dtype=torch.int32).mul_(37).remainder_(256).to(torch.uint8).reshape(2, 3, 5, 5),
         torch.tensor(131.0))
#: A process in background mode: runs two passes of the small-case check's signatures through FusedPasses and
#: prints what it queued, loaded and compiled, whether the compiler was imported and whether the bits are eager's.
CHILD = textwrap.dedent("""
    import json, sys, torch
    from peer.lowp.passes import FusedPasses
    from peer.lowp.qmath import act_batch_codes, centered
    passes = FusedPasses()
    x = torch.linspace(-3.0, 5.0, 96).reshape(2, 3, 4, 4)
    codes = (torch.arange(150, dtype=torch.int32).mul_(37).remainder_(256).to(torch.uint8).reshape(2, 3, 5, 5),
             torch.tensor(131.0))
    got = [passes.run("act_batch", act_batch_codes, x, -128, 127, True), passes.run("centered", centered, *codes)]
    want = [act_batch_codes(x, -128, 127, True), centered(*codes)]
    equal = all(torch.equal(a, b) for g, w in zip(got, want) for a, b in zip(torch.utils._pytree.tree_leaves(g),
                                                                         torch.utils._pytree.tree_leaves(w)))
    aot = passes.aot
    print(json.dumps({"kind": passes.info.kind, "reason": passes.info.reason, "requested": aot.requested,
                      "loaded": aot.loaded, "compiled": aot.compiled, "fillers_started": aot.filler.started,
                      "compiler_imported": "torch._inductor.compile_fx" in sys.modules, "equal": equal}))
""")


def run_child(cache: Path) -> dict:
    env = {**os.environ, "LPDL_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT), "LPDL_LOWP_AOT": "background"}
    env.pop("LPDL_LOWP_EAGER", None)
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def store_of(cache: Path) -> Path:
    (store,) = (cache / "aot-graphs").iterdir()
    return store


def wait_for_filler(store: Path, timeout_s: float = 420.0) -> None:
    """Until the queue is empty and no filler holds the lock."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        fd = aot_queue.try_filler_lock(store)
        if fd is not None:
            os.close(fd)
            if not aot_queue.pending(store):
                return
        time.sleep(0.5)
    log = (store / aot_queue.FILLER_LOG).read_text(errors="replace")[-3000:]
    raise AssertionError(f"the filler did not empty the queue in {timeout_s:.0f} s; its log:\n{log}")


def small_machine(monkeypatch: pytest.MonkeyPatch, cache: Path) -> None:
    """This process as a daemon (background mode, the store under ``cache``) on a machine with 1900 MiB of memory,
    where no process may compile beside the daemons (compile_policy.py)."""
    monkeypatch.setattr(compile_policy, "physical_memory_mib", lambda: 1900.0)
    monkeypatch.delenv("LPDL_LOWP_EAGER", raising=False)
    monkeypatch.setenv("LPDL_LOWP_AOT", "background")
    monkeypatch.setenv("LPDL_CACHE_DIR", str(cache))


def test_a_small_machine_in_background_mode_queues_nothing_and_starts_no_compile(tmp_path, monkeypatch) -> None:
    """Under 4 GiB a daemon neither compiles nor has a filler compile beside it: a graph the store lacks runs
    eagerly (the same bits) and is not asked for; the passes say that the store is not prepared, and why."""
    cache = tmp_path / "cache"
    small_machine(monkeypatch, cache)
    started = []
    monkeypatch.setattr(aot_queue.Filler, "ensure", lambda self: started.append(self))
    passes = FusedPasses()
    assert torch.equal(passes.run("centered", centered, *CODES), centered(*CODES))
    info = passes.info
    assert info.kind == "eager: the host's store is not prepared" and "1900 MiB of memory" in info.reason
    assert "lpdl-peer prepare" in info.reason
    assert passes.aot.load_only and passes.aot.requested == 0 and not started
    assert not aot_queue.pending(store_of(cache))


@pytest.mark.slow  # the filler compiles four graphs, 5-25 s each
@pytest.mark.skipif(NO_COMPILER, reason="no C++ compiler: the passes run eagerly")
def test_a_process_queues_what_it_misses_and_the_next_loads_it_without_the_compiler(tmp_path, monkeypatch) -> None:
    cache = tmp_path / "cache"
    first = run_child(cache)
    assert first["equal"] and not first["compiler_imported"]
    assert first["compiled"] == 0 and first["loaded"] == 0
    assert first["requested"] >= 2 and first["fillers_started"] == 1
    assert "runs eagerly until" in first["reason"] and first["kind"] == "eager while the host's store is filled"
    store = store_of(cache)
    wait_for_filler(store)
    assert not list((store / aot_queue.FAILED).glob("*.pt")), "a request failed to compile"

    second = run_child(cache)
    assert second["equal"] and not second["compiler_imported"]
    assert second["requested"] == 0 and second["compiled"] == 0 and second["loaded"] == 2
    assert "checked bit-exact" in second["reason"] and second["kind"] == "compiled ahead of time"

    # a machine too small to compile beside its daemons still loads what is stored (no compiler in the process)
    small_machine(monkeypatch, cache)
    passes = FusedPasses()
    got = passes.run("centered", centered, *CODES)
    assert torch.equal(got, centered(*CODES))
    assert passes.info.kind == "compiled ahead of time" and "1900 MiB of memory" in passes.info.reason
    assert passes.aot.loaded == 1 and passes.aot.requested == 0

    # a stand-in switches to the stored graph at its next look, once the passes' check allows it
    usable = [False]
    graph = AotGraphs(store, recheck_s=0.0).background_graph(centered, CODES, usable=lambda: usable[0])
    assert not graph_ready(graph)
    assert torch.equal(graph(CODES), centered(*CODES))  # eagerly meanwhile
    usable[0] = True
    assert graph_ready(graph)
    assert torch.equal(graph(CODES), centered(*CODES))


def test_a_request_that_cannot_compile_is_set_aside_with_its_reason(tmp_path) -> None:
    """A bad request (here: arguments the pass cannot take) is moved to failed/ beside its reason, and the same
    graph is never asked for again."""
    store = tmp_path / "store"
    bad_args = (CODES[0], "not a tensor")
    name = graph_name(centered, bad_args)
    assert aot_queue.write_request(store, name, centered, bad_args)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "peer.lowp.aot_fill", str(store)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not aot_queue.pending(store)
    failed = aot_queue.failed_path(store, name)
    assert failed.exists() and failed.with_suffix(".txt").read_text().strip()
    assert not aot_queue.write_request(store, name, centered, bad_args)
    assert not aot_queue.pending(store)


def test_a_filler_starts_only_while_none_holds_the_lock_and_at_most_once_per_period(tmp_path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    held = aot_queue.try_filler_lock(store)
    assert held is not None
    assert aot_queue.try_filler_lock(store) is None  # a second holder is refused
    filler = aot_queue.Filler(store, every_s=3600.0)
    filler.ensure()
    assert filler.started == 0  # a filler is at work
    os.close(held)
    filler.ensure()
    assert filler.started == 0  # asked within the period
    filler = aot_queue.Filler(store, every_s=3600.0)
    filler.ensure()
    assert filler.started == 1  # an empty queue: it exits at once


def test_an_unknown_mode_is_refused_by_name(monkeypatch) -> None:
    monkeypatch.setenv("LPDL_LOWP_AOT", "bakground")
    with pytest.raises(ValueError, match="LPDL_LOWP_AOT='bakground'"):
        aot_mode()
    monkeypatch.setenv("LPDL_LOWP_AOT", "background")
    assert aot_mode() == "background"
    monkeypatch.setenv("LPDL_LOWP_AOT", "0")
    assert aot_mode() is None


def test_the_filler_measures_the_idle_cores_it_waits_for(tmp_path, monkeypatch) -> None:
    """Idle cores over a sample: idle + iowait jiffies over all jiffies, times the core count (/proc/stat's
    aggregate line); the filler compiles only after a sample with a spare core."""
    from peer.lowp import aot_fill

    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 100 800 0 0 0 0 0 0\ncpu0 50 0 50 400 0 0 0 0 0 0\n")

    def busy_half(seconds: float) -> None:  # 200 jiffies pass, 100 of them idle (80) or waiting for I/O (20)
        stat.write_text("cpu  150 0 150 880 20 0 0 0 0 0\n")

    monkeypatch.setattr(aot_fill.time, "sleep", busy_half)
    monkeypatch.setattr(aot_fill.os, "cpu_count", lambda: 4)
    assert aot_fill.idle_cores(stat=stat) == pytest.approx(2.0)
    assert aot_fill.idle_cores(stat=tmp_path / "missing") == 4.0  # no /proc: never waits
