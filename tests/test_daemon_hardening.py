"""Daemon hardening (issue 10): checkpoint I/O errors are retried, never fatal; a torn write's temporary file is
removed at start; the previous checkpoint is kept and used when the newest is unreadable; unreadable checkpoints
end ``start`` with one clear line, not a traceback."""

from __future__ import annotations

import asyncio
import errno
import logging
from pathlib import Path

import pytest
from click.testing import CliRunner

from peer.cli.main import cli
from peer.daemon.paths import CHECKPOINT_NAME, PREVIOUS_CHECKPOINT_NAME
from peer.runtime import state
from tests.test_node_unit import make_node


def test_corrupt_newest_checkpoint_falls_back_to_the_previous_and_stale_temp_is_removed(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    node = make_node(tmp_path, max_rounds=5)  # checkpoints at round 3 and at shutdown (5)
    assert asyncio.run(node.run()) == 0
    assert state.load(tmp_path / PREVIOUS_CHECKPOINT_NAME)["round"] == 3
    (tmp_path / CHECKPOINT_NAME).write_bytes(b"torn by a power cut")
    stale = tmp_path / f".{CHECKPOINT_NAME}.x1y2.tmp"
    stale.write_bytes(b"half a checkpoint")
    restarted = make_node(tmp_path, max_rounds=7)
    with caplog.at_level(logging.INFO, logger="peer.daemon.node"):
        assert asyncio.run(restarted.run()) == 0
    messages = [r.getMessage() for r in caplog.records]
    assert any("unreadable" in m and "falling back" in m for m in messages)
    assert any(f"restored checkpoint {tmp_path / PREVIOUS_CHECKPOINT_NAME} (round 3" in m for m in messages)
    assert not stale.exists()
    assert state.load(tmp_path / CHECKPOINT_NAME)["round"] == 7


def test_unreadable_checkpoints_stop_start_with_one_clear_line(tmp_path: Path) -> None:
    for name in (CHECKPOINT_NAME, PREVIOUS_CHECKPOINT_NAME):
        (tmp_path / name).write_bytes(b"not a checkpoint")
    result = CliRunner().invoke(cli, ["start", "--state-dir", str(tmp_path), "--listen", "127.0.0.1:0", "--insecure",
                                      "--neighbors", "127.0.0.1:9", "--dataset", "synthetic", "--threads", "1"])
    assert result.exit_code == 1
    assert "unreadable" in result.output and "Traceback" not in result.output
    assert str(tmp_path / PREVIOUS_CHECKPOINT_NAME) in result.output


def test_checkpoint_io_errors_are_logged_and_retried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """EMFILE or a full disk at a checkpoint: logged, retried after the next round; the daemon keeps running."""
    real_save = state.save
    failures = []

    def flaky_save(*args, **kwargs):
        if len(failures) < 2:
            failures.append(1)
            raise OSError(errno.EMFILE, "Too many open files")
        return real_save(*args, **kwargs)

    monkeypatch.setattr(state, "save", flaky_save)
    node = make_node(tmp_path, max_rounds=5)  # checkpoint due at round 3: fails, fails again at 4, written at 5
    assert asyncio.run(node.run()) == 0
    assert node.checkpoint_errors == 2
    assert state.load(tmp_path / CHECKPOINT_NAME)["round"] == 5


def test_a_certificate_for_another_peer_id_stops_start(tmp_path: Path) -> None:
    """The certificate names the peer: a state directory that already belongs to another id refuses to start
    rather than silently changing identity."""
    from peer.security import ca

    ca.init_ca(tmp_path / "ca", "default")
    ca.issue(tmp_path / "ca", "kitchen-pi", tmp_path / "state" / "tls")
    (tmp_path / "state" / "peer_id").write_text("garage-pi\n")
    result = CliRunner().invoke(cli, ["start", "--state-dir", str(tmp_path / "state"), "--listen", "127.0.0.1:0",
                                      "--dataset", "synthetic"])
    assert result.exit_code == 1
    assert "'kitchen-pi'" in result.output and "'garage-pi'" in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("poison", ["nan_x", "zero_w", "huge_w"])
def test_a_poisoned_checkpoint_falls_back_to_the_previous_with_one_line(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, poison: str) -> None:
    """A checkpoint holding NaN x, w <= 0 or w = 1e300 (what an insider's update left on disk, issue 23) is refused
    like a torn one: the daemon restores the previous checkpoint and says so in one line, instead of crash-looping."""
    import torch
    node = make_node(tmp_path, max_rounds=5)  # checkpoints at round 3 (-> previous) and 5
    assert asyncio.run(node.run()) == 0
    newest = state.load(tmp_path / CHECKPOINT_NAME)
    if poison == "nan_x":
        newest["engine"]["x"][0] = float("nan")
    else:
        newest["engine"]["w"] = 0.0 if poison == "zero_w" else 1e300
    torch.save(newest, tmp_path / CHECKPOINT_NAME)
    restarted = make_node(tmp_path, max_rounds=6)
    with caplog.at_level(logging.INFO, logger="peer.daemon.node"):
        assert asyncio.run(restarted.run()) == 0
    fallbacks = [r.getMessage() for r in caplog.records if "falling back" in r.getMessage()]
    assert len(fallbacks) == 1, fallbacks
    assert str(tmp_path / CHECKPOINT_NAME) in fallbacks[0]
    assert ("non-finite" in fallbacks[0]) if poison == "nan_x" else ("push-sum weight" in fallbacks[0])
    assert any(f"restored checkpoint {tmp_path / PREVIOUS_CHECKPOINT_NAME} (round 3" in r.getMessage()
               for r in caplog.records)


def test_a_poisoned_model_is_never_written(tmp_path: Path) -> None:
    """A non-finite model in memory is not checkpointed: the file on disk stays the last sane one."""
    node = make_node(tmp_path, max_rounds=3)
    assert asyncio.run(node.run()) == 0
    before = (tmp_path / CHECKPOINT_NAME).read_bytes()
    node.peer.engine.x[:3] = float("inf")
    assert node._checkpoint() is False
    assert (tmp_path / CHECKPOINT_NAME).read_bytes() == before
    node.peer.engine.x[:3] = 0.0
    node.peer.engine.state.w = 1e300
    assert node._checkpoint() is False
    assert (tmp_path / CHECKPOINT_NAME).read_bytes() == before
