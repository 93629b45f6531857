"""An 8-peer fleet in network namespaces under a scripted fault schedule (tests/fault_fleet.py): real daemons,
real zeroconf mDNS (``--neighbors auto``), real gRPC with mutual TLS, nft cuts, tc tbf caps, SIGKILL and SIGTERM.

lr = 0: push-sum mass is conserved exactly across every fault (docs/design.md#exactly-once-mass-transfer) and every
surviving model converges to the survivors' average. lr > 0: the averaged model's accuracy after the faults is within a
few points of a fault-free fleet trained for as many rounds. Timings are printed (bench/netns_fleet.py reports them,
with longer runs); nothing here asserts a time.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import torch

from peer.cli.status import format_status
from peer.daemon.status import StatusDocument
from peer.fleet.mass import fleet_totals, settled_mass
from peer.fleet.report import evaluate_checkpoints
from peer.runtime.state import engine_of
from tests.daemon_helpers import checkpoints_distance, stop_all, z_of
from tests.fault_fleet import (
    CRASHED,
    CUT,
    ISOLATED,
    LEAVER,
    FaultFleet,
    Measured,
    peer_id,
    run_schedule,
    run_spec,
    run_until,
    write_distinct_baselines,
)
from tests.netns import NetnsTestbed, netns_available

_OK, _WHY = netns_available()
pytestmark = [pytest.mark.slow, pytest.mark.netns, pytest.mark.skipif(not _OK, reason=_WHY),
              pytest.mark.timeout(900)]

#: h0..h7 start together, h8 joins late.
N_START, N_HOSTS = 8, 9
#: A cut or an isolated link shows within ~5 s (the default 30 s would outlast the schedule's 10 s faults).
NET_ENV = {"LPDL_NET_ACK_TIMEOUT_S": "5.0"}
#: Pure consensus with exact averaging: dense fp32 push-sum on the rotating exponential graph (mixes in ~3 rounds
#: on 8 peers; compressed Choco needs hundreds of rounds to wash out different initial models).
LR0 = run_spec(model={"name": "mnist-cnn", "precision": "fp32"}, data={"dataset": "mnist5k", "batch_size": 16},
               optim={"lr": 0.0},
               gossip={"algorithm": "sgp", "compression": 0.0, "bits": 32, "topology": "exponential",
                       "rotating": True})


def relative_consensus(fleet: FaultFleet, hosts: list[int]) -> float:
    """Consensus distance of the running peers' latest checkpoints (written every round), over ||z_bar||."""
    return relative_distance([fleet.daemons[i].checkpoint() for i in hosts])


def relative_distance(states: list[dict]) -> float:
    """Consensus distance of checkpoints' models over ||z_bar||."""
    z_bar = torch.stack([z_of(s) for s in states]).mean(dim=0)
    return checkpoints_distance(states) / float(z_bar.norm())


def settled_consensus(states: list[dict]) -> tuple[float, dict[str, float], torch.Tensor]:
    """How far the peers of ``states`` are from their common model once every message in flight between them is
    settled as the next handshake would settle it (:func:`settled_mass`): max ||z_i - z*|| / ||z*||, each peer's
    ||z_i - z*||, and z* = sum x / sum w over them. A message still in flight carries its sender's model of when it
    was sent; a consensus of the held models alone passes while such a message waits, and moves once it lands."""
    settled = settled_mass(states)
    z_star = sum(x for x, _ in settled.values()) / sum(w for _, w in settled.values())
    gaps = {p: (x / w - z_star).norm().item() for p, (x, w) in settled.items()}
    return max(gaps.values()) / z_star.norm().item(), gaps, z_star


def wait_consensus(fleet: FaultFleet, hosts: list[int], relative: float, timeout_s: float) -> float:
    """Until the running peers' latest checkpoints (written every round) are within ``relative`` of their
    :func:`settled_consensus`; returns it (the last value at the timeout)."""
    deadline = time.monotonic() + timeout_s
    while ((value := settled_consensus([fleet.daemons[i].checkpoint() for i in hosts])[0]) >= relative
           and time.monotonic() < deadline):
        time.sleep(1.0)
    return value


def handshake_settlements(fleet: FaultFleet) -> tuple[int, int]:
    """(delivered, retracted) in-flight updates that reconnect handshakes settled, over every daemon's whole log."""
    delivered = retracted = 0
    for d in fleet.daemons:
        for dv, rt in re.findall(r"handshake settled \d+ in-flight update\(s\): (\d+) delivered, (\d+) retracted",
                                 d.log_text()):
            delivered += int(dv)
            retracted += int(rt)
    return delivered, retracted


