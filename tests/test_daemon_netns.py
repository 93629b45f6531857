"""Real daemons on a namespace LAN (tests/netns.py): mDNS discovery, a late joiner that pulls the model and catches
up, a link cut / heal between two hosts while the fleet keeps training, and a peer killed without a goodbye
leaving the survivors' live sets while its mDNS record lives on.

Every daemon runs ``lpdl-peer start --neighbors auto --mdns-ip <host ip> --listen <host ip>:7070`` inside its own
namespace (its own eth0 on a shared bridge), the way deploy/netns-testbed.sh runs a fleet. The control socket lives
in the (shared) filesystem, so status is read from the test process.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.daemon_helpers import (
    Daemon,
    fleet_ca,
    kill_all,
    neighbour_states,
    start_daemon,
    stop_all,
)
from tests.netns import NetnsTestbed, netns_available

_OK, _WHY = netns_available()
pytestmark = [pytest.mark.slow, pytest.mark.netns, pytest.mark.skipif(not _OK, reason=_WHY)]

PORT = 7070
FLAGS = ["--model", "mnist-cnn", "--precision", "fp32", "--dataset", "mnist5k", "--lr", "0.05",
         "--algorithm", "choco", "--compression", "0.9"]
UP = ("active", "busy")
EXPIRY_S = 45.0


def peer(tb: NetnsTestbed, tmp_path: Path, i: int, n_shards: int = 3) -> Daemon:
    return start_daemon(tmp_path / f"h{i}", f"h{i}", PORT, host=tb.ip(i), neighbors="auto", mdns_ip=tb.ip(i),
                        run_flags=FLAGS, max_rounds=5000, eval_every=10, checkpoint_every=50,
                        extra=["--shard", f"{i}/{n_shards}"], wrap=lambda argv, i=i: tb.argv(i, argv),
                        tls_ca=fleet_ca(tmp_path, "netns-test"),  # secured, like deploy/netns-testbed.sh
                        env={"LPDL_NET_ACK_TIMEOUT_S": "5.0",  # a cut link shows within ~5 s
                             # a peer silent for 45 s leaves the live set (default 60 s), checked every 2 s
                             "LPDL_NET_PEER_EXPIRY_S": str(EXPIRY_S), "LPDL_NET_LIVENESS_INTERVAL_S": "2.0"})


def last_acc(d: Daemon) -> tuple[int, float]:
    accs = d.test_accuracies()
    assert accs, d.fail("no evaluation logged yet")
    return accs[-1]


def test_mdns_fleet_join_and_link_cut(tmp_path: Path) -> None:
    fleet: list[Daemon] = []
    with NetnsTestbed(n_hosts=3, prefix="lpdt", subnet="10.214.7") as tb:
        try:
            fleet += [peer(tb, tmp_path, 0), peer(tb, tmp_path, 1)]
            d0, d1 = fleet
            # 1. two peers find each other by mDNS and gossip
            for d, other in ((d0, "h1"), (d1, "h0")):
                s = d.wait_status(lambda st, other=other: neighbour_states(st).get(other) in UP
                                  and st["neighbours"][other]["bytes_sent"] > 0, 120,
                                  f"{other} discovered and gossiped to")
                assert s["neighbours"][other]["address"] == f"{tb.ip(int(other[1]))}:{PORT}"
                assert s["fleet"] == "netns-test"
                assert "discovery: found peer " + other in d.log_text()
            r0 = d0.status()["round"]
            d0.wait_round(max(30, r0 + 10), 120)
            d1.wait_status(lambda st: st["applied"] > 5, 60, "applied messages from h0")

            # 2. a third peer starts later on host 2: pulls the model, is discovered by both, gossips with both
            fleet.append(peer(tb, tmp_path, 2))
            d2 = fleet[2]
            m = d2.wait_log(r"joined: pulled the model of (h[01]) \((\d+) bytes\)", 90)
            assert int(m.group(2)) > 1_000_000  # the whole fp32 model (421,834 parameters)
            for d in (d0, d1):
                d.wait_status(lambda st: neighbour_states(st).get("h2") in UP, 90, "h2 discovered")
            d2.wait_status(lambda st: all(neighbour_states(st).get(p) in UP for p in ("h0", "h1")), 60,
                           "h2 gossiping with h0 and h1")

            # 3. (while the joiner catches up) cut the link h0 <-> h1: that edge leaves the active state, training
            # goes on over h2; heal restores it
            tb.cut(0, 1)
            cut_round = d0.status()["round"]
            for d, other in ((d0, "h1"), (d1, "h0")):
                s = d.wait_status(lambda st, other=other: neighbour_states(st).get(other) not in UP, 60,
                                  f"edge to {other} not active after the cut")
                assert s["neighbours"][other]["state"] in ("connecting", "down"), s["neighbours"][other]
            s = d0.wait_round(cut_round + 10, 90)  # training continues during the cut
            assert neighbour_states(s).get("h2") in UP  # the uncut links keep working
            sent_before = s["neighbours"]["h1"]["bytes_sent"]
            tb.heal(0, 1)
            for d, other in ((d0, "h1"), (d1, "h0")):
                d.wait_status(lambda st, other=other: neighbour_states(st).get(other) in UP, 60,
                              f"edge to {other} active again after heal")
            d0.wait_status(lambda st: st["neighbours"]["h1"]["bytes_sent"] > sent_before, 30,
                           "bytes flowing to h1 again")

            # 4. the joiner caught up: after 30 rounds its accuracy is close to the others' (far above chance)
            first_eval = d2.wait_log(r"round (\d+) epoch [\d.]+: train loss \S+, test acc ([\d.]+)%", 90)
            assert float(first_eval.group(2)) > 50.0, first_eval.group(0)  # pulled model: no start from scratch
            d2.wait_status(lambda st: bool(st["eval"]) and st["eval"]["round"] >= 30, 120, "evaluated at round 30")
            _, acc2 = last_acc(d2)
            accs = [last_acc(d)[1] for d in (d0, d1)]
            print(f"accuracy: h0 {accs[0]:.3f} h1 {accs[1]:.3f}, joiner h2 {acc2:.3f}")
            assert acc2 > 0.5
            assert abs(acc2 - sum(accs) / 2) < 0.10, (acc2, accs)

            # 5. h2 dies without a goodbye (SIGKILL): its mDNS record outlives it (zeroconf's TTL: 75 min), the
            # liveness checks take it out of both survivors' live sets within peer_expiry_s, and the ring closes
            # over the survivors: h1's updates, which went to h2, reach h0 again
            d2.kill()
            killed = time.monotonic()
            for d in (d0, d1):
                d.wait_status(lambda st: not st["neighbours"].get("h2", {}).get("live", False), EXPIRY_S + 30,
                              "h2 out of the live set after SIGKILL (listed as not live, or forgotten)")
                assert "peer h2 at " in d.log_text() and "it leaves the live set" in d.log_text()
            print(f"h2 out of both live sets {time.monotonic() - killed:.1f} s after SIGKILL")
            received = d0.status()["neighbours"]["h1"]["bytes_received"]
            d0.wait_status(lambda st: st["neighbours"]["h1"]["bytes_received"] > received, 60,
                           "h0 receiving from h1 after h2 left the ring")

            survivors = [d0, d1]
            codes = stop_all(survivors)
            assert codes == [0, 0], [d.fail(f"rc {c}").args[0] for d, c in zip(survivors, codes) if c != 0]
            for d in survivors:
                state = d.checkpoint()
                assert state["peer_id"] == d.peer_id and state["engine"]["w"] > 0
        finally:
            kill_all(fleet)
            time.sleep(0.2)
