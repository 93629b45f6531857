"""The committed generated modules in peer/net/proto must equal a fresh run of scripts/gen_proto.sh."""

from __future__ import annotations

import filecmp
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = ROOT / "peer" / "net" / "proto"


def test_generated_modules_are_current(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    env = dict(os.environ, PYTHON=sys.executable)
    subprocess.run(["bash", str(ROOT / "scripts" / "gen_proto.sh"), str(tmp_path)], check=True, env=env,
                   capture_output=True, text=True)
    fresh = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    committed = sorted(p.relative_to(COMMITTED) for p in COMMITTED.rglob("*")
                       if p.is_file() and "__pycache__" not in p.parts)
    assert fresh == committed, "generated file set differs: run scripts/gen_proto.sh"
    stale = [str(p) for p in fresh if not filecmp.cmp(tmp_path / p, COMMITTED / p, shallow=False)]
    assert not stale, f"stale generated modules {stale}: run scripts/gen_proto.sh and commit"


def test_grpc_module_imports_package_qualified() -> None:
    text = (COMMITTED / "lpdl" / "v1" / "peer_pb2_grpc.py").read_text()
    assert "from peer.net.proto.lpdl.v1 import peer_pb2" in text
