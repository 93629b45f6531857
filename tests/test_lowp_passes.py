"""Fused quantization passes: compiled == eager == the reference quantizer, unbiased stochastic rounding without a
full-size random tensor, and the eager fallback chosen at start (and logged) where torch.compile cannot work."""

import logging

import pytest
import torch

from peer.lowp import compile_policy, counter_rng, host_record, qmath
from peer.lowp import graphs as graphs_module
from peer.lowp import passes as passes_module
from peer.lowp.passes import FusedPasses
from peer.lowp.quantize import batch_range, qparams_from_range, quantize_codes

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _reference_codes(x, lo, hi):
    return quantize_codes(x, qparams_from_range(lo, hi, 8, False), False).to(torch.int32) + 128


@pytest.mark.parametrize("channels_last", [False, True])
def test_eager_activation_codes_equal_the_reference_quantizer(channels_last):
    x = torch.randn(4, 6, 5, 5) * 3 + 1
    codes, lo, hi = FusedPasses(try_compile=False).activation(x, 8, channels_last=channels_last)
    assert (lo, hi) == batch_range(x)
    assert codes.data.dtype == torch.uint8
    assert codes.data.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    assert torch.equal(codes.data.int(), _reference_codes(x, lo, hi))
    qp = qparams_from_range(lo, hi, 8, False)
    assert torch.equal(codes.zero_point - 128, qp.zero_point) and torch.equal(codes.scale, qp.scale)


def _sr_codes(engine: FusedPasses, n: int) -> torch.Tensor:
    g = torch.full((n,), 10.3)
    g[0] = 127.0  # scale exactly 1.0: every other code is floor(10.3 + u)
    codes = engine.gradient(g, 8)
    assert float(codes.scale) == 1.0 and int(codes.zero_point) == 128
    return codes.data[1:].int() - 128


def test_eager_stochastic_rounding_is_unbiased_and_draws_no_mt19937_numbers(monkeypatch):
    """Each row holds one value with a fraction f in [0, 1); over 4 calls (fresh seeds) and 16384 elements a row's
    mean code is the value within 5 standard deviations of a Bernoulli(f) mean. A rounding to nearest (bias up to
    1/2) or a generator with fewer random bits (bias 1/64 at 6 bits) fails; torch.rand (mt19937) is never called."""
    def no_rand(*args, **kwargs):
        raise AssertionError("eager stochastic rounding drew from torch.rand")

    monkeypatch.setattr(torch, "rand", no_rand)
    torch.manual_seed(0)
    fractions = torch.tensor([0.0, 1 / 256, 0.01, 0.1, 0.25, 0.3, 0.5, 0.7, 0.999, 1 - 1 / 1024])
    values = torch.arange(len(fractions)) * 12.0 - 60.0 + fractions  # negative and positive, far from the clamp
    g = values[:, None].expand(-1, 4096).contiguous()
    g[0, 0] = 127.0  # step exactly 1.0: each code is floor(value + u)
    engine = FusedPasses(try_compile=False)
    calls = [engine.gradient(g, 8) for _ in range(4)]
    assert all(float(c.scale) == 1.0 and int(c.zero_point) == 128 for c in calls)
    codes = torch.cat([c.data[:, 1:].int() - 128 for c in calls], dim=1).double()
    assert set((codes - values[:, None].double().floor()).unique().tolist()) == {0.0, 1.0}
    n = codes.shape[1]
    sigma = (fractions.double() * (1 - fractions.double()) / n).sqrt()
    assert ((codes.mean(1) - values.double()).abs() <= 5 * sigma + 1e-12).all()
    assert not torch.equal(calls[0].data, calls[1].data)  # a fresh seed per call


