"""The fleet's zygote (peer/fleet/zygote.py, peer/cli/zygote.py): daemons forked from one process that imported
torch once, each with its own log, session and exit code, stopped by signals like any process."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from peer.fleet.launch import daemon_environment
from peer.fleet.zygote import Zygote, ZygoteError


@pytest.fixture
def zygote(tmp_path: Path):
    """A zygote whose forked processes are killed at teardown: each runs in its own session and would outlive a
    test that failed before stopping them."""
    z = Zygote(daemon_environment(dict(os.environ)), tmp_path / "zygote.log")
    forked = []
    spawn = z.spawn
    z.spawn = lambda *args, **kwargs: forked.append(spawn(*args, **kwargs)) or forked[-1]  # type: ignore[method-assign]
    yield z
    for process in forked:
        if process.poll() is None:
            process.kill()
            process.wait(30)
    z.close()


def test_forked_commands_write_their_own_logs_and_exit_codes(zygote: Zygote, tmp_path: Path) -> None:
    """`lpdl-peer --version` exits 0 with the version in its log; a `status` of a state directory with no daemon
    exits 1 with the reason in its log; each is a process of its own, not the zygote."""
    ok = zygote.spawn(["--version"], daemon_environment(dict(os.environ)), tmp_path / "version.log")
    bad = zygote.spawn(["status", "--state-dir", str(tmp_path / "none")], daemon_environment(dict(os.environ)),
                       tmp_path / "status.log")
    assert ok.wait(60) == 0 and bad.wait(60) == 1
    assert "lpdl-peer, version" in (tmp_path / "version.log").read_text()
    assert "none" in (tmp_path / "status.log").read_text()
    assert len({ok.pid, bad.pid, zygote._proc.pid}) == 3


def _start_argv(state_dir: Path) -> list[str]:
    return ["start", "--insecure", "--neighbors", "127.0.0.1:1", "--listen", "127.0.0.1:0", "--precision", "fp32",
            "--state-dir", str(state_dir), "--keep-running", "--round-interval", "0.2", "--peer-id", "forked-0"]


def _wait_for(path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear in {timeout_s} s"
        time.sleep(0.1)


@pytest.mark.slow
def test_a_forked_daemon_stops_cleanly_on_sigterm_and_reports_sigkill(zygote: Zygote, tmp_path: Path) -> None:
    """A real daemon forked from the zygote serves its control socket, stops with exit 0 on SIGTERM (its final
    checkpoint written), and a second one killed by SIGKILL reads -9, as Popen would say."""
    env = daemon_environment(dict(os.environ))
    first = zygote.spawn(_start_argv(tmp_path / "a"), env, tmp_path / "a.log")
    second = zygote.spawn(_start_argv(tmp_path / "b"), env, tmp_path / "b.log")
    for name in ("a", "b"):
        _wait_for(tmp_path / name / "control.sock", 120)
    assert first.poll() is None and os.getsid(first.pid) == first.pid  # its own session
    # ps shows the command it runs, not the zygote's
    title = Path(f"/proc/{first.pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    assert title == " ".join(["lpdl-peer", *_start_argv(tmp_path / "a")])
    first.terminate()
    assert first.wait(60) == 0, (tmp_path / "a.log").read_text()[-2000:]
    assert (tmp_path / "a" / "checkpoint.pt").exists()
    with pytest.raises(subprocess.TimeoutExpired):
        second.wait(0.5)  # still running
    second.kill()
    assert second.wait(60) == -signal.SIGKILL


def test_a_zygote_that_cannot_start_is_named_with_its_log(tmp_path: Path) -> None:
    """An interpreter that cannot start (a PYTHONHOME that does not exist) is refused when the first daemon is
    forked, naming the zygote's log, instead of a fleet waiting for daemons that never come."""
    broken = Zygote({**daemon_environment(dict(os.environ)), "PYTHONHOME": str(tmp_path / "nowhere")},
                    tmp_path / "zygote.log", ready_timeout_s=60)
    try:
        with pytest.raises(ZygoteError, match="zygote.log"):
            broken.spawn(["--version"], {}, tmp_path / "v.log")
    finally:
        broken.close()
