"""The compiled passes' inductor environment: a cache per CPU and vector ISA, direct byte loads in AVX2 kernels, and
the 32-bit stochastic-rounding hash (the same bits as unsigned 32-bit arithmetic, eager and compiled)."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from peer.lowp import compiler_env, counter_rng, torch_patches
from peer.lowp.passes import FusedPasses

REPO = Path(__file__).resolve().parents[1]
_M32 = 0xFFFFFFFF


def test_cache_directory_is_per_isa_and_cpu_flags_and_safe_in_command_lines():
    a = compiler_env.per_cpu_cache_dir("avx512 avx512_vnni", "fpu avx2 avx512f")
    assert " " not in a
    assert a != compiler_env.per_cpu_cache_dir("avx2", "fpu avx2 avx512f")  # another ISA
    assert a != compiler_env.per_cpu_cache_dir("avx512 avx512_vnni", "fpu avx2 avx512f avx512_bf16")  # another CPU
    assert a == compiler_env.per_cpu_cache_dir("avx512 avx512_vnni", "fpu avx2 avx512f")


def test_a_cache_directory_set_by_the_user_is_kept(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    isa, directory = compiler_env.use_per_cpu_cache()
    assert directory == str(tmp_path) == os.environ["TORCHINDUCTOR_CACHE_DIR"]


def test_inductors_own_default_is_replaced_by_the_per_cpu_directory(monkeypatch):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", os.path.abspath(default_cache_dir()))  # what importing it sets
    isa, directory = compiler_env.use_per_cpu_cache()
    assert directory == compiler_env.per_cpu_cache_dir(isa, compiler_env.cpu_flags())
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == directory


def test_an_inherited_per_cpu_directory_is_recomputed_for_this_process(monkeypatch):
    """A child process inherits its parent's per-CPU directory; it may run another ISA (ATEN_CPU_CAPABILITY)."""
    other = compiler_env.per_cpu_cache_dir("some_other_isa", "flags of another machine")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", other)
    isa, directory = compiler_env.use_per_cpu_cache()
    assert directory == compiler_env.per_cpu_cache_dir(isa, compiler_env.cpu_flags()) != other


def test_torch_patches_name_their_torch_versions_and_switch_off(monkeypatch):
    """The code generator patch applies only on a verified torch and never with LPDL_TORCH_PATCHES=0, and the cache
    directory tells patched from unpatched code apart."""
    version = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    monkeypatch.delenv(torch_patches.ENV_SWITCH, raising=False)
    assert torch_patches.enabled() == (version in torch_patches.VERIFIED_TORCH)
    patched_dir = compiler_env.per_cpu_cache_dir("avx2", "fpu avx2")
    monkeypatch.setenv(torch_patches.ENV_SWITCH, "0")
    assert not torch_patches.enabled() and torch_patches.codegen_tag() == "unpatched"
    assert not torch_patches.use_fast_byte_loads()
    assert (compiler_env.per_cpu_cache_dir("avx2", "fpu avx2") != patched_dir) == (version in torch_patches.VERIFIED_TORCH)
    monkeypatch.delenv(torch_patches.ENV_SWITCH)
    monkeypatch.setattr(torch, "__version__", "2.99.0+cpu")  # a torch the patch was never checked on
    assert not torch_patches.enabled() and not torch_patches.use_fast_byte_loads()


def _hash_reference(counter: int, lo: int, hi: int) -> int:
    h = ((counter + lo) * 0x21F0AAAD) & _M32
    h ^= h >> 16
    h = ((h ^ hi) * 0x735A2D97) & _M32
    return h ^ (h >> 15)


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last])
def test_hash_uniform_equals_unsigned_32_bit_arithmetic(compiled, layout, compiler):
    """int32 lanes with wrapping products and masked shifts give the unsigned 32-bit hash of each element's position
    in memory order, eagerly and compiled."""
    lo, hi = -0x7654321F, 0x12345678  # full-range int32 seed parts, one negative
    seed = torch.tensor([lo, hi], dtype=torch.int32)
    like = torch.empty(3, 7, 11, 5).contiguous(memory_format=layout)

    def draw(like_, seed_):
        return counter_rng.hash_uniform(like_, seed_)

    if compiled:
        engine = FusedPasses()
        if not engine.compiled:
            pytest.skip(f"compiled passes unavailable here: {engine.info.reason}")
        got = engine._compile("hash_test", draw)(like, seed)
    else:
        got = draw(like, seed)
    want = [(_hash_reference(i, lo & _M32, hi & _M32) >> 8) / (1 << 24) for i in range(like.numel())]
    in_memory_order = got.permute(0, 2, 3, 1) if layout == torch.channels_last else got
    assert torch.equal(in_memory_order.flatten(), torch.tensor(want, dtype=torch.float32))


