"""``lpdl-peer --help``, every ``<cmd> --help`` and ``status`` start without torch, grpc or zeroconf.

Each case runs the CLI in a fresh interpreter and reads back which of those modules got imported, so a module-level
``import torch`` (direct or through a helper) in any command module fails here. Timings are measured, not asserted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from peer.cli.main import COMMANDS

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "grpc", "zeroconf")
#: Runs the CLI on argv[1:], then reports (last stderr line) the exit code, the heavy modules loaded and the gRPC
#: core threshold the CLI set.
PROBE = f"""
import json, os, sys
from peer.cli.main import cli
code = 0
try:
    cli(sys.argv[1:], prog_name="lpdl-peer")
except SystemExit as exc:
    code = exc.code
sys.stdout.flush()
loaded = sorted(m for m in {HEAVY!r} if m in sys.modules)
sys.stderr.write("\\n" + json.dumps({{"code": code, "loaded": loaded, "grpc_verbosity": os.environ.get("GRPC_VERBOSITY")}}))
"""


def run_cli(*args: str) -> tuple[dict, subprocess.CompletedProcess]:
    """Run the CLI in a fresh interpreter (no GRPC_VERBOSITY inherited); return the probe's report and the process."""
    env = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    proc = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, timeout=120,
                          env=env, check=False)
    report = json.loads(proc.stderr.strip().splitlines()[-1])
    return report, proc


HELP_CASES = [
    pytest.param([], id="lpdl-peer"),
    *(pytest.param([name], id=name) for name in COMMANDS),
]


@pytest.mark.parametrize("command", HELP_CASES)
def test_help_imports_no_torch_grpc_or_zeroconf(command: list[str]) -> None:
    report, proc = run_cli(*command, "--help")
    assert report["code"] == 0, proc.stderr
    assert "Usage: lpdl-peer" in proc.stdout
    assert report["loaded"] == [], f"{' '.join(['lpdl-peer', *command, '--help'])} imported {report['loaded']}"


def test_top_level_help_lists_every_command() -> None:
    _, proc = run_cli("--help")
    listed = [line.split()[0] for line in proc.stdout.split("Commands:")[1].splitlines() if line.strip()]
    assert listed == sorted(COMMANDS)


def test_status_without_daemon_is_light_one_line_and_quiets_grpc(tmp_path: Path) -> None:
    report, proc = run_cli("status", "--state-dir", str(tmp_path))
    assert report["code"] == 1
    assert report["loaded"] == []
    message = [line for line in proc.stderr.splitlines()[:-1] if line]
    assert message == [f"Error: no peer answering at {tmp_path / 'control.sock'}: No such file or directory"]
    assert report["grpc_verbosity"] == "ERROR"  # set by the group callback, before any command could import grpc
