"""What `lpdl-peer fleet` hands its daemons: quantization passes from the host's ahead-of-time store, filled in the
background, unless the user said otherwise (N daemons on one machine must not each compile the same kernels)."""

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
