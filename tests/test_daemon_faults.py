"""Fleets of real daemons with lr = 0 under process faults: push-sum mass conservation across processes.

With lr = 0 training never moves x, so (docs/design.md#exactly-once-mass-transfer) ``sum_i x_i + unapplied in-flight
mass`` and ``sum_i w_i`` must stay at their initial values however the processes are stopped and restarted, and every
de-biased model z_i must converge to ``sum x / sum w``. Checked on the final checkpoints every daemon writes when
SIGTERMed.

Baseline: every peer first runs ONE round alone (its static neighbour is a dead port, --join-wait 0), so it writes a
checkpoint holding the seed model with w = 1 and never pulls a model at join time (a joiner that pulls a neighbour's
de-biased model adds that model's mass, which is by design but would make the initial total unknowable). The fleet
then starts from those checkpoints: initial sum x = sum of the baseline checkpoints' x (= n * z0, also checked against
peer.runtime.build.build_peer_model), initial sum w = n.

Restarts: a SIGTERM + restart is clean (the stopping peer settles its outbound edges and checkpoints what it has
applied), so conservation is exact. A kill -9 restart resumes from an older checkpoint; the edge reset of
docs/design.md#exactly-once-mass-transfer may then lose or duplicate mass by design, so that test asserts only that the
fleet keeps working and stays sane.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from peer.config import load_run_spec
from peer.data import load_dataset
from peer.runtime.build import build_peer_model
from tests.daemon_helpers import (
    Daemon,
    checkpoints_distance,
    fleet_totals,
    free_ports,
    kill_all,
    neighbour_states,
    start_daemon,
    static_fleet,
    stop_all,
    z_of,
)

pytestmark = pytest.mark.slow

N = 3


def run_flags(algorithm: str, compression: float, comm_bits: int = 8) -> list[str]:
    return ["--dataset", "mnist5k", "--precision", "fp32", "--lr", "0", "--algorithm", algorithm,
            "--compression", str(compression), "--comm-bits", str(comm_bits), "--batch-size", "16"]


def seed_checkpoints(fleet: list[Daemon], flags: list[str]) -> list[dict]:
    """Run every peer alone for one round (no neighbour reachable, no join): each writes a baseline checkpoint."""
    # all ports drawn at once: drawn one by one, a solo daemon's port could be the "dead" one (free a moment
    # before), and the others then found it listening there, joined it and gossiped (seen once in CI)
    dead, *ports = free_ports(len(fleet) + 1)
    solo = [start_daemon(d.state_dir, d.peer_id, port, neighbors=[f"127.0.0.1:{dead}"],
                         run_flags=flags, max_rounds=1, checkpoint_every=1, join_wait_s=0)
            for d, port in zip(fleet, ports)]
    try:
        for d in solo:
            assert d.wait_exit(120) == 0, d.fail("baseline run failed")
            assert "join: no neighbour to pull a model from" in d.log_text()
    finally:
        kill_all(solo)
    return [d.checkpoint() for d in fleet]


def initial_model(flags: list[str]) -> torch.Tensor:
    """z0 exactly as every daemon builds it (same spec, same seed)."""
    spec = load_run_spec(None, flags={"model": {"precision": "fp32"}, "data": {"dataset": "mnist5k"}})
    built = build_peer_model(spec.model, load_dataset("mnist5k"), torch.device("cpu"), seed=spec.data.seed)
    return torch.cat([p.detach().reshape(-1) for p in built.model.parameters()])


def wait_gossiping(fleet: list[Daemon], more_rounds: int, timeout_s: float = 150.0) -> None:
    """Every peer ``more_rounds`` rounds further than now (each at its own pace), with every other peer as an
    active/busy out-neighbour and gossip mass applied."""
    others = {d.peer_id: {o.peer_id for o in fleet if o is not d} for d in fleet}
    starts = {d.peer_id: d.wait_ready()["round"] for d in fleet}
    for d in fleet:
        target = starts[d.peer_id] + more_rounds
        d.wait_status(lambda s, d=d, target=target: s["round"] >= target and s["applied"] > 0 and all(
            neighbour_states(s).get(o) in ("active", "busy") for o in others[d.peer_id]),
            timeout_s, f"round >= {target}, gossiping with {sorted(others[d.peer_id])}")


def assert_conserved(states: list[dict], x_initial: torch.Tensor, n: int) -> None:
    totals = fleet_totals(states)
    assert totals.w == pytest.approx(n, abs=1e-6), f"sum w = {totals.w!r}, unsettled {totals.unsettled}"
    err = (totals.x - x_initial).abs()
    scale = x_initial.abs().max().item()
    print(f"conservation: |sum w - {n}| = {abs(totals.w - n):.2g}, max |sum x - initial| = {err.max().item():.2g} "
          f"(max |initial| {scale:.3g}), unsettled in flight: {totals.unsettled}")
    assert err.max().item() < 1e-4 * max(1.0, scale), (
        f"sum x drifted: max |error| {err.max().item():.3g} (mean {err.mean().item():.3g}), "
        f"in flight {totals.unsettled}")


@pytest.mark.parametrize("algorithm,compression,comm_bits,restarts", [
    ("choco", 0.9, 8, 2),  # compressed, error-feedback replicas: exact consensus in the limit
    ("sgp", 0.0, 32, 1),   # dense fp32 push-sum (8-bit SGP keeps a quantisation noise floor: no exact consensus)
])
def test_clean_restarts_conserve_mass_and_reach_consensus(tmp_path: Path, algorithm: str, compression: float,
                                                          comm_bits: int, restarts: int) -> None:
    flags = run_flags(algorithm, compression, comm_bits)
    fleet = static_fleet(tmp_path, N, flags, launch=False, max_rounds=2000, eval_every=1000, checkpoint_every=5)
    try:
        baseline = seed_checkpoints(fleet, flags)
        z0 = initial_model(flags)
        for s in baseline:
            assert s["round"] == 1 and s["engine"]["w"] == 1.0 and not any(e["in_flight"] for e in s["engine"]["out_edges"].values())
            assert torch.equal(s["engine"]["x"], z0), "lr = 0: one solo round must leave the seed model as it was"
        x_initial = sum(s["engine"]["x"].double() for s in baseline)

        for d in fleet:
            d.start()
        wait_gossiping(fleet, 8)
        # clean restarts of two peers, one after the other, while the rest keep gossiping
        for victim in (fleet[1], fleet[0])[:restarts]:
            r = victim.status()["round"]
            assert victim.stop() == 0, victim.fail("SIGTERM must exit 0")
            victim.start()
            s = victim.wait_ready()
            assert s["round"] >= r, "restarted peer must resume from its checkpoint round"
            assert "restored checkpoint" in victim.log_text().split("===== start #")[-1]
            assert "joined: pulled the model" not in victim.log_text()
            wait_gossiping(fleet, 5)
        mid = [d.checkpoint() for d in fleet]
        mid_distance = checkpoints_distance(mid)
        targets = [d.status()["round"] + 25 for d in fleet]  # 25 more rounds each (peers run at their own pace)
        for d, target in zip(fleet, targets):
            d.wait_round(target, timeout_s=150)
        codes = stop_all(fleet)
        assert codes == [0] * N, [d.fail(f"rc {c}") for d, c in zip(fleet, codes) if c != 0]
        final = [d.checkpoint() for d in fleet]
    finally:
        kill_all(fleet)

    assert_conserved(final, x_initial, N)
    for s in final:
        assert math.isfinite(s["engine"]["w"]) and s["engine"]["w"] > 0
    final_distance = checkpoints_distance(final)
    z_star = x_initial / N  # = sum x / sum w
    worst = max((z_of(s) - z_star).norm().item() for s in final)
    print(f"{algorithm}: consensus distance mid {mid_distance:.4g} -> final {final_distance:.4g}; "
          f"max ||z_i - z*|| {worst:.4g} (||z*|| {z_star.norm().item():.4g})")
    assert final_distance <= max(mid_distance * 0.5, 1e-3 * z_star.norm().item()), (mid_distance, final_distance)
    assert worst < 1e-4 * z_star.norm().item()  # measured ~3e-7 relative


def test_kill9_restart_keeps_fleet_working(tmp_path: Path) -> None:
    flags = run_flags("choco", 0.9)
    fleet = static_fleet(tmp_path, N, flags, max_rounds=2000, eval_every=1000, checkpoint_every=1)
    try:
        wait_gossiping(fleet, 8)
        victim = fleet[2]
        applied_before = {d.peer_id: d.status()["applied"] for d in fleet}
        victim.kill()  # SIGKILL: no settling, no final checkpoint
        assert victim.proc is not None and victim.proc.returncode == -9
        # the survivors notice: their edge to the victim leaves the active state, and they keep training
        survivors = [d for d in fleet if d is not victim]
        for d in survivors:
            r = d.status()["round"]
            d.wait_status(lambda s, r=r: s["round"] >= r + 3 and neighbour_states(s).get(victim.peer_id)
                          in ("connecting", "down"), 60, "edge to the killed peer down, rounds advancing")
        victim.start()
        s = victim.wait_ready()
        assert "restored checkpoint" in victim.log_text().split("===== start #")[-1]
        assert s["round"] > 0
        wait_gossiping(fleet, 10)
        # everyone applied new messages after the crash (edges re-established, reset if in doubt)
        for d in survivors:
            d.wait_status(lambda st, d=d: st["applied"] > applied_before[d.peer_id], 30, "applied more messages")
        targets = [d.status()["round"] + 10 for d in fleet]
        for d, target in zip(fleet, targets):
            d.wait_round(target, timeout_s=120)
        codes = stop_all(fleet)
        assert codes == [0] * N
        final = [d.checkpoint() for d in fleet]
    finally:
        kill_all(fleet)
    totals = fleet_totals(final)
    for st in final:
        assert math.isfinite(st["engine"]["w"]) and st["engine"]["w"] > 0, st["engine"]["w"]
        assert bool(torch.isfinite(st["engine"]["x"]).all())
    # by design a crash restart can lose or duplicate some mass, but not wreck the fleet
    assert 0.5 * N < totals.w < 1.5 * N, totals.w
    print(f"kill -9: sum w after the crash-restart = {totals.w:.6f} (exact would be {N})")
