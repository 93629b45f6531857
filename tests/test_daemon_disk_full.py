"""A full state directory is a logged, retried, reported state - never an exit, never a loss of mass (issue 23).

Two real daemons (mutual TLS, static neighbours, lr = 0, Choco 90%); the second one's state directory is a small
tmpfs (root only: mount). Once the fleet gossips, the tmpfs is filled to the last byte: the victim's next checkpoint
fails, it pauses gossip, writes the paused state into its reserve's space, keeps training and says so in status.
Both are stopped and restarted while the disk is still full (the victim starts paused), then the disk is freed:
gossip resumes, and at the end sum x and sum w over the final checkpoints are exactly the initial ones.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from peer.cli.status import format_status
from peer.daemon.status import StatusDocument
from tests.daemon_helpers import Daemon, kill_all, static_fleet, stop_all
from tests.test_daemon_faults import assert_conserved, run_flags, seed_checkpoints, wait_gossiping

pytestmark = pytest.mark.slow

N = 2


def mount_tmpfs(where: Path, size_bytes: int) -> None:
    where.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(where)], check=True)


def fill(directory: Path) -> list[Path]:
    """Take every free byte of ``directory``'s file system (a big file, then 4 KiB writes until ENOSPC)."""
    st = os.statvfs(directory)
    big = directory / "filler-0"
    with big.open("wb") as fh:
        try:
            os.posix_fallocate(fh.fileno(), 0, max(st.f_bavail * st.f_frsize - (1 << 16), 1))
        except OSError:
            pass
    rest = directory / "filler-1"
    with rest.open("wb", buffering=0) as fh:
        try:
            while True:
                fh.write(b"\0" * 4096)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
    return [big, rest]


def move_state_dir(daemon: Daemon, to: Path) -> None:
    """Run ``daemon`` from ``to`` (its files copied there); its log stays where it was."""
    old = daemon.state_dir
    for item in old.iterdir():
        if item.name != "daemon.log":
            (shutil.copytree if item.is_dir() else shutil.copy2)(item, to / item.name)
    daemon.log_dir = old
    daemon.argv = [str(to) if a == str(old) else a for a in daemon.argv]
    daemon.state_dir = to


def storage(daemon: Daemon) -> dict:
    return daemon.status()["storage"]


def test_a_full_state_directory_pauses_gossip_keeps_training_and_keeps_mass_exact(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: mounts a small tmpfs as the state directory")
    if shutil.which("mount") is None:
        pytest.skip("needs mount(8)")
    flags = run_flags("choco", 0.9)
    fleet = static_fleet(tmp_path, N, flags, launch=False, max_rounds=5000, eval_every=1000, checkpoint_every=2)
    small = tmp_path / "small"
    mounted = False
    try:
        baseline = seed_checkpoints(fleet, flags)
        x_initial = sum(s["engine"]["x"].double() for s in baseline)
        victim = fleet[1]
        # room for a gossiping peer's checkpoint (its Choco replicas and in-flight payloads make it ~4x the solo
        # baseline's), the previous one, a write's temporary file and the reserve (2x)
        mount_tmpfs(small, 16 * victim.checkpoint_path.stat().st_size + (8 << 20))
        mounted = True
        move_state_dir(victim, small)

        for d in fleet:
            d.start()
        wait_gossiping(fleet, 4)
        filled_at = victim.status()["round"]
        fillers = fill(small)
        victim.wait_round(filled_at + 10, timeout_s=60)  # keeps running and training with the disk full
        s = victim.wait_status(lambda s: s["storage"]["paused_state_written"] is not None, 60,
                               "gossip paused and the paused state written")
        assert s["storage"]["state"] == "write_failing" and s["storage"]["errors"] >= 1, s["storage"]
        assert s["storage"]["paused_state_written"] is True, s["storage"]
        assert s["storage"]["gossip_paused"] and "No space left" in s["storage"]["last_error"], s["storage"]
        paused_round = s["round"]
        victim.wait_round(paused_round + 5, timeout_s=60)  # keeps training while the disk stays full
        assert storage(victim)["gossip_paused"] is not None
        assert "gossip paused" in victim.log_text()
        assert victim.running  # never an exit
        assert "STORAGE   gossip paused" in format_status(StatusDocument.from_json(victim.status()))

        codes = stop_all(fleet)
        assert codes == [0] * N, [d.fail(f"rc {c}") for d, c in zip(fleet, codes) if c != 0]
        assert_conserved([d.checkpoint() for d in fleet], x_initial, N)  # before any restart, too

        for d in fleet:  # restart with the disk still full: the victim starts paused
            d.start()
        for d in fleet:
            d.wait_ready()
        # paused by the start-up room check or, where the stop left room for it, by the first failed write
        victim.wait_status(lambda s: s["storage"]["gossip_paused"] is not None, 60, "gossip paused after the restart")
        for f in fillers:
            f.unlink()
        victim.wait_status(lambda s: s["storage"]["gossip_paused"] is None and s["storage"]["state"] == "ok",
                           60, "gossip resumed once the disk had room")
        wait_gossiping(fleet, 4)
        codes = stop_all(fleet)
        assert codes == [0] * N, [d.fail(f"rc {c}") for d, c in zip(fleet, codes) if c != 0]
        final = [d.checkpoint() for d in fleet]
    finally:
        kill_all(fleet)
        if mounted:
            subprocess.run(["umount", "-l", str(small)], check=False)

    assert_conserved(final, x_initial, N)
    assert all(torch.isfinite(s["engine"]["x"]).all() for s in final)