def test_hashed_uniforms_are_uniform_and_uncorrelated():
    """The counter-based draws: 64-bin chi-square below the 1e-6 tail of chi2(63) (~126), neighbours (positions 1
    and 64 apart) and two seeds' draws uncorrelated within 5 / sqrt(n)."""
    n = 1 << 18
    like = torch.empty(n)
    u = counter_rng.hash_uniform(like, torch.tensor([7, -3], dtype=torch.int32)).double()
    assert 0.0 <= float(u.min()) and float(u.max()) < 1.0
    counts = torch.bincount((u * 64).long(), minlength=64).double()
    assert float(((counts - n / 64) ** 2 / (n / 64)).sum()) < 126.0
    v = counter_rng.hash_uniform(like, torch.tensor([8, -3], dtype=torch.int32)).double()
    for a, b in ((u[1:], u[:-1]), (u[64:], u[:-64]), (u, v)):
        assert abs(float(torch.corrcoef(torch.stack([a, b]))[0, 1])) < 5 / n ** 0.5


def test_compile_failure_falls_back_to_eager_at_start_and_is_logged(monkeypatch, caplog, tmp_path):
    monkeypatch.setenv("LPDL_LOWP_EAGER", "0")  # compile whatever this machine's memory
    monkeypatch.setenv(host_record.CACHE_ENV, str(tmp_path / "record"))  # no earlier check's verdict
    def no_compiler(*args, **kwargs):
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(passes_module, "compile_graph", no_compiler)
    engine = FusedPasses()
    with caplog.at_level(logging.WARNING, logger="peer.lowp.passes"):
        info = engine.info
    assert info.path == "eager" and "no C++ compiler" in info.reason
    assert any("eager" in r.getMessage() and "no C++ compiler" in r.getMessage() for r in caplog.records)
    x = torch.randn(2, 3, 4, 4)
    assert torch.equal(engine.activation(x, 8)[0].data, FusedPasses(try_compile=False).activation(x, 8)[0].data)


def test_environment_forces_eager(monkeypatch):
    monkeypatch.setenv("LPDL_LOWP_EAGER", "1")
    assert FusedPasses().info.path == "eager"


def test_a_small_machine_runs_the_passes_eagerly_unless_told_to_compile(monkeypatch, tmp_path):
    """Below COMPILE_MIN_MEMORY_MIB the compiler's resident cost is not spent (a 2 GB board); LPDL_LOWP_EAGER=0
    compiles anyway. Nothing is compiled to decide it."""
    monkeypatch.delenv("LPDL_LOWP_EAGER", raising=False)
    monkeypatch.setenv(host_record.CACHE_ENV, str(tmp_path / "record"))  # no earlier check's verdict
    monkeypatch.setattr(compile_policy, "physical_memory_mib", lambda: 1900.0)
    compiled = []
    monkeypatch.setattr(passes_module, "compile_graph",
                        lambda fn, args: compiled.append(fn) or (lambda call_args: fn(*call_args)))
    info = FusedPasses().info
    assert info.path == "eager" and "1900 MiB of memory" in info.reason and not compiled
    monkeypatch.setenv("LPDL_LOWP_EAGER", "0")
    assert FusedPasses().info.path == "compiled" and compiled  # the (stubbed) compiler was tried and agreed


