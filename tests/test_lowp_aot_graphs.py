"""Pass graphs compiled ahead of time into the host's store (peer/lowp/aot_graphs.py): compiled once per host -
of several processes starting on an empty store one compiles each graph and the rest load it -, loaded without the
compiler, bit for bit the eager pass, and a damaged entry compiled again. Needs a C++ compiler (skipped, saying so,
without one)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from peer.lowp.aot_graphs import AotGraphs, graph_name
from peer.lowp.qmath import act_batch_codes, centered

pytestmark = [pytest.mark.slow,  # a compile takes 5-25 s (the first one on a host builds inductor's headers)
              pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                 reason="no C++ compiler: the passes run eagerly")]

ROOT = Path(__file__).resolve().parents[1]
CODES = (torch.arange(2 * 3 * 5 * 5, dtype=torch.int32).mul_(37).remainder_(256).to(torch.uint8).reshape(2, 3, 5, 5),
         torch.tensor(131.0))
#: A child process: opens the store under LPDL_CACHE_DIR, runs ``centered`` on CODES through it, and prints what it
#: compiled and loaded, whether the compiler's entry point was ever imported, and the result's digest.
CHILD = textwrap.dedent("""
    import json, sys, torch
    from peer.lowp.aot_graphs import AotGraphs
    from peer.lowp.qmath import centered
    codes = (torch.arange(150, dtype=torch.int32).mul_(37).remainder_(256).to(torch.uint8).reshape(2, 3, 5, 5),
             torch.tensor(131.0))
    store = AotGraphs.for_host()
    out = store.graph(centered, codes)(codes)
    print(json.dumps({"compiled": store.compiled, "loaded": store.loaded,
                      "compiler_imported": "torch._inductor.compile_fx" in sys.modules,
                      "equal": bool(torch.equal(out, centered(*codes)))}))
""")


def child(cache: Path) -> subprocess.Popen:
    env = {**os.environ, "LPDL_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", CHILD], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def report(process: subprocess.Popen) -> tuple[dict, str]:
    """A child's printed report, and its standard error (its log)."""
    out, err = process.communicate(timeout=600)
    assert process.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1]), err


def test_processes_sharing_a_store_compile_each_graph_once_and_load_it_without_the_compiler(tmp_path,
                                                                                             monkeypatch) -> None:
    """Three processes started together on an empty store: one compiles the graph, the others wait for it and load
    it; a fourth, later, loads it without importing the compiler. Every result equals the eager pass bit for bit, and
    a second call leaves the first call's outputs alone. A damaged library is compiled again (in a fresh process:
    one that loaded the library once gets its mapped copy back from the dynamic loader) and removed."""
    together = [child(tmp_path) for _ in range(3)]
    reports = [report(p)[0] for p in together]
    assert sum(r["compiled"] for r in reports) == 1, reports
    assert sum(r["loaded"] for r in reports) == 2, reports
    assert all(r["equal"] for r in reports), reports
    later, _ = report(child(tmp_path))
    assert later == {"compiled": 0, "loaded": 1, "compiler_imported": False, "equal": True}

    monkeypatch.setenv("LPDL_CACHE_DIR", str(tmp_path))
    store = AotGraphs.for_host()
    assert store is not None
    graph = store.graph(centered, CODES)
    first = graph(CODES)
    other = (CODES[0].flip(0).contiguous(), torch.tensor(7.0))
    second = graph(other)
    assert torch.equal(first, centered(*CODES)) and torch.equal(second, centered(*other))
    assert (store.compiled, store.loaded) == (0, 1)

    (library,) = (tmp_path / "aot-graphs").glob("*/lib/*.so")
    library.unlink()  # a new file: this process has the old one mapped, and writing into it would fault that code
    library.write_bytes(b"not a library")
    again, log = report(child(tmp_path))
    assert again["compiled"] == 1 and again["loaded"] == 0 and again["equal"]
    assert "unusable" in log
    assert len(list((tmp_path / "aot-graphs").glob("*/lib/*.so"))) == 1  # the damaged one removed


def test_graph_names_hold_across_processes() -> None:
    """A name holds what the graph bakes in (values, a formula's name, a window's size) and nothing of one
    process (an object's address)."""
    a = graph_name(centered, CODES)
    assert a == graph_name(centered, (CODES[0].clone(), CODES[1].clone()))
    assert a != graph_name(centered, (CODES[0].float(), CODES[1]))
    assert "peer.lowp.qmath.centered" in graph_name(act_batch_codes, (centered, (2, 2), [1, 2], None, 0.5))
    with pytest.raises(TypeError, match="object"):
        graph_name(centered, (object(),))
    one_channel = CODES[0][:, :1].contiguous()  # (2, 1, 5, 5), strides (25, 25, 5, 1)
    other_stride = one_channel.as_strided(one_channel.shape, (25, 1, 5, 1))  # the same memory
    assert graph_name(centered, (one_channel, CODES[1])) == graph_name(centered, (other_stride, CODES[1]))
    assert graph_name(centered, (CODES[0], CODES[1])) != graph_name(
        centered, (CODES[0].contiguous(memory_format=torch.channels_last), CODES[1]))


def test_a_graph_stored_for_one_layout_of_a_size_1_dimension_runs_the_other(tmp_path, monkeypatch) -> None:
    """Both strides of a one-channel tensor name one graph; compiled for one, it gives the other's eager result."""
    monkeypatch.setenv("LPDL_CACHE_DIR", str(tmp_path))
    one_channel = CODES[0][:, :1].contiguous()
    other_stride = one_channel.as_strided(one_channel.shape, (25, 1, 5, 1))
    store = AotGraphs.for_host()
    assert store is not None
    first = store.graph(centered, (other_stride, CODES[1]))
    second = store.graph(centered, (one_channel, CODES[1]))
    assert store.compiled == 1 and store.loaded == 1  # the second signature found the first one's graph
    for graph in (first, second):
        for x in (one_channel, other_stride):
            assert torch.equal(graph((x, CODES[1])), centered(x, CODES[1]))


def test_the_passes_take_their_graphs_from_the_store_when_asked(tmp_path, monkeypatch) -> None:
    """LPDL_LOWP_AOT=1: the start-up check and every pass graph come from the host's store (stubbed here: it
    records what it was asked for and hands back the eager pass); without it, from the just-in-time compiler."""
    from peer.lowp import passes as passes_module

    asked: list[str] = []

    def stored(self, fn, args):
        asked.append(fn.__name__)
        return lambda call_args: fn(*call_args)

    monkeypatch.setattr(AotGraphs, "graph", stored)
    monkeypatch.setenv("LPDL_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("LPDL_LOWP_EAGER", "0")
    monkeypatch.setenv("LPDL_LOWP_AOT", "1")
    engine = passes_module.FusedPasses()
    assert engine.compiled and "ahead of time" in engine.info.reason
    assert asked == ["act_batch_codes", "grad_codes_hashed", "centered"]  # the small-case check
    out = engine.run("centered", centered, *CODES)
    assert torch.equal(out, centered(*CODES)) and asked[-1] == "centered" and len(asked) == 4

    monkeypatch.delenv("LPDL_LOWP_AOT")
    monkeypatch.setattr(passes_module, "compile_graph", lambda fn, args: asked.append("jit") or stored(None, fn, args))
    monkeypatch.setattr(passes_module.FusedPasses, "_compiler_setup", staticmethod(lambda: "stub"))
    jit = passes_module.FusedPasses()
    assert jit.compiled and jit.aot is None and asked[4:].count("jit") == 3