def settlement_report(checkpoints: list[dict], z_star: torch.Tensor) -> str:
    """Why a survivor's settled z left the consensus: per peer its round, ||z - z*|| / ||z*|| as checkpointed and
    once settled, and every message still in flight (sender -> receiver, seq, the sender's next seq, the
    receiver's last applied seq and fence, the weight it moved, its own z's distance from z*)."""
    norm = z_star.norm().item()
    engines = {s["peer_id"]: engine_of(s) for s in checkpoints}
    settled = settled_mass(checkpoints)
    lines = []
    for s in checkpoints:
        p, e = s["peer_id"], engines[s["peer_id"]]
        x, w = e.holdings()
        lines.append(f"{p} round {s['round']}: checkpointed {(x / w - z_star).norm().item() / norm:.3g}, "
                     f"settled {(settled[p][0] / settled[p][1] - z_star).norm().item() / norm:.3g}")
        for receiver, edge in e.out_edges.items():
            other = engines.get(receiver)
            inbound = None if other is None else (other.in_edges.get(p) or other.departed_in.get(p))
            for seq, sent in edge.in_flight.items():
                mass = torch.zeros_like(e.state.x)
                e.algorithm.mass_into(receiver, sent, mass, 1.0)
                z_sent = mass.double() / sent.weight if sent.weight else mass.double()
                lines.append(f"  in flight -> {receiver} seq {seq} (next {edge.next_seq}; receiver applied "
                             f"{None if inbound is None else inbound.last_applied}, fence "
                             f"{None if inbound is None else inbound.fence}) weight {sent.weight:.4g}, "
                             f"its z off by {(z_sent - z_star).norm().item() / norm:.3g}")
    return "\n".join(lines)


def test_lr0_fault_schedule_conserves_mass_and_reaches_consensus(tmp_path: Path) -> None:
    m = Measured()
    with NetnsTestbed(n_hosts=N_HOSTS, prefix="lpft", subnet="10.214.11") as tb:
        fleet = FaultFleet(tb, tmp_path, LR0, env=NET_ENV, node_args=["--checkpoint-every", "1",
                                                                      "--eval-every", "1000000"])
        try:
            initial = write_distinct_baselines(fleet)
            initial_distance = relative_distance(initial[:N_START])
            fleet.start(range(N_START))
            fleet.wait_discovery(list(range(N_START)), 240, m)
            fleet.wait_full_mesh(list(range(N_START)), 120, "gossiping on every edge")
            start_distance = relative_consensus(fleet, list(range(N_START)))
            run_schedule(fleet, m, quiescent_crash=True)
            survivors = fleet.running()
            assert sorted(survivors) == [i for i in range(N_HOSTS) if i != LEAVER]
            end_distance = wait_consensus(fleet, survivors, 1e-6, 120)
            views = {i: format_status(StatusDocument.from_json(d)) for i, d in fleet.statuses(survivors).items()
                     if d is not None}
            codes = stop_all([fleet.daemons[i] for i in survivors])
            assert codes == [0] * len(survivors), codes
            assert fleet.daemons[LEAVER].exit_codes == [0], fleet.daemons[LEAVER].exit_codes
            final = [d.checkpoint() for d in fleet.daemons]
            handshakes = handshake_settlements(fleet)
            logs = {i: fleet.daemons[i].log_text() for i in survivors}
        finally:
            fleet.close()
    print(f"measured: {m.as_dict()}")
    print(f"consensus distance (relative): {initial_distance:.3g} of the baselines, {start_distance:.3g} before the "
          f"faults, {end_distance:.3g} at the end")
    print(f"in-flight updates settled by handshakes: {handshakes[0]} delivered, {handshakes[1]} retracted")
    # `lpdl-peer status` of every survivor (7 neighbours, real documents) fits 80 columns and names them all
    assert len(views) == len(survivors)
    for i, text in views.items():
        assert max(map(len, text.splitlines())) <= 80, text
        assert all(f"\n{peer_id(j)} " in text for j in survivors if j != i), text
    # every fault happened and was undone
    assert m.cut_recovery_s is not None and m.crash_restart_to_applied_s is not None, m.notes
    assert m.crash_restored_round and m.join_start_to_seen_by_all_s is not None, m.notes
    assert sum(handshakes) > 0, "no in-flight update was ever settled by a handshake: the faults tested nothing"

    # docs/design.md#exactly-once-mass-transfer with lr = 0: everything every peer ever held (the leaver's final
    # checkpoint included, and through the receivers' departed_in_edges whether its last updates were applied) plus what
    # is still in flight equals the initial mass of the nine first checkpoints (the late joiner's included)
    totals = fleet_totals(final)
    x0 = sum(s["engine"]["x"].double() for s in initial)
    w0 = float(sum(s["engine"]["w"] for s in initial))
    err = (totals.x - x0).abs().max().item()
    scale = x0.abs().max().item()
    print(f"conservation: |sum w - {w0:g}| = {abs(totals.w - w0):.3g}, max |sum x - initial| = {err:.3g} "
          f"(max |initial| {scale:.3g}); in flight at the end: {len(totals.unsettled)} update(s)")
    assert totals.w == pytest.approx(w0, abs=1e-6), (totals.w, totals.unsettled)
    assert err < 1e-5 * max(1.0, scale), err

    # consensus among the survivors: each z_i = x_i / w_i equals sum x / sum w over them, once the messages the
    # shutdown left on the wire are settled as the next handshake settles them (a message sent in the last round to
    # a receiver that had stopped moves the sender's z by its share until then)
    worst, gaps, z_star = settled_consensus([final[i] for i in range(N_HOSTS) if i != LEAVER])
    print(f"max ||z_i - z*|| / ||z*|| over the survivors: {worst:.3g}")
    print(settlement_report([final[i] for i in range(N_HOSTS) if i != LEAVER], z_star))
    for i in survivors:
        events = [line for line in logs[i].splitlines()
                  if re.search(r"retracted|routed around|sink|quarantin|forget|departed", line)]
        print(f"{peer_id(i)}: {len(events)} log line(s) on settling, routing, leaving", *events[-8:], sep="\n  ")
    assert worst < 1e-5, gaps
    # not trivial: the peers started from distinct models and were still far from agreeing when the faults began (the
    # distance then depends on how many rounds the full mesh took to form, which gossip spends mixing)
    assert initial_distance > 0.1, "the peers started from the same model: consensus would prove nothing"
    assert start_distance > 1e3 * worst, "the peers agreed before the faults: consensus would prove nothing"
    for host in (*CUT, ISOLATED, CRASHED, N_HOSTS - 1):  # every peer a fault touched is part of the consensus
        assert final[host]["round"] > 0


