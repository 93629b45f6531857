"""The host's record of the int8 probes' verdicts (peer/lowp/host_record.py): a kernel choice or a step timing is
measured once per host and read by every later plan and process; a record that cannot be used is measured again."""

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from peer.lowp import host_record
from peer.lowp.host_record import HostRecord
from peer.lowp.kernels import ConvGeometry
from peer.lowp.passes import FusedPasses
from peer.lowp.plan import KernelPlan
from peer.lowp.probe import OpCase
from peer.lowp.steptime import StepCheck

REPO = Path(__file__).resolve().parents[1]
CASES = (
    OpCase("linear.fwd", (8, 64), (16, 64)),
    OpCase("conv.fwd", (2, 4, 6, 6), (8, 4, 3, 3), ConvGeometry((3, 3), padding=(1, 1))),
    OpCase("linear.wgrad", (8, 64), (16, 64), None, (8, 16)),
)


class CountingPlan(KernelPlan):
    """A plan that counts the probes it really runs."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.probed: list[OpCase] = []

    def _probe_now(self, case, source):
        self.probed.append(case)
        return super()._probe_now(case, source)


@pytest.fixture
def record(tmp_path, monkeypatch) -> HostRecord:
    monkeypatch.setenv(host_record.CACHE_ENV, str(tmp_path / "cache"))
    return HostRecord.for_device(torch.device("cpu"))


def test_a_second_plan_reads_every_verdict_the_first_one_probed(record):
    first = CountingPlan("cpu", record=record)
    made = [first.choose(case) for case in CASES]
    assert first.probed == list(CASES) and not any(c.recorded for c in made)
    second = CountingPlan("cpu", record=record)
    read = [second.choose(case) for case in CASES]
    assert second.probed == []
    assert all(c.recorded for c in read)
    assert [(c.kernel.name if c.kernel else None, c.fp32_ms, c.kernel_ms) for c in read] == \
        [(c.kernel.name if c.kernel else None, c.fp32_ms, c.kernel_ms) for c in made]


def test_without_a_record_every_plan_probes(record):
    for _ in range(2):
        plan = CountingPlan("cpu")
        plan.choose(CASES[0])
        assert plan.probed == [CASES[0]]


def test_a_record_that_cannot_be_used_is_probed_again_and_rewritten(record, caplog):
    CountingPlan("cpu", record=record).choose(CASES[0])
    (entry,) = [p for p in record.directory.glob("*.json")]
    value = json.loads(entry.read_text())
    for broken in ({**value, "kernel": "no-such-kernel"}, {**value, "fp32_ms": -1.0}, {**value, "kernel": None},
                   {**value, "key": "another verdict"}):
        entry.write_text(json.dumps(broken))
        plan = CountingPlan("cpu", record=record)
        with caplog.at_level(logging.WARNING):
            assert not plan.choose(CASES[0]).recorded
        assert plan.probed == [CASES[0]]
        assert "probing" in caplog.text
        # a fresh, usable verdict replaced it (which kernel it names is a timing: a tiny case can go either way)
        assert json.loads(entry.read_text()) != broken
        assert CountingPlan("cpu", record=record).choose(CASES[0]).recorded
    entry.write_text("{not json")
    assert CountingPlan("cpu", record=record).choose(CASES[0]).recorded is False


def test_a_preferred_kernel_is_never_the_hosts_verdict(record):
    plan = CountingPlan("cpu", record=record, prefer="int_mm")
    plan.choose(CASES[0])
    assert plan.record is None and not any(record.directory.glob("*.json"))


def test_the_record_can_be_turned_off_and_an_unwritable_one_is_skipped(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(host_record.CACHE_ENV, "off")
    assert not HostRecord.for_device(torch.device("cpu")).enabled
    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setenv(host_record.CACHE_ENV, str(blocked))  # a file where the directory should be
    with caplog.at_level(logging.WARNING):
        off = HostRecord.for_device(torch.device("cpu"))
    assert not off.enabled and "each process probes for itself" in caplog.text
    plan = CountingPlan("cpu", record=off)
    plan.choose(CASES[0])
    assert plan.probed == [CASES[0]]


def test_the_record_is_named_after_the_host_torch_and_probing_code(monkeypatch):
    cpu = torch.device("cpu")
    identity = host_record.host_identity(cpu)
    assert torch.__version__ in identity and "code " in identity
    monkeypatch.setattr(host_record, "_code_digest", lambda: "changed")
    assert host_record.host_identity(cpu) != identity  # another version of the probing code: another record


def test_where_the_record_lives(monkeypatch, tmp_path):
    for name in (host_record.CACHE_ENV, "CACHE_DIRECTORY", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert host_record.cache_root() == tmp_path / ".cache" / "lpdl-peer"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert host_record.cache_root() == tmp_path / "xdg" / "lpdl-peer"
    monkeypatch.setenv("CACHE_DIRECTORY", str(tmp_path / "systemd"))  # the unit's CacheDirectory=
    assert host_record.cache_root() == tmp_path / "systemd"
    monkeypatch.setenv(host_record.CACHE_ENV, str(tmp_path / "mine"))
    assert host_record.cache_root() == tmp_path / "mine"


def _models() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 8), nn.ReLU(), nn.Linear(8, 4)), nn.Sequential(nn.Linear(12, 8))


def test_the_step_check_is_measured_once_per_host_model_and_shape(record):
    calls = []

    def timer(a, b, x):
        calls.append(tuple(x.shape))
        return [0.003, 0.002]

    model, other = _models()
    first = StepCheck(timer=timer, record=record, context="quantizers eager")
    assert first.measure(model, lambda: model, torch.zeros(5, 12)).recorded is False
    again = StepCheck(timer=timer, record=record, context="quantizers eager")
    timing = again.measure(model, lambda: model, torch.zeros(5, 12))
    assert calls == [(5, 12)] and timing.recorded and timing.ratio == pytest.approx(1.5)
    StepCheck(timer=timer, record=record, context="quantizers eager").measure(model, lambda: model,
                                                                               torch.zeros(7, 12))
    StepCheck(timer=timer, record=record, context="quantizers compiled").measure(model, lambda: model,
                                                                                  torch.zeros(5, 12))
    StepCheck(timer=timer, record=record, context="quantizers eager").measure(other, lambda: other,
                                                                               torch.zeros(5, 12))
    assert len(calls) == 4  # another shape, another quantizer path, another architecture: measured


def test_a_step_measured_while_pass_graphs_still_compile_is_measured_again_once_they_are_there(record):
    """Background mode: with graphs still compiling, eager passes stand in for them and the filler shares the CPU -
    not the path the record's key names. Processes in the same state read that step; the first one whose graphs
    are all there measures again, and its step is the one every later process reads."""
    calls, waiting = [], [2]

    def timer(a, b, x):
        calls.append(tuple(x.shape))
        return [0.004, 0.002] if waiting[0] else [0.001, 0.002]

    def check():
        return StepCheck(timer=timer, record=record, context="quantizers compiled", waiting=lambda: waiting[0])

    model, _ = _models()
    assert check().measure(model, lambda: model, torch.zeros(5, 12)).slower
    same_state = check().measure(model, lambda: model, torch.zeros(5, 12))
    assert len(calls) == 1 and same_state.recorded and same_state.slower  # read, not measured: no waiting in line
    waiting[0] = 0
    settled = check().measure(model, lambda: model, torch.zeros(5, 12))
    assert len(calls) == 2 and not settled.recorded and not settled.slower  # measured again
    later = check().measure(model, lambda: model, torch.zeros(5, 12))
    assert len(calls) == 2 and later.recorded and later.ratio == pytest.approx(0.5)


_DAEMON_LIKE_CHILD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    go = Path(sys.argv[1])
    while not go.exists():
        time.sleep(0.01)
    import logging
    import torch
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
    from peer.lowp import PrecisionConfig, resolve_precision
    from peer.lowp.passes import FusedPasses
    from peer.models import build_model
    resolved = resolve_precision(PrecisionConfig("int8", passes=FusedPasses(try_compile=False)), torch.device("cpu"))
    model = build_model("mnist-cnn", in_channels=1, precision=resolved.config_in_use)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(2):  # the second training forward runs the step check
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(torch.randn(16, 1, 28, 28)), torch.randint(0, 10, (16,))).backward()
        opt.step()
    print("STEP", resolved.step.recorded, flush=True)
""")


