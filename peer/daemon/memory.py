"""The daemon's memory and start-up: where its resident set and its start-up seconds go, stage by stage, and the
allocator settings that keep the memory small.

A daemon's RSS is mostly torch's (its import alone is ~500 MiB with the x86 wheel); what the daemon adds on top is
what an operator of a 2 GB device can act on. ``MemoryStages`` records the RSS after each start-up stage, so the
status document (and ``bench/fleet.py``) shows the breakdown; it also records how many seconds each stage took
(``imports`` from the process's start), since a fleet's first round waits for the slowest daemon's start:

    imports      torch + the daemon's modules (gRPC, zeroconf), before any tensor exists
    dataset      the bundled dataset in memory (uint8 images, both splits)
    model        the model and the 8-bit start-up probe
    peer         the training copy, optimizer state, data loader
    network      gRPC server, client channels, mDNS
    training     after the first rounds: activations, gradients, gossip buffers, replicas, allocator caches

Tuning: the biggest lever is the allocator itself (peer/daemon/allocator.py: tcmalloc where installed). Under
glibc, every thread that allocates gets its own malloc arena (up to 8 x cores), and torch's intra-op pool, gRPC's
pollers and the executor threads each keep freed memory in theirs: ``limit_malloc_arenas`` caps the count before
those threads exist. ``peer.heap.trim_heap`` hands freed pages back after the start-up transients (probe, dataset
decode) and after each evaluation, with whichever allocator runs.

Linux only for the figures (``/proc/self/status``); elsewhere they read 0.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from peer.daemon.allocator import in_use as allocator_in_use
from peer.heap import libc

log = logging.getLogger(__name__)

#: mallopt parameter number of M_ARENA_MAX in glibc's malloc.h.
_M_ARENA_MAX = -8
#: Default malloc arena cap: one for the main thread, one shared by all others: fewer arenas cut training RSS at
#: the same round time (docs/decisions/allocator.md#malloc-arenas).
DEFAULT_MALLOC_ARENAS = 2


def _proc_status_kib(field: str, status: Path = Path("/proc/self/status")) -> int:
    try:
        for line in status.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def rss_mib() -> float:
    """Resident set size now (MiB)."""
    return _proc_status_kib("VmRSS") / 1024


def peak_rss_mib() -> float:
    """Highest resident set size of this process so far (MiB; VmHWM)."""
    return _proc_status_kib("VmHWM") / 1024


def _boot_clock_s() -> float:
    """Seconds since boot (CLOCK_BOOTTIME where the platform has it): the clock /proc/<pid>/stat's start time uses."""
    clock = getattr(time, "CLOCK_BOOTTIME", None)
    return time.clock_gettime(clock) if clock is not None else time.monotonic()


def process_start_s(stat: Path = Path("/proc/self/stat")) -> float | None:
    """When this process started, in :func:`_boot_clock_s` seconds (None where /proc is not there)."""
    try:
        # the command name (field 2) may hold spaces and parentheses: the fields after it follow the last ')'
        fields = stat.read_text().rpartition(")")[2].split()
        return int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of proc(5): start time in clock ticks
    except (OSError, ValueError, IndexError):
        return None


def limit_malloc_arenas(arenas: int = DEFAULT_MALLOC_ARENAS) -> bool:
    """Cap glibc's malloc arenas (call before torch / gRPC start their threads); True where it took effect."""
    lib = libc()
    if lib is None or arenas <= 0:
        return False
    return bool(lib.mallopt(_M_ARENA_MAX, arenas))


class MemoryStages:
    """RSS after each named start-up stage (MiB) and the seconds each took, plus the live RSS and the peak when
    read."""

    def __init__(self) -> None:
        self._marks: dict[str, tuple[float, float]] = {}  # stage -> (RSS MiB, boot clock s) at its end
        self._started_s = process_start_s()
        self.allocator = allocator_in_use()  # fixed for the life of the process

    def mark(self, stage: str) -> None:
        """Record the RSS and the clock now as the end of ``stage`` (a later mark of the same stage replaces it)."""
        self._marks[stage] = (rss_mib(), _boot_clock_s())

    def snapshot(self) -> dict[str, object]:
        """``{rss_mib, peak_mib, after {stage: MiB}, added {stage: MiB over the previous stage}, seconds {stage:
        seconds since the previous stage ended (the first: since the process started)}, allocator}``."""
        marks = dict(list(self._marks.items()))  # copied at once: the training thread may mark a stage meanwhile
        after = {stage: rss for stage, (rss, _) in marks.items()}
        added: dict[str, float] = {}
        seconds: dict[str, float] = {}
        previous_rss, previous_s = 0.0, self._started_s
        for stage, (rss, at) in marks.items():
            added[stage] = rss - previous_rss
            if previous_s is not None:
                seconds[stage] = max(0.0, at - previous_s)
            previous_rss, previous_s = rss, at
        return {"rss_mib": rss_mib(), "peak_mib": peak_rss_mib(), "after": after, "added": added,
                "seconds": seconds, "allocator": self.allocator}
