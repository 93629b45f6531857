"""The gRPC classes stay I/O shells around the pure stream classes (docs/design.md#simulation): the stream
logic lives in net/inbound.py and net/outbound.py, so ``PeerServer`` and ``EdgeSender`` stay small. A class that
grows past the bound is the signal that protocol logic is creeping back between the awaits."""

import ast
from pathlib import Path

import pytest

PEER = Path(__file__).resolve().parent.parent / "peer"
MAX_SHELL_LINES = 250


@pytest.mark.parametrize("path, name", [("net/server.py", "PeerServer"), ("net/client.py", "EdgeSender")])
def test_the_grpc_shells_stay_small(path: str, name: str) -> None:
    tree = ast.parse((PEER / path).read_text())
    cls = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == name)
    lines = cls.end_lineno - cls.lineno + 1
    assert lines < MAX_SHELL_LINES, f"{name} ({path}) has {lines} lines: move stream logic into the pure classes"