def test_memory_is_memtotal_or_the_cgroup_limit_where_lower(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:        8192000 kB\nMemFree:          100 kB\n")
    cgroup = tmp_path / "cgroup"
    cgroup.write_text("0::/system.slice/lpdl-peer.service\n")
    limit = tmp_path / "fs" / "system.slice" / "lpdl-peer.service" / "memory.max"
    limit.parent.mkdir(parents=True)
    read = lambda: compile_policy.physical_memory_mib(str(meminfo), str(cgroup), str(tmp_path / "fs"))  # noqa: E731
    limit.write_text("max\n")  # no limit: the machine's memory
    assert read() == 8000.0
    limit.write_text(f"{2 * 2**30}\n")  # MemoryMax=2G on an 8 GB board
    assert read() == 2048.0
    assert compile_policy.physical_memory_mib(str(tmp_path / "absent")) == 0.0


def test_a_cgroup_v1_memory_limit_counts_too(tmp_path):
    """A host that mounts cgroup v1 (Jetson's L4T): the memory controller's memory.limit_in_bytes, whose "no limit"
    is a number far above MemTotal."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:        8192000 kB\n")
    cgroup = tmp_path / "cgroup"
    cgroup.write_text("5:cpu,cpuacct:/system.slice/lpdl-peer.service\n4:memory:/system.slice/lpdl-peer.service\n"
                      "0::/system.slice/lpdl-peer.service\n")
    limit = tmp_path / "fs" / "memory" / "system.slice" / "lpdl-peer.service" / "memory.limit_in_bytes"
    limit.parent.mkdir(parents=True)
    read = lambda: compile_policy.physical_memory_mib(str(meminfo), str(cgroup), str(tmp_path / "fs"))  # noqa: E731
    limit.write_text("9223372036854771712\n")  # no limit
    assert read() == 8000.0
    limit.write_text(f"{2 * 2**30}\n")  # MemoryMax=2G, which systemd writes here under v1
    assert read() == 2048.0
    # a v1 container without its own cgroup namespace: its cgroup is mounted at the root, /proc names the host's path
    cgroup.write_text("4:memory:/docker/abc\n")
    root_limit = tmp_path / "fs" / "memory" / "memory.limit_in_bytes"
    root_limit.write_text(f"{2**30}\n")
    assert read() == 1024.0


def test_a_compiled_pass_that_fails_later_runs_eagerly(monkeypatch):
    engine = FusedPasses()
    monkeypatch.setattr(engine, "_info", passes_module.PassInfo("compiled", "test"))

    def broken(name, fn):
        def call(*args):
            raise RuntimeError("compiler rejected this shape")
        return call

    monkeypatch.setattr(engine, "_compile", broken)
    x = torch.randn(2, 3, 4, 4)
    got = engine.activation(x, 8)[0].data
    assert "act_batch" in engine.fallbacks
    assert torch.equal(got, FusedPasses(try_compile=False).activation(x, 8)[0].data)


@pytest.mark.slow
def test_compiled_passes_equal_eager_and_round_without_bias(compiler):
    engine = FusedPasses()
    if not engine.compiled:
        pytest.skip(f"torch.compile unusable here: {engine.info.reason}")
    eager = FusedPasses(try_compile=False)
    x = torch.randn(8, 16, 12, 12) * 2 - 0.5
    for channels_last in (False, True):
        got, want = engine.activation(x, 8, channels_last=channels_last), eager.activation(x, 8,
                                                                                           channels_last=channels_last)
        assert torch.equal(got[0].data, want[0].data) and torch.equal(got[0].scale, want[0].scale)
        lo, hi = torch.tensor(-1.0), torch.tensor(2.5)
        assert torch.equal(engine.activation(x, 8, lo, hi)[0].data, eager.activation(x, 8, lo, hi)[0].data)
    w = torch.randn(32, 16, 3, 3) * 0.1
    w.view(-1)[:4] = torch.tensor([0.5, -0.5, 1.5, -2.5]) * w.abs().max() / 127  # ties: round half to even in both
    compiled_w, codes_ = (passes_module.weight_codes(w, 8, engine_) for engine_ in (engine, eager))
    assert torch.equal(compiled_w.data, codes_.data) and torch.equal(compiled_w.scale, codes_.scale)
    codes = _sr_codes(engine, 1 << 18)  # hashed uniforms inside the kernel
    assert set(codes.unique().tolist()) == {10, 11}
    assert abs(codes.float().mean().item() - 10.3) < 0.01
    assert not torch.equal(_sr_codes(engine, 1 << 18), codes)  # a fresh seed per call


@pytest.mark.slow
def test_compiled_norm_gradients_match_eager(compiler):
    from peer.lowp import PrecisionConfig, RangeEvoNorm

    x = torch.randn(4, 16, 8, 8) * 2
    g = torch.randn(4, 16, 8, 8)
    grads = []
    for engine in (FusedPasses(), FusedPasses(try_compile=False)):
        torch.manual_seed(0)
        norm = RangeEvoNorm(16, precision=PrecisionConfig("int8", passes=engine))
        xi = x.clone().requires_grad_()
        norm(xi).backward(g)
        grads.append([xi.grad, norm.v.grad, norm.gamma.grad, norm.beta.grad])
    for compiled, eager in zip(*grads):
        assert torch.allclose(compiled, eager, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_norm_hands_its_input_gradient_codes_to_the_conv_before_it(monkeypatch, compiler):
    """Compiled: a norm after an int8 conv computes the stochastic-rounding codes of its input gradient in its own
    fused backward pass; the conv's backward uses them (quantizes nothing itself), and they are the codes the
    hashed rounding gives for that gradient with the same seed."""
    from peer.lowp import PrecisionConfig, QConv2d, RangeEvoNorm
    from peer.lowp import evonorm as evonorm_module

    engine = FusedPasses()
    if not engine.compiled:
        pytest.skip(f"torch.compile unusable here: {engine.info.reason}")
    torch.manual_seed(0)
    precision = PrecisionConfig("int8", passes=engine)
    conv = QConv2d(8, 16, 3, padding=1, bias=False, precision=precision)
    norm = RangeEvoNorm(16, precision=precision)
    handed, seeds = [], []
    attach, draw = evonorm_module.attach_gradient_codes, evonorm_module.sr_seed
    monkeypatch.setattr(evonorm_module, "attach_gradient_codes",
                        lambda g, codes, bits: handed.append((g, codes)) or attach(g, codes, bits))
    monkeypatch.setattr(evonorm_module, "sr_seed", lambda device: seeds.append(draw(device)) or seeds[-1])
    quantized_in_conv = []
    monkeypatch.setattr(engine, "gradient", lambda *a, **k: quantized_in_conv.append(1))
    x = torch.randn(4, 8, 10, 10, requires_grad=True)
    norm(conv(x)).backward(torch.randn(4, 16, 10, 10))
    assert len(handed) == 1 and not quantized_in_conv and x.grad is not None
    (dx, codes), seed = handed[0], seeds[0]
    want, want_step = qmath.grad_codes_hashed(dx, seed, 127, True)
    codes, step = codes.data, codes.scale
    assert torch.equal(codes, want) and torch.equal(step, want_step)


def _resnet_step(output_quantized: bool, engine: FusedPasses) -> tuple[list[torch.Tensor], int]:
    """Loss, gradients and the number of activation passes of one int8 ResNet-8 training step."""
    from peer.lowp import PrecisionConfig
    from peer.models.resnet import cifar_resnet

    torch.manual_seed(0)
    model = cifar_resnet(8, num_classes=10, in_channels=3, norm="range-evonorm",
                         precision=PrecisionConfig("int8", passes=engine), groups=8)
    for m in model.modules():
        if hasattr(m, "output_quantized"):
            m.output_quantized = output_quantized
    x, y = torch.randn(4, 3, 16, 16), torch.tensor([0, 1, 2, 3])
    calls = []
    run = engine.run
    engine.run = lambda name, *a: calls.append(name) or run(name, *a)
    try:
        torch.manual_seed(1)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
    finally:
        del engine.run
    return [loss.detach()] + [p.grad for p in model.parameters()], calls.count("act_batch")


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_norm_output_codes_handed_on_change_nothing_but_the_pass_count(compiled, compiler):
    """A norm whose output feeds 8-bit layers computes that output's batch codes in its own pass (training): the
    step's loss and gradients are those of quantizing the output separately, in fewer passes (the residual sums come
    out channels_last, so the average pool's fp32 sums, and the last layer's weight gradient, may round differently)."""
    engine = FusedPasses(try_compile=compiled)
    if compiled and not engine.compiled:
        pytest.skip(f"torch.compile unusable here: {engine.info.reason}")
    (off, passes_off), (on, passes_on) = _resnet_step(False, engine), _resnet_step(True, engine)
    assert passes_on < passes_off
    assert torch.equal(off[0], on[0])
    for a, b in zip(off, on):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-9)


@pytest.mark.slow
def test_compiled_batch_range_equals_eager_for_any_batch_size(compiler):
    """The batch range (mean of per-sample min / max) is summed in one fixed order: compiled and eager agree to the
    bit (with ``Tensor.mean`` they were 1 ulp apart for most random batches of 8, so codes could differ at ties)."""
    engine = FusedPasses()
    if not engine.compiled:
        pytest.skip(f"torch.compile unusable here: {engine.info.reason}")
    gen = torch.Generator().manual_seed(0)
    for n in (1, 3, 5, 8, 32):
        for _ in range(4):
            x = torch.randn(n, 16, 6, 6, generator=gen) * 2 - 0.5
            got = engine.activation(x, 8)
            want = FusedPasses(try_compile=False).activation(x, 8)
            assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
            assert torch.equal(got[0].data, want[0].data) and torch.equal(got[0].scale, want[0].scale)


def test_fixed_order_mean_is_the_mean():
    from peer.lowp.quantize import fixed_order_mean

    for n in (1, 2, 3, 7, 32):
        v = torch.randn(n, dtype=torch.float64)
        assert torch.allclose(fixed_order_mean(v), v.mean(), rtol=1e-12)
    assert fixed_order_mean(torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])).item() == 3.0


@pytest.mark.parametrize("slow", ["compiled", "eager"])
def test_a_signature_keeps_whichever_of_graph_and_eager_twin_was_faster_at_its_first_call(monkeypatch, slow):
    """StaticGraphs times a new signature's compiled graph against the pass's eager twin (equal results) and keeps
    the clearly faster one for that signature; other signatures race on their own."""
    import time

    calls = []

    def sleepy(tag, seconds):
        def run(x):
            calls.append(tag)
            time.sleep(seconds)
            return x + 1
        return run

    compiled_s, eager_s = (0.02, 0.0) if slow == "compiled" else (0.0, 0.02)
    monkeypatch.setattr(graphs_module, "compile_graph",
                        lambda fn, args: lambda call_args: sleepy("compiled", compiled_s)(*call_args))
    graphs = graphs_module.StaticGraphs(lambda x: x + 1, rival=sleepy("eager", eager_s), name="demo")
    x = torch.zeros(3)
    assert torch.equal(graphs(x), x + 1)
    times = graphs.choices[next(iter(graphs.choices))]
    winner = "eager" if slow == "compiled" else "compiled"
    assert times[slow] > times[winner]
    calls.clear()
    graphs(x)
    assert calls == [winner]  # decided once: no more timing for this signature
    graphs(torch.zeros(4))  # a new signature races again
    assert len(graphs.choices) == 2


def test_a_graph_compiled_later_races_its_twin_once_it_is_there():
    """Background mode: until the store holds a signature's graph the twin runs (equal by construction), without
    a race; the first call once the graph is there races them, and the faster runs from then on."""
    import time

    calls = []
    stored = {"ready": False}

    def slow_graph(call_args):
        calls.append("compiled")
        time.sleep(0.02)
        return call_args[0] + 1

    def twin(x):
        calls.append("eager")
        return x + 1

    graphs = graphs_module.StaticGraphs(lambda x: x + 1, rival=twin, name="demo", compiler=lambda fn, a: slow_graph,
                                        ready=lambda graph: stored["ready"])
    x = torch.zeros(3)
    assert torch.equal(graphs(x), x + 1) and torch.equal(graphs(x), x + 1)
    assert calls == ["eager", "eager"] and not graphs.choices  # no graph yet: no race
    stored["ready"] = True
    calls.clear()
    assert torch.equal(graphs(x), x + 1)
    assert "compiled" in calls and len(graphs.choices) == 1  # raced once the graph is there
    calls.clear()
    graphs(x)
    assert calls == ["eager"]  # the twin won: the slow graph no longer runs


def test_the_background_mode_races_a_stored_pooling_graph_against_its_twin():
    """The fleet's default (the store filled in the background): window max pooling runs its twin while the store
    lacks the graph, and once the graph is stored the two race - the slower compiled graph no longer runs."""
    import time

    from peer.lowp import aot_graphs, masks

    compiled_calls = []

    def slow_stored_graph(call_args):
        compiled_calls.append(1)
        time.sleep(0.02)
        return masks._window_max(*call_args)

    class Store:  # what FusedPasses asks of the host's store in background mode
        recheck_s, loaded, filled = 0.0, 0, False

        def background_graph(self, fn, args, usable):
            return aot_graphs._Pending(self, "window_max", masks._window_max_eager, usable)

        def stored(self, name):
            return slow_stored_graph if self.filled else None

    engine = FusedPasses()
    engine.background, engine.aot = True, Store()
    engine._stored_graphs_checked = lambda: True
    graphs = engine._compile("window_max", masks._window_max)
    x = torch.randn(2, 3, 8, 8).round()
    want = masks._window_max(x, (2, 2))
    assert all(torch.equal(a, b) for a, b in zip(graphs(x, (2, 2)), want))
    assert not compiled_calls and not graphs.choices  # not stored yet: the twin, no race
    assert engine.waiting_graphs() == 1  # what keeps a step measured now from being recorded (steptime.py)
    engine.aot.filled = True
    assert engine.waiting_graphs() == 0  # stored, not raced yet: the path is settled
    assert all(torch.equal(a, b) for a, b in zip(graphs(x, (2, 2)), want))
    assert compiled_calls and len(graphs.choices) == 1  # stored: raced
    compiled_calls.clear()
    graphs(x, (2, 2))
    assert not compiled_calls  # the twin won
    assert engine.waiting_graphs() == 0 and FusedPasses().waiting_graphs() == 0


def test_a_faster_eager_twin_with_other_results_is_not_kept(monkeypatch, caplog):
    """The race never changes results: a twin that disagrees with the compiled graph loses whatever its speed."""
    import time

    def slow_graph(call_args):
        time.sleep(0.02)
        return call_args[0] + 1

    monkeypatch.setattr(graphs_module, "compile_graph", lambda fn, args: slow_graph)
    graphs = graphs_module.StaticGraphs(lambda x: x + 1, rival=lambda x: x + 2, name="demo")
    with caplog.at_level(logging.WARNING):
        assert torch.equal(graphs(torch.zeros(3)), torch.ones(3))
        assert torch.equal(graphs(torch.zeros(3)), torch.ones(3))
    assert any("differs from the compiled graph" in r.getMessage() for r in caplog.records)


def test_only_twins_equal_to_the_compiled_body_by_construction_may_race():
    """Norm and quantization passes (sums, divisions: a compiler may reorder or fuse them) never race; pooling and
    centring (max, selections, exact integers) do."""
    from peer.lowp import masks

    engine = FusedPasses()
    assert engine._compile("window_max_t", masks._window_max).rival is masks._window_max_eager
    assert engine._compile("centered_t", qmath.centered).rival is qmath.centered_eager
    assert engine._compile("act_batch_t", qmath.act_batch_codes).rival is None
    assert engine._compile("dequant_sum_t", qmath.dequant_sum).rival is None


def test_without_an_eager_twin_a_signature_is_compiled_without_timing(monkeypatch):
    built = []
    monkeypatch.setattr(graphs_module, "compile_graph", lambda fn, args: built.append(args) or (lambda a: "graph"))
    graphs = graphs_module.StaticGraphs(lambda x: x)
    assert graphs(torch.zeros(2)) == "graph" and graphs(torch.zeros(2)) == "graph"
    assert len(built) == 1 and not graphs.choices
