"""Deliberate breakages of the pure stream classes (peer/net/inbound.py, outbound.py): each is applied to a copy of
this checkout (in a temporary directory), the stream contract suite runs there, and the tests that fail are listed
per transport - a breakage the suite catches on one transport only would mean the transports diverge.

Usage: python scripts/stream_breakages.py [name-fragment ...]   (run with the interpreter that runs the tests)
"""

from __future__ import annotations

import collections
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRANSPORTS = ("memory", "grpc-tls", "grpc")  # prefixes of the test ids, longest first
#: name -> (file, text, its broken replacement)
BREAKAGES = {
    "seq_order (inbound: no per-stream seq check)":
        ("peer/net/inbound.py", "if chunk.seq < next_seq:", "if chunk.seq < 0:"),
    "cumulative_ack (inbound: a batch acks its first update)":
        ("peer/net/inbound.py", "out.ack = checked[-1].seq", "out.ack = checked[0].seq"),
    "supersession (inbound: the old stream is not told)":
        ("peer/net/inbound.py", "            out.superseded = old\n", ""),
    "byte_budget (inbound: budget not enforced)":
        ("peer/net/inbound.py", "if not budget.take(len(data)):", "if not (budget.take(len(data)) or True):"),
    "deadline (inbound: no reassembly deadline)":
        ("peer/net/inbound.py", "        if self._reassembler.partial is None:\n            return None\n",
         "        return None\n"),
    "fence (inbound: the stream ignores the handshake's fence)":
        ("peer/net/inbound.py", "self._next_seq = max(hello.next_seq, reply.fence + 1)",
         "self._next_seq = hello.next_seq"),
    "handshake_settles (outbound: the HelloReply settles nothing)":
        ("peer/net/outbound.py",
         "settlement = self.gate.on_hello_reply(self.receiver_id, hello, wire.reply_from_pb(reply))",
         "settlement = Settlement()"),
    "ack_settles (outbound: an Ack settles one seq too few)":
        ("peer/net/outbound.py", "settlement = self.gate.on_ack(self.receiver_id, seq)",
         "settlement = self.gate.on_ack(self.receiver_id, seq - 1)"),
}


def run(name: str, path: str, old: str, new: str) -> None:
    tree = Path(tempfile.mkdtemp(prefix="stream-break-")) / "tree"
    try:
        shutil.copytree(ROOT, tree, ignore=shutil.ignore_patterns(".git", "__pycache__", "*.pyc", ".venv", "runs"))
        target = tree / path
        text = target.read_text()
        assert text.count(old) == 1, f"{name}: the text to break is not in {path} exactly once"
        target.write_text(text.replace(old, new))
        proc = subprocess.run([sys.executable, "-m", "pytest", "tests/test_stream_contract.py", "-q", "-p",
                               "no:cacheprovider", "-rf"], cwd=tree,
                              env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
                              timeout=900, check=False)
    finally:
        shutil.rmtree(tree.parent)
    failed = collections.defaultdict(set)
    for test, ident in re.findall(r"^FAILED tests/test_stream_contract.py::(\w+)\[(\S*)\]", proc.stdout, re.MULTILINE):
        kind = next(k for k in TRANSPORTS if ident.startswith(k))
        rest = ident[len(kind) + 1:]
        failed[kind].add(test + (f"[{rest}]" if rest else ""))
    print(f"== {name}: {proc.stdout.strip().splitlines()[-1]}")
    for kind in ("memory", "grpc", "grpc-tls"):
        print(f"   {kind}: {len(failed[kind])} failed: {sorted(failed[kind])}", flush=True)


def main() -> None:
    wanted = sys.argv[1:]
    for name, (path, old, new) in BREAKAGES.items():
        if not wanted or any(w in name for w in wanted):
            run(name, path, old, new)


if __name__ == "__main__":
    main()
