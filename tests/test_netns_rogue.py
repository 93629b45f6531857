"""A secured fleet of real daemons on a namespace LAN trains as before while a rogue host on the same bridge attacks
it (tests/rogue_host.py: its own gRPC client generated from proto/, fake mDNS records copying a real peer's TXT,
calls without or with a self-signed certificate, a connection flood).

Checks: every call of the rogue fails; no fake record becomes a neighbour, moves the real peer's address, or
removes it when withdrawn; the fleet keeps training (accuracy far above chance) and its push-sum weights still sum
to exactly the number of peers.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.daemon_helpers import (
    ROOT,
    Daemon,
    fleet_ca,
    fleet_totals,
    kill_all,
    neighbour_states,
    start_daemon,
    stop_all,
)
from tests.netns import NetnsTestbed, netns_available

_OK, _WHY = netns_available()
pytestmark = [pytest.mark.slow, pytest.mark.netns, pytest.mark.skipif(not _OK, reason=_WHY)]

PORT = 7070
FLEET = "rogue-test"
FLAGS = ["--model", "mnist-cnn", "--precision", "fp32", "--dataset", "mnist5k", "--lr", "0.05",
         "--algorithm", "choco", "--compression", "0.9"]
UP = ("active", "busy")
ROGUE = 2  # host index of the rogue


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def test_secured_fleet_trains_while_a_rogue_host_attacks(tmp_path: Path) -> None:
    proto_dir = tmp_path / "rogue_proto"
    proto_dir.mkdir()
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I", str(ROOT / "proto"), f"--python_out={proto_dir}",
                    f"--grpc_python_out={proto_dir}", str(ROOT / "proto" / "lpdl" / "v1" / "peer.proto")], check=True)
    ca_dir = fleet_ca(tmp_path, FLEET)
    fleet: list[Daemon] = []
    with NetnsTestbed(n_hosts=3, prefix="lprg", subnet="10.214.9") as tb:
        try:
            for i in (0, 1):
                fleet.append(start_daemon(tmp_path / f"h{i}", f"h{i}", PORT, host=tb.ip(i), neighbors="auto",
                                          mdns_ip=tb.ip(i), run_flags=FLAGS, max_rounds=5000, eval_every=10,
                                          checkpoint_every=50, extra=["--shard", f"{i}/2"], tls_ca=ca_dir,
                                          wrap=lambda argv, i=i: tb.argv(i, argv)))
            d0, d1 = fleet
            for d, other in ((d0, "h1"), (d1, "h0")):
                d.wait_status(lambda st, other=other: neighbour_states(st).get(other) in UP
                              and st["neighbours"][other]["bytes_sent"] > 0, 180, f"{other} found and gossiped to")
            rss_before = {d.peer_id: rss_mb(d.proc.pid) for d in fleet}
            rounds_before = d0.status()["round"]
            victims = ",".join(f"h{i}={tb.ip(i)}:{PORT}" for i in (1, 0))  # the rogue copies h1's record
            rogue = tb.run(ROGUE, [sys.executable, str(ROOT / "tests" / "rogue_host.py"), "--proto-dir",
                                   str(proto_dir), "--ip", tb.ip(ROGUE), "--victims", victims,
                                   "--ca", str(ca_dir / "ca.pem"), "--hold", "20", "--connections", "300"],
                           timeout=180)
            assert rogue.returncode == 0, rogue.stderr[-3000:]
            report = json.loads(rogue.stdout.strip().splitlines()[-1])
            rss_after = {d.peer_id: rss_mb(d.proc.pid) for d in fleet}
            print("rogue:", json.dumps(report))
            print("daemon RSS MB before/after the attacks:", rss_before, rss_after)

            # every call of the rogue failed
            for target in ("h0", "h1"):
                for how in ("no_cert", "self_signed"):
                    outcomes = report[f"{target}/{how}"]
                    assert "OK" not in outcomes.values(), (target, how, outcomes)
            assert report["copied_txt"]["fleet"] == FLEET  # it did copy a real record
            # the fake records never became neighbours; withdrawing them removed nobody
            for d, other, other_ip in ((d0, "h1", tb.ip(1)), (d1, "h0", tb.ip(0))):
                s = d.wait_status(lambda st: st["round"] > rounds_before + 10, 180, "training on")
                assert set(s["neighbours"]) == {other}, s["neighbours"]
                assert s["neighbours"][other]["address"] == f"{other_ip}:{PORT}"
                assert neighbour_states(s)[other] in UP
                assert "discovery: found peer ghost" not in d.log_text()
            assert "not admitted (name_mismatch)" in d0.log_text() or "not admitted (name_mismatch)" in \
                d1.log_text()
            assert any("ghost._lpdl._tcp.local. not admitted" in d.log_text() for d in fleet)
            # the fleet trained as before
            for d in fleet:
                d.wait_status(lambda st: bool(st["eval"]) and st["eval"]["round"] >= rounds_before + 20, 240,
                              "evaluated after the attacks")
                assert d.test_accuracies()[-1][1] > 0.5
            codes = stop_all(fleet)
            assert codes == [0, 0], [d.log_tail() for d in fleet]
            totals = fleet_totals([d.checkpoint() for d in fleet])
            assert totals.w == pytest.approx(2.0, abs=1e-6)  # no weight created, destroyed or drained
        finally:
            kill_all(fleet)
            time.sleep(0.2)
