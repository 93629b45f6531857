"""Per-source connection limits (issue 23, deliverable 5): systemd/lpdl-peer-limits.nft, loaded as shipped into a
testbed host that runs a real daemon (mutual TLS, port 7070), caps what one outsider address holds at once and how
fast it opens connections, while a device of the fleet on another address still connects and gossips. Real nft
rules with connection tracking in network namespaces; the outsider is plain TCP that never speaks
(tests/conn_flood.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.fault_fleet import PORT, FaultFleet, run_spec
from tests.netns import NetnsTestbed, netns_available

_OK, _WHY = netns_available()
pytestmark = [pytest.mark.slow, pytest.mark.netns, pytest.mark.skipif(not _OK, reason=_WHY),
              pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[1]
LIMITS = REPO / "systemd" / "lpdl-peer-limits.nft"
#: The file's limits (nft takes them as literals): connections one address may hold, new ones it may open in a burst.
PER_SOURCE, BURST = 32, 40
#: More than the daemon's connection slots (net.max_connections 256).
FLOOD = 300
SPEC = run_spec(model={"name": "mnist-cnn", "precision": "fp32"}, data={"dataset": "mnist5k", "batch_size": 16},
                gossip={"algorithm": "sgp", "compression": 0.0, "bits": 32})
DEVICE, OUTSIDER, JOINER = 0, 1, 2


def flood(tb: NetnsTestbed, host: int, *args: object) -> dict[str, int]:
    """Run tests/conn_flood.py inside ``host`` against the device's port; its JSON result."""
    done = tb.run(host, [sys.executable, "-m", "tests.conn_flood", tb.ip(DEVICE), PORT, *args], timeout=120,
                  cwd=str(REPO))
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def counter(tb: NetnsTestbed, name: str) -> int:
    """Packets the shipped table's named counter has refused in the device's host."""
    shown = tb.run(DEVICE, ["nft", "-j", "list", "counter", "inet", "lpdl_peer_limits", name])
    assert shown.returncode == 0, shown.stderr
    return next(item["counter"]["packets"] for item in json.loads(shown.stdout)["nftables"] if "counter" in item)


def test_one_address_holds_at_most_its_share_and_a_device_still_gets_in(tmp_path: Path) -> None:
    with NetnsTestbed(n_hosts=3, prefix="lpcl", subnet="10.214.21") as tb:
        loaded = tb.run(DEVICE, ["nft", "-f", str(LIMITS)])
        assert loaded.returncode == 0, loaded.stderr
        fleet = FaultFleet(tb, tmp_path, SPEC, node_args=["--eval-every", "1000000"],
                           join_wait_s={DEVICE: 0.0, JOINER: 0.0})
        try:
            fleet.start([DEVICE])
            fleet.wait(lambda docs: docs[DEVICE] is not None, [DEVICE], 180, "the device serving")
            # an outsider keeps reopening 300 idle connections for 8 s (the daemon closes each at its 2 s TLS deadline)
            held = flood(tb, OUTSIDER, "hold", FLOOD, 8.0)
            print(f"outsider holding {FLOOD}: {held}")
            assert 0 < held["most_open"] <= PER_SOURCE, held
            assert counter(tb, "held_over") > 0
            # a device of the fleet on another address joins while the outsider floods again, and gossips
            outsider = tb.popen(OUTSIDER, [sys.executable, "-m", "tests.conn_flood", tb.ip(DEVICE), PORT, "hold",
                                           FLOOD, 60.0], cwd=str(REPO))
            fleet.start([JOINER])
            fleet.wait_full_mesh([DEVICE, JOINER], 180, "gossiping on both edges during the flood")
            outsider.kill()
            # reconnecting faster than the rate: beyond the burst, refused
            spun = flood(tb, OUTSIDER, "churn", 3 * BURST)
            print(f"outsider opening {3 * BURST} back to back: {spun}")
            assert spun["refused"] >= BURST // 2, spun
            assert counter(tb, "opening_over") > 0
        finally:
            fleet.close()
