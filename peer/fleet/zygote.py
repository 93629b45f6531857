"""A local fleet's daemons forked from one process that imported torch once (a zygote), instead of N cold starts.

Why: most of a daemon's start is ``import torch`` (about 2 CPU-seconds on an AMD EPYC Zen 4 core), and a fleet of N
daemons on a few cores runs N of those imports at once: in the README fleet (4 daemons, 2 cores) they took 5-6.7 s
of a 5.3-7 s start, before any daemon could train (bench/fleet.py's start-up table). The zygote imports torch and
the daemon's modules once; each daemon is then a fork of it that runs exactly what ``lpdl-peer start --config
FILE`` runs, in its own session, with its own log file, environment and PID. Pages the imports made stay shared
until written, and a daemon's RSS counts only those it touches: the README fleet's daemons read 460-492 MiB of peak
RSS forked against 665-691 started cold (bench/RESULTS-fleet.md), so compare RSS only between runs started alike.

What a forked daemon gets, so that it is the process a cold start would have made: stdin from /dev/null, stdout and
stderr to its log, the environment the fleet gives its daemons, default SIGINT / SIGTERM handling, fresh torch and
numpy seeds (Python's ``random`` reseeds itself after fork), and the allocator the fleet's config asks for,
preloaded into the zygote (the daemon is marked as already on it, so ``start`` does not re-execute; its own
children get the LD_PRELOAD the fleet's environment had). Forking after the imports is what a DataLoader's workers
do: no gRPC core, event loop or torch thread pool exists in the zygote yet.

Protocol (JSON lines): the fleet writes ``{"args": [...], "env": {...}, "log": PATH}`` to the zygote's stdin; the
zygote answers ``{"ready": true}`` once imported, ``{"started": PID}`` per request and ``{"exited": PID,
"code": C}`` (C as ``Popen.returncode``: negative for a signal) when a daemon ends; it exits when its stdin
closes. Children stay the zygote's, so it reaps them and relays their codes.

This module is the fleet's side; the zygote process itself is ``python -m peer.cli.zygote`` (it runs the
``start`` command, which sits above the fleet).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from peer.errors import PeerError

#: The zygote process's module (run with ``python -m``).
ZYGOTE_MODULE = "peer.cli.zygote"
#: Seconds the fleet waits for the zygote's imports (a Raspberry Pi 4 imports torch in tens of seconds).
READY_TIMEOUT_S = 300.0
#: Seconds the zygote gets to exit once its stdin is closed, before it is killed.
CLOSE_TIMEOUT_S = 10.0
#: ``returncode`` of a forked daemon whose end nobody could observe (the zygote itself was killed first).
LOST_RETURNCODE = 255


class ZygoteError(PeerError, RuntimeError):
    """The zygote did not start (its imports failed, or it exited) or stopped answering."""

    default_reason = "zygote"


# --- the fleet's side ------------------------------------------------------------------------------------------
class ForkedDaemon:
    """A daemon forked by the zygote, with the part of ``subprocess.Popen``'s interface the fleet uses."""

    def __init__(self, zygote: Zygote, pid: int, args: list[str]) -> None:
        self.pid = pid
        self.args = args
        self._zygote = zygote

    @property
    def returncode(self) -> int | None:
        return self._zygote.returncode(self.pid)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """The exit code, once the daemon ended; raises subprocess.TimeoutExpired after ``timeout`` seconds."""
        code = self._zygote.wait_exit(self.pid, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:  # it ended and its code is on the way
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """The zygote process, seen from the fleet: start it, fork daemons from it, learn how they end.

    Args:
        env: the zygote's environment (the daemons' own, plus the allocator library in LD_PRELOAD).
        log_path: the zygote's own stdout and stderr (its import errors).
        ready_timeout_s: seconds to wait for its imports.
    """

    def __init__(self, env: dict[str, str], log_path: Path, ready_timeout_s: float = READY_TIMEOUT_S) -> None:
        self.log_path = log_path
        self.ready_timeout_s = ready_timeout_s
        with log_path.open("wb") as log_file:
            self._proc = subprocess.Popen([sys.executable, "-m", ZYGOTE_MODULE], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, stderr=log_file, env=env, start_new_session=True)
        self._changed = threading.Condition()
        self._ready = False
        self._started: list[int] = []
        self._exits: dict[int, int] = {}
        self._gone = False
        self._reader = threading.Thread(target=self._read, name="zygote-replies", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            try:
                reply = json.loads(line)
            except ValueError:
                continue
            with self._changed:
                if reply.get("ready"):
                    self._ready = True
                elif "started" in reply:
                    self._started.append(int(reply["started"]))
                elif "exited" in reply:
                    self._exits[int(reply["exited"])] = int(reply["code"])
                self._changed.notify_all()
        with self._changed:
            self._gone = True
            self._changed.notify_all()

    def wait_ready(self) -> None:
        """Block until the zygote has imported everything; raises ZygoteError if it exits or takes too long."""
        with self._changed:
            if not self._changed.wait_for(lambda: self._ready or self._gone, self.ready_timeout_s):
                raise ZygoteError(f"the daemons' zygote did not finish its imports in {self.ready_timeout_s:g} s "
                                  f"(log: {self.log_path})")
            if not self._ready:
                raise ZygoteError(f"the daemons' zygote exited before it could fork a daemon (log: {self.log_path})")

    def spawn(self, args: list[str], env: dict[str, str], log_path: Path) -> ForkedDaemon:
        """Fork a daemon that runs ``lpdl-peer ARGS`` with ``env``, its stdout and stderr in ``log_path``."""
        assert self._proc.stdin is not None
        self.wait_ready()
        request = json.dumps({"args": args, "env": env, "log": str(log_path)}) + "\n"
        with self._changed:
            before = len(self._started)
            try:
                self._proc.stdin.write(request.encode())
                self._proc.stdin.flush()
            except OSError as exc:
                raise ZygoteError(f"the daemons' zygote is gone ({exc}; log: {self.log_path})") from None
            if not self._changed.wait_for(lambda: len(self._started) > before or self._gone, self.ready_timeout_s):
                raise ZygoteError(f"the daemons' zygote did not fork in {self.ready_timeout_s:g} s")
            if len(self._started) == before:
                raise ZygoteError(f"the daemons' zygote exited while forking a daemon (log: {self.log_path})")
            return ForkedDaemon(self, self._started[before], args)

    def returncode(self, pid: int) -> int | None:
        """Exit code of forked daemon ``pid`` (None while it runs)."""
        with self._changed:
            return self._returncode(pid)

    def _returncode(self, pid: int) -> int | None:
        if pid in self._exits:
            return self._exits[pid]
        if self._gone and not Path(f"/proc/{pid}").exists():
            self._exits[pid] = LOST_RETURNCODE  # it ended after the zygote: nobody saw its code
            return LOST_RETURNCODE
        return None

    def wait_exit(self, pid: int, timeout: float | None) -> int | None:
        """Exit code of ``pid`` once it ended, None if ``timeout`` seconds passed first."""
        with self._changed:
            self._changed.wait_for(lambda: self._returncode(pid) is not None, timeout)
            return self._returncode(pid)

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """End the zygote (its daemons are not touched: the fleet stops those itself, before)."""
        try:
            if self._proc.stdin is not None:
                self._proc.stdin.close()
        except OSError:
            pass
        try:
            self._proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._reader.join(timeout_s)
