"""What `lpdl-peer fleet` hands its daemons: quantization passes from the host's ahead-of-time store, filled in the
background, unless the user said otherwise (N daemons on one machine must not each compile the same kernels); and
daemons started as their own commands where the zygote cannot fork them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from peer.fleet.launch import launch

PRINT_ENV = [sys.executable, "-c", "import os; print('aot=' + os.environ.get('LPDL_LOWP_AOT', 'unset'))"]


@pytest.mark.parametrize(("user", "daemon"), [(None, "background"), ("0", "0")])
def test_fleet_daemons_load_passes_from_the_background_store_unless_the_user_chose(tmp_path: Path, monkeypatch, user,
                                                                                   daemon) -> None:
    if user is None:
        monkeypatch.delenv("LPDL_LOWP_AOT", raising=False)
    else:
        monkeypatch.setenv("LPDL_LOWP_AOT", user)
    daemons, zygote = launch([PRINT_ENV, PRINT_ENV], tmp_path, "envtest")
    assert zygote is None  # not daemon commands: each runs as its command
    for d in daemons:
        assert d.proc.wait(30) == 0
        assert d.log_path.read_text().strip() == f"aot={daemon}"


def test_daemons_start_as_commands_when_the_zygote_cannot(tmp_path: Path, monkeypatch, caplog) -> None:
    """A zygote that cannot start (here its interpreter: a PYTHONHOME that does not exist) is logged, and the
    daemons start as their own commands instead of the fleet failing."""
    import os

    from peer.fleet import launch as launcher
    from peer.fleet.zygote import Zygote

    def broken(run_dir: Path, env: dict[str, str], allocator: str) -> Zygote:
        return Zygote({**env, "PYTHONHOME": str(tmp_path / "nowhere")}, run_dir / "zygote.log", ready_timeout_s=60)

    monkeypatch.setattr(launcher, "start_zygote", broken)
    version = [sys.executable, "-c", launcher.DAEMON_ENTRY, "--version"]
    with caplog.at_level("WARNING", logger="peer.fleet.launch"):
        daemons, zygote = launch([version, version], tmp_path, "fallback", allocator="glibc")
    assert zygote is None and "own commands" in caplog.text and "zygote.log" in caplog.text
    for d in daemons:
        assert d.proc.wait(60) == 0 and isinstance(d.proc.pid, int)
        assert "lpdl-peer, version" in d.log_path.read_text()
    assert os.path.exists(tmp_path / "zygote.log")