def _avx2_capable() -> str | None:
    if os.uname().machine not in ("x86_64", "AMD64"):
        return "not an x86-64 CPU"
    if "avx2" not in compiler_env.cpu_flags().split():
        return "CPU without AVX2"
    if shutil.which("g++") is None and shutil.which("c++") is None:
        return "no C++ compiler"
    return None


_AVX2_CHILD = textwrap.dedent("""
    import sys, torch
    from pathlib import Path
    from peer.lowp.graphs import compile_graph
    from peer.lowp.passes import FusedPasses
    from peer.lowp.qmath import centered
    engine = FusedPasses()
    assert engine.compiled, engine.info.reason
    assert "vector ISA avx2, byte loads direct" in engine.info.reason, engine.info.reason
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 256, (4, 8, 9, 9), dtype=torch.uint8, generator=gen)  # 2592: 8-lane blocks and a tail
    args = (codes, torch.tensor(131.0))
    got = compile_graph(centered, args)(args)  # the graph itself, never a raced eager twin
    assert torch.equal(got, centered(*args)), "compiled != eager"
    sources = "\\n".join(p.read_text() for p in Path(sys.argv[1]).rglob("*.cpp"))
    assert "_mm_loadl_epi64" in sources, "no direct byte load in the generated kernels"
    print("ok")
""")


def test_avx2_kernels_load_bytes_directly_and_stay_exact(tmp_path):
    """A process restricted to AVX2 (ATEN_CPU_CAPABILITY=avx2, as on a CPU without AVX-512) compiles a pass over
    uint8 codes: its kernel loads them with the direct 8-byte load, and the result equals the eager pass."""
    reason = _avx2_capable()
    if reason:
        pytest.skip(f"needs an x86-64 CPU with AVX2 and a C++ compiler: {reason}")
    env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2", TORCHINDUCTOR_CACHE_DIR=str(tmp_path),
               PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    env["LPDL_LOWP_EAGER"] = "0"  # compile whatever this machine's memory
    done = subprocess.run([sys.executable, "-c", _AVX2_CHILD, str(tmp_path)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


_SHARED_CACHE_CHILD = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    import torch
    from torch._dynamo.utils import counters
    from peer.lowp.passes import FusedPasses
    go = Path(sys.argv[1])
    while not go.exists():  # every process imported torch: they compile together
        time.sleep(0.01)
    engine = FusedPasses()
    assert engine.compiled, engine.info.reason
    x = torch.linspace(-2.0, 3.0, 2 * 4 * 6 * 6).reshape(2, 4, 6, 6)
    codes = engine.activation(x, 8, channels_last=True)[0]
    engine.gradient(x * 0.5, 8)
    engine.centered(codes)
    print(json.dumps({k: counters["inductor"][k] for k in ("fxgraph_cache_miss", "fxgraph_cache_hit")}))
""")


@pytest.mark.slow
def test_daemons_starting_together_on_one_cache_compile_each_graph_once(tmp_path):
    """Three processes started at once on one (empty) kernel cache, each needing the same graphs (the start-up
    check's and three passes'): every graph is generated by one process (an inductor cache miss) and loaded by the
    other two (hits), so the misses of all three add up to the graphs one process needs."""
    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("no C++ compiler")
    go = tmp_path / "go"
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(REPO),
               OMP_NUM_THREADS="1", LPDL_LOWP_EAGER="0",  # compile whatever this machine's memory
               LPDL_CACHE_DIR="off")  # every process runs the start-up check (its verdict is not read from a record)
    children = [subprocess.Popen([sys.executable, "-c", _SHARED_CACHE_CHILD, str(go)], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    go.touch()
    counts = []
    for child in children:
        out, err = child.communicate(timeout=600)
        assert child.returncode == 0, err[-3000:]
        counts.append(json.loads(out.strip().splitlines()[-1]))
    graphs = {c["fxgraph_cache_miss"] + c["fxgraph_cache_hit"] for c in counts}
    assert len(graphs) == 1 and graphs.pop() >= 4, counts  # each process needed the same graphs
    needed = counts[0]["fxgraph_cache_miss"] + counts[0]["fxgraph_cache_hit"]
    assert sum(c["fxgraph_cache_miss"] for c in counts) == needed, counts
