"""Watch the fleet's daemons through their control sockets and draw the live table.

A cell shows '-' until its daemon has reported the value, then the last value reported: no placeholder ("?", nan)
stands in for a figure the fleet already knows.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from peer.daemon.control import read_control_socket
from peer.daemon.status import StatusDocument
from peer.fleet.history import History
from peer.fleet.launch import Daemon, log_tail

#: Live table columns: (header, width, right-aligned).
COLUMNS = (("peer", 18, False), ("phase", 9, False), ("round", 6, True), ("epoch", 6, True), ("loss", 7, True),
           ("acc", 6, True), ("w", 7, True), ("sent", 9, True), ("received", 9, True), ("nbrs", 5, True),
           ("ms/rnd", 7, True))


def read_peak_rss_kb(pid: int) -> int:
    """VmHWM (peak resident set, kB) of a live process from /proc; 0 if it is gone or /proc is missing."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


async def _poll_all(daemons: list[Daemon], timeout_s: float) -> list[StatusDocument | None]:
    async def one(d: Daemon) -> StatusDocument | None:
        if not d.running or not d.socket_path.exists():
            return None
        try:
            return StatusDocument.from_json(await read_control_socket(d.socket_path, timeout_s))
        except (OSError, asyncio.TimeoutError, ValueError):  # StatusFormatError is a ValueError
            return None  # starting, stopping, or too busy to answer this time

    return await asyncio.gather(*(one(d) for d in daemons))


def poll(daemons: list[Daemon], started: float, timeout_s: float) -> None:
    """Read every running daemon's status once (each waits up to ``timeout_s`` seconds) and record it."""
    snapshots = asyncio.run(_poll_all(daemons, timeout_s))
    now = time.monotonic()
    for d, snapshot in zip(daemons, snapshots):
        if snapshot is not None:
            d.seen.observe(snapshot, now, now - started)
        if d.running:  # a reaped pid may already belong to another process
            d.seen.peak_rss_kb = max(d.seen.peak_rss_kb, read_peak_rss_kb(d.proc.pid))


def _fmt_bytes(n: float) -> str:
    return f"{n / 1e6:.2f}MB" if n >= 1e5 else f"{n / 1e3:.1f}kB"


def _line(cells: list[str]) -> str:
    return " ".join(c.rjust(w) if right else c.ljust(w) for c, (_, w, right) in zip(cells, COLUMNS)).rstrip()


def table_row(d: Daemon) -> str:
    """One line of the live table for a daemon ('-' in every cell it has not reported yet)."""
    s = d.seen.status
    code = d.proc.poll()
    phase = (s.phase.value if s is not None else "starting") if code is None else f"exit {code}"
    cells = [d.peer_id, phase] + ["-"] * (len(COLUMNS) - 2)
    if s is not None:
        nbrs = s.neighbours.values()
        active = sum(1 for n in nbrs if n.state in ("active", "busy"))
        cells[2:] = [
            str(s.round), f"{s.epoch:.2f}", "-" if d.seen.loss is None else f"{d.seen.loss:.4f}",
            f"{s.eval.test_acc * 100:.1f}%" if s.eval is not None else "-", f"{s.w:.4f}",
            _fmt_bytes(d.seen.bytes_total("bytes_sent")), _fmt_bytes(d.seen.bytes_total("bytes_received")),
            f"{active}/{len(nbrs)}", f"{s.last_round_s * 1000:.0f}" if s.last_round_s > 0 else "-",
        ]
    return _line(cells)


def render_table(daemons: list[Daemon], elapsed_s: float) -> str:
    """The live table: one line per daemon (acc = its last own evaluation; nbrs = active edges / known peers)."""
    backend = next((d.seen.status.precision.backend for d in daemons if d.seen.status is not None), "-")
    head = f"{len(daemons)} daemons, precision backend {backend}, {elapsed_s:.0f}s elapsed"
    return "\n".join([head, _line([name for name, _, _ in COLUMNS]), *(table_row(d) for d in daemons)])


class LiveTable:
    """Redraws the table in place on a terminal; appends it on a pipe or file (logs, CI)."""

    def __init__(self, out: TextIO = sys.stdout) -> None:
        self.out = out
        self.tty = out.isatty()
        self.lines = 0

    def show(self, text: str) -> None:
        if self.tty and self.lines:
            self.out.write(f"\x1b[{self.lines}F\x1b[J")
        self.out.write(text + "\n")
        self.out.flush()
        self.lines = text.count("\n") + 1

    def note(self, text: str) -> None:
        """A message that stays above the table."""
        self.lines = 0
        self.out.write(text + "\n")
        self.out.flush()


def report_failures(daemons: list[Daemon], note: Callable[[str], None]) -> None:
    """Show the log tail of every daemon that exited non-zero, once."""
    for d in daemons:
        code = d.proc.poll()
        if code not in (None, 0) and not d.reported:
            d.reported = True
            note(f"\n{d.peer_id} exited with code {code}; last lines of {d.log_path}:\n{log_tail(d.log_path)}\n")


def watch(daemons: list[Daemon], started: float, refresh_s: float, poll_s: float, poll_timeout_s: float,
          table: LiveTable, history: History | None = None) -> None:
    """Poll every ``poll_s`` seconds and redraw every ``refresh_s`` seconds until every daemon has exited; with
    ``history``, sample the fleet's curves as it goes (peer/fleet/history.py).

    KeyboardInterrupt propagates (the caller stops the daemons).
    """
    next_draw = 0.0
    while True:
        poll(daemons, started, poll_timeout_s)
        if history is not None:
            history.sample(daemons, time.monotonic() - started)
        report_failures(daemons, table.note)
        now = time.monotonic()
        alive = any(d.running for d in daemons)
        if now >= next_draw or not alive:
            table.show(render_table(daemons, now - started))
            next_draw = now + refresh_s
        if not alive:
            return
        time.sleep(poll_s)
