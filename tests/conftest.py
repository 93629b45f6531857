"""Shared fixtures, and the order of the suite: tests marked ``docker`` run last."""

import os
import shutil
import tempfile
from types import SimpleNamespace

import pytest
import torch
from hypothesis import settings

from peer.logs import quiet_grpc_core

quiet_grpc_core()  # before any test opens a channel: gRPC's C core INFO lines ("Got goaway") stay out of reports
# Property tests assert results, never times: hypothesis's default 200 ms deadline per example failed a codec
# round trip that took 378 ms once on a loaded 2-core CI machine (1.9 ms when rerun).
settings.register_profile("lpdl", deadline=None)
settings.load_profile("lpdl")

# The int8 probes' host record (peer/lowp/host_record.py): one fresh directory per test session, shared by the
# daemons the tests start (they inherit the environment), never the user's own ~/.cache.
PROBE_RECORD = os.environ["LPDL_CACHE_DIR"] = tempfile.mkdtemp(prefix="lpdl-probe-record-")
# No background compile of pass graphs behind the tests' fleets (the local fleet's default, peer/lowp/aot_queue.py):
# minutes of a compiler on the suite's cores. tests/test_lowp_aot_background.py turns it on where it is the subject.
os.environ.setdefault("LPDL_LOWP_AOT", "0")
# The int8 passes run eagerly in the suite (the path a fresh host's fleet takes until its store is filled): compiling
# them just in time in every test process and daemon took most of the suite's time on a fresh machine (7 simulator
# tests: 207 s compiled, 34 s eager). The tests whose subject is the compiled path take the ``compiler`` fixture.
os.environ.setdefault("LPDL_LOWP_EAGER", "1")


@pytest.fixture
def compiler(monkeypatch: pytest.MonkeyPatch) -> None:
    """The process decides its passes' path as a daemon would (compiled where it may), not the suite's eager."""
    monkeypatch.delenv("LPDL_LOWP_EAGER", raising=False)


@pytest.fixture(scope="module")
def one_torch_thread():
    """Run a module on one torch thread (deterministic kernels, fair to the other core), then restore."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def docker_last(items: list[pytest.Item]) -> list[pytest.Item]:
    """``items`` with every ``docker``-marked test moved to the end, each group in its original order.

    The docker test starts dockerd, which on a default configuration sets the iptables FORWARD policy to DROP and
    would cut the bridges of the network-namespace tests (marker ``netns``) that run after it; ours starts dockerd
    without iptables changes and checks the host's firewall at teardown, and running last makes sure nothing else
    can run beside it in the same session either.
    """
    return ([item for item in items if item.get_closest_marker("docker") is None]
            + [item for item in items if item.get_closest_marker("docker") is not None])


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items[:] = docker_last(items)


#: Node ids the workers of a parallel run deselected (``-m 'not docker'``): counted in the summary line.
_WORKERS_DESELECTED: set[str] = set()


def pytest_deselected(items: list[pytest.Item]) -> None:
    """In a worker of a parallel run (``-n``), pass what ``-m`` left out on to the controller (below)."""
    if items and hasattr(items[0].config, "workeroutput"):
        items[0].config.workeroutput.setdefault("deselected", []).extend(item.nodeid for item in items)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:  # noqa: ANN001 - the parallel-run plugin's hook
    """The controller of a parallel run collects nothing itself: keep the workers' deselected tests (each worker
    collects the whole suite, so the same ids come from each)."""
    _WORKERS_DESELECTED.update(getattr(node, "workeroutput", {}).get("deselected", ()))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """A parallel run's summary line counts the deselected tests as a serial run's does ("1 deselected"): the
    docker test is left out of the default run, never silently."""
    if _WORKERS_DESELECTED and not terminalreporter.stats.get("deselected"):
        terminalreporter.stats["deselected"] = [SimpleNamespace(nodeid=n) for n in sorted(_WORKERS_DESELECTED)]


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(PROBE_RECORD, ignore_errors=True)
