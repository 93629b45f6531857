"""The attacker's gRPC modules for the hostile tests: generated from proto/ alone with grpc_tools.protoc into a
directory, imported as the top-level package ``lpdl.v1`` - nothing of the project's client, wire or security code
(protobuf's descriptor pool shares the message classes of the identical .proto file, nothing else)."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]


def generate(out: Path) -> SimpleNamespace:
    """Generate and import the modules; returns ``pb`` (messages), ``grpc`` (stubs, servicers) and ``stub``."""
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I", str(ROOT / "proto"), f"--python_out={out}",
                    f"--grpc_python_out={out}", str(ROOT / "proto" / "lpdl" / "v1" / "peer.proto")], check=True)
    sys.path.insert(0, str(out))
    try:
        pb = importlib.import_module("lpdl.v1.peer_pb2")
        services = importlib.import_module("lpdl.v1.peer_pb2_grpc")
    finally:
        sys.path.remove(str(out))
    return SimpleNamespace(pb=pb, grpc=services, stub=services.PeerStub)