#: Training as the product trains (Choco 99%, directed ring, lr 0.05, batch 32) in fp32: on this kind of CPU the
#: int8 start-up (probe, compiled passes) of 9 daemons at once costs more than the test's whole fault schedule.
LR = run_spec(model={"name": "mnist-cnn", "precision": "fp32"}, data={"dataset": "mnist5k"}, optim={"epochs": 1000})
#: Rounds every peer trains before the faults (one epoch of a peer's 500 images at batch 32) and after them.
EPOCH_ROUNDS, AFTER_ROUNDS = 16, 8


def training_fleet(tb: NetnsTestbed, root: Path, n_original: int) -> FaultFleet:
    """Originals start together from the seed model (no join wait, as `lpdl-peer fleet` does); a late joiner pulls
    a neighbour's model (waiting up to 60 s for mDNS to show one: start-up is slow on a loaded machine) and trains
    on the shard of the peer that left."""
    late = {n_original: (LEAVER, n_original)} if tb.n_hosts > n_original else {}
    return FaultFleet(tb, root, LR, env=NET_ENV, node_args=["--checkpoint-every", "10", "--eval-every", "1000000"],
                      shards={i: (i, n_original) for i in range(n_original)} | late,
                      join_wait_s={i: 0.0 for i in range(n_original)} | {n_original: 60.0})


def test_lr_positive_accuracy_under_faults_stays_close_to_fault_free(tmp_path: Path) -> None:
    m = Measured()
    with NetnsTestbed(n_hosts=N_HOSTS, prefix="lpfl", subnet="10.214.12") as tb:
        fleet = training_fleet(tb, tmp_path / "faults", N_START)
        try:
            fleet.start(range(N_START))
            fleet.wait_full_mesh(list(range(N_START)), 240, "gossiping on every edge")
            run_until(fleet, range(N_START), EPOCH_ROUNDS, 120)
            run_schedule(fleet, m, quiescent_crash=False, hold_s=6.0)
            survivors = fleet.running()
            late = N_HOSTS - 1
            assert "joined: pulled the model of" in fleet.daemons[late].log_text()
            originals = [i for i in survivors if i != late]
            target = max(d["round"] for d in fleet.statuses(originals).values() if d is not None) + AFTER_ROUNDS
            run_until(fleet, originals, target, 180)
            codes = stop_all([fleet.daemons[i] for i in survivors])
            assert codes == [0] * len(survivors), codes
        finally:
            fleet.close()
    faulted = evaluate_checkpoints(LR, [fleet.daemons[i].state_dir for i in survivors])

    with NetnsTestbed(n_hosts=N_START, prefix="lpfl", subnet="10.214.13") as tb:
        free = training_fleet(tb, tmp_path / "free", N_START)
        try:
            free.start(range(N_START))
            free.wait_full_mesh(list(range(N_START)), 240, "gossiping on every edge")
            run_until(free, range(N_START), target, 300)
            assert stop_all(free.daemons) == [0] * N_START
        finally:
            free.close()
    baseline = evaluate_checkpoints(LR, [d.state_dir for d in free.daemons])
    print(f"measured: {m.as_dict()}")
    print(f"after {target} rounds: averaged model {faulted.averaged:.4f} with faults vs {baseline.averaged:.4f} "
          f"without; mean per peer {mean(faulted.per_peer):.4f} vs {mean(baseline.per_peer):.4f}; consensus "
          f"distance {faulted.consensus_distance:.4g} vs {baseline.consensus_distance:.4g}")
    assert m.crash_restart_to_applied_s is not None and m.cut_recovery_s is not None, m.notes
    assert baseline.averaged > 0.8, "the fault-free fleet did not learn: the comparison would say nothing"
    assert abs(faulted.averaged - baseline.averaged) <= 0.05
    assert abs(mean(faulted.per_peer) - mean(baseline.per_peer)) <= 0.05


def mean(values: list[float | None]) -> float:
    present = [v for v in values if v is not None]
    assert present, "no checkpoint evaluated"
    return sum(present) / len(present)