@pytest.mark.slow
def test_daemons_starting_together_probe_each_verdict_once(tmp_path):
    """Three processes started at once on one empty record, each resolving int8 and training an MNIST CNN two
    steps (the start-up probe, the model's own shapes, the step check): every verdict is probed by one of them and
    read by the other two; a fourth process started afterwards probes nothing."""
    go = tmp_path / "go"
    env = dict(os.environ, LPDL_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")

    def start() -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", _DAEMON_LIKE_CHILD, str(go)], env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    children = [start() for _ in range(3)]
    go.touch()
    logs = []
    for child in children:
        out, err = child.communicate(timeout=600)
        assert child.returncode == 0, err[-3000:]
        logs.append((out, err))
    probed = [[line for line in err.splitlines() if "int8 kernel for" in line and "[host probe record]" not in line]
              for _, err in logs]
    read = [[line for line in err.splitlines() if "int8 kernel for" in line and "[host probe record]" in line]
            for _, err in logs]
    verdicts = {len(p) + len(r) for p, r in zip(probed, read)}
    assert len(verdicts) == 1 and verdicts.pop() >= 8, logs  # each process needed the same verdicts
    needed = len(probed[0]) + len(read[0])
    assert sum(len(p) for p in probed) == needed, probed  # each probed by exactly one process
    assert sorted(out.split()[-1] for out, _ in logs) == ["False", "True", "True"]  # the step check: measured once
    late = start()
    out, err = late.communicate(timeout=600)
    assert late.returncode == 0, err[-3000:]
    assert "int8 kernel for" in err and all("[host probe record]" in line for line in err.splitlines()
                                            if "int8 kernel for" in line)
    assert out.split()[-1] == "True"


def test_the_compiled_passes_start_up_check_runs_once_per_host_and_only_a_pass_is_kept(record, monkeypatch):
    """The small-case check that decides the compiled path (three graphs traced and loaded: seconds of every daemon's
    start) runs in the first process of a host; later ones read its verdict. A failed check is not kept: every
    process checks again."""
    monkeypatch.setenv("LPDL_LOWP_EAGER", "0")  # compile whatever this machine's memory
    checks = []
    verdict: list[str | None] = [None]
    monkeypatch.setattr(FusedPasses, "_check_small_case", staticmethod(lambda compiler: checks.append(1) or verdict[0]))
    first = FusedPasses().info
    assert first.path == "compiled" and len(checks) == 1 and "[host probe record]" not in first.reason
    second = FusedPasses().info
    assert second.path == "compiled" and len(checks) == 1 and second.reason.endswith("[host probe record]")
    monkeypatch.setenv(host_record.CACHE_ENV, str(record.directory.parent.parent / "other"))  # an empty record
    verdict[0] = "compiled centered disagreed with eager; not used"
    assert [FusedPasses().info.path for _ in range(2)] == ["eager", "eager"] and len(checks) == 3
