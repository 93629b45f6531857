"""A host-wide lock on one piece of shared on-disk work (a compiled graph, a kernel probe), so that N processes
starting together on one host do it once: the first takes the lock and does it, the others wait and then find its
result on disk.

A ``flock`` on a lock file: released by the kernel when its holder exits or dies, so a crashed holder never leaves
the others waiting. Where no lock file can be made (a read-only cache directory) or the wait runs past ``wait_s``
(a holder stuck), the caller goes on without the lock: the same work done twice at worst.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

#: Seconds between tries while another process holds the lock.
POLL_S = 0.05


@contextlib.contextmanager
def host_lock(path: Path, wait_s: float, what: str) -> Iterator[bool]:
    """Hold the lock file ``path`` (created with its directory if missing) around the work named ``what`` (for the
    log); yields whether the lock is held (False: no lock file could be made, or ``wait_s`` seconds passed)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        log.warning("host lock for %s unavailable (%s): going on without it", what, exc)
        yield False
        return
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held = True
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    log.warning("%s still locked by another process after %.0f s: doing it here too", what, wait_s)
                    held = False
                    break
                time.sleep(POLL_S)
        yield held
    finally:
        os.close(fd)  # releases the lock
