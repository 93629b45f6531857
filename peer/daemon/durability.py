"""Checkpoints on a state directory that can fill up: a logged, retried, reported state, never an exit and never a
loss of push-sum mass (docs/design.md#checkpoints).

Why mass is at stake: a peer's mass moves every round (sent, applied, acknowledged). If the checkpoint on disk is
older than the peer's state when it stops, the restarted peer resumes from that older state and the fleet loses or
double-counts what moved in between (measured on main: a full state directory ended the daemon, and each restart lost
or duplicated the peer's mass). So a peer that cannot persist its state must stop moving mass until it can:

1. A reserve file (``checkpoint.reserve``, twice the size of the last checkpoint, at least 1 MiB) holds space for
   the one checkpoint that matters.
2. When a checkpoint write fails (ENOSPC, EIO, a read-only remount), the daemon pauses gossip first - no message
   sent, none applied, so the peer's mass stays where it is - then :meth:`CheckpointKeeper.rescue` frees the reserve
   (or, without one, the previous checkpoint) and writes the paused state. From then on the file on disk is the
   peer's mass exactly, however long the disk stays full and however the daemon stops.
3. Training goes on; every later checkpoint is retried (each round) and, once one is written AND the reserve is
   back, gossip resumes. The status document says all of it (:meth:`CheckpointKeeper.snapshot`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from peer.daemon.status import StorageStatus

log = logging.getLogger(__name__)

RESERVE_NAME = "checkpoint.reserve"
#: The reserve holds this many times the last checkpoint's size (a checkpoint's in-flight records vary in size).
RESERVE_FACTOR = 2
#: Smallest reserve (bytes).
MIN_RESERVE_BYTES = 1 << 20
#: While writes keep failing (retried every round), one log line per this many seconds.
FAILURE_LOG_EVERY_S = 60.0


class CheckpointKeeper:
    """Writes a daemon's checkpoints and keeps the space and the state it needs to write the one that matters.

    Args:
        checkpoint: the checkpoint file (its size sets the reserve's).
        previous: the previous checkpoint kept beside it (given up before the newest state is lost).
        write: writes a checkpoint of the peer's state now; raises OSError when the write fails.
        clock: wall-clock seconds (status shows when the trouble began).
    """

    def __init__(self, checkpoint: Path, previous: Path, write: Callable[[], object],
                 clock: Callable[[], float] = time.time) -> None:
        self.checkpoint = checkpoint
        self.previous = previous
        self.reserve = checkpoint.parent / RESERVE_NAME
        self._write = write
        self._clock = clock
        self.errors = 0                   # failed checkpoint writes so far
        self.last_error = ""
        self.failing_since: float | None = None  # wall clock of the first failure of the current spell
        self.rescued: bool | None = None  # this spell: the paused state was written (None: no rescue tried yet)
        self.constrained = False          # a write failed, or there is no room to go on: gossip must stay paused
        self._logged_at = -FAILURE_LOG_EVERY_S

    @property
    def healthy(self) -> bool:
        """The last write succeeded, the reserve is in place and the next write fits: gossip may move mass."""
        return not self.constrained

    def check_room(self) -> bool:
        """At start: make the reserve and check the next checkpoint fits beside it; returns :attr:`healthy`."""
        self.constrained = not self.room_to_go_on()
        return self.healthy

    def write(self) -> bool:
        """Write a checkpoint (worker thread); True when it was written. A failure is logged and counted; the
        caller pauses gossip and calls :meth:`rescue`."""
        try:
            self._write()
        except OSError as exc:
            self._failed(exc)
            return False
        if self.constrained and self.room_to_go_on():
            log.warning("checkpoint written and the reserve in place (%d write(s) failed before): the state directory "
                        "has room again", self.errors)
            self.failing_since, self.rescued, self.constrained = None, None, False
        elif not self.constrained:
            self.restore_reserve()
        return True

    def rescue(self) -> bool:
        """With gossip paused: free the reserve (else the previous checkpoint) and write the paused state, so the
        file on disk holds this peer's mass exactly. True when it was written."""
        for spare, what in ((self.reserve, "the reserve"), (self.previous, "the previous checkpoint")):
            if not spare.exists():
                continue
            spare.unlink()
            try:
                self._write()
            except OSError as exc:
                self._failed(exc)
                continue
            log.warning("checkpoint of the paused state written into the space of %s: the file on disk holds this "
                        "peer's mass exactly; gossip stays paused until the state directory has room", what)
            self.rescued = True
            return True
        self.rescued = False
        log.error("the paused state could not be written either (%s): mass this peer moved since its last "
                  "checkpoint is at risk if it stops before the state directory has room", self.last_error)
        return False

    def restore_reserve(self) -> bool:
        """Make sure the reserve exists and is large enough; False when there is no room for it (logged)."""
        try:
            want = max(MIN_RESERVE_BYTES, RESERVE_FACTOR * self.checkpoint.stat().st_size)
        except OSError:
            want = MIN_RESERVE_BYTES
        try:
            if self.reserve.exists() and self.reserve.stat().st_size >= want:
                return True
            fd = os.open(self.reserve, os.O_WRONLY | os.O_CREAT, 0o600)
            try:
                os.posix_fallocate(fd, 0, want)
            finally:
                os.close(fd)
            return True
        except OSError as exc:
            self.reserve.unlink(missing_ok=True)  # a partial reserve would pretend to hold space
            log.warning("no room for the checkpoint reserve %s (%d bytes): %s", self.reserve, want, exc)
            return False

    def room_to_go_on(self) -> bool:
        """The reserve is in place and the next checkpoint's temporary file fits beside it (else the space the
        reserve freed would only last one write, and gossip would pause and resume at every other checkpoint).
        Checked at start and, while paused, after each checkpoint written."""
        if not self.restore_reserve():
            return False
        try:
            st = os.statvfs(self.checkpoint.parent)
            need = RESERVE_FACTOR * self.checkpoint.stat().st_size if self.checkpoint.exists() else 0
        except OSError:
            return False
        return st.f_bavail * st.f_frsize >= need

    def _failed(self, exc: OSError) -> None:
        self.errors += 1
        self.last_error = str(exc)
        now = self._clock()
        self.constrained = True
        if self.failing_since is None:
            self.failing_since, self._logged_at = now, -FAILURE_LOG_EVERY_S
        if now - self._logged_at >= FAILURE_LOG_EVERY_S:
            self._logged_at = now
            log.error("checkpoint to %s failed (%s); retrying after every round (%d failed so far)",
                      self.checkpoint, exc, self.errors)

    def snapshot(self, gossip_paused: str | None) -> StorageStatus:
        """The ``storage`` section of the status document; ``gossip_paused`` is the daemon's reason, or None."""
        return StorageStatus(
            state="ok" if not self.constrained else "write_failing" if self.failing_since is not None else "no_room",
            gossip_paused=gossip_paused, errors=self.errors, last_error=self.last_error,
            failing_since=self.failing_since, reserve=self.reserve.exists(), paused_state_written=self.rescued)
