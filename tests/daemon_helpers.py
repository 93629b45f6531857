"""Real ``lpdl-peer start`` processes for fleet tests: start, status, stop, checkpoints, fleet-wide push-sum totals.

    ports = free_ports(3)
    d = start_daemon(tmp_path / "a", "peer-000", ports[0], neighbors=[f"127.0.0.1:{p}" for p in ports[1:]],
                     run_flags=["--dataset", "mnist5k", "--precision", "fp32"], max_rounds=50)
    try:
        d.wait_ready(); d.wait_round(10); print(d.status()["neighbours"])
        assert d.stop() == 0
        state = d.checkpoint()
    finally:
        d.kill()

Every daemon logs to ``<state_dir>/daemon.log`` (the test prints its tail when an assertion fails). Processes run
inside a network namespace when ``wrap`` is given (``NetnsTestbed.argv`` partially applied): the control socket is a
path in the shared filesystem, so the test process reads status from the root namespace.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from peer.daemon.control import read_control_socket
from peer.daemon.paths import (
    CHECKPOINT_NAME,
    CONTROL_SOCKET_NAME,
    PREVIOUS_CHECKPOINT_NAME,
)
from peer.fleet.mass import FleetTotals, fleet_totals  # noqa: F401 (re-exported)
from peer.runtime import state as ckpt
from peer.security import ca

LOG_NAME = "daemon.log"
#: Fleet name of the test fleets' CA (the daemons' default fleet).
TEST_FLEET = "default"


def fleet_ca(root: Path, fleet: str = TEST_FLEET) -> Path:
    """A fleet CA under ``root`` (created once; ``lpdl-peer ca init``)."""
    ca_dir = root / "ca"
    if not (ca_dir / ca.CA_CERT).exists():
        ca.init_ca(ca_dir, fleet)
    return ca_dir


def z_of(state: dict[str, Any]) -> torch.Tensor:
    """The de-biased model of a checkpoint in float64 (conservation checks compare to ~1e-7 of its norm), with what
    the robust rule's clipping held back added in: the model the peer holds once it has applied that (a consensus
    judged on x / w alone passed while mass still waited to be applied, and the final check then found the peers
    apart)."""
    x, w = ckpt.engine_of(state).holdings()
    return x / w


def checkpoints_distance(states: Sequence[dict[str, Any]]) -> float:
    """The consensus distance (peer.runtime.state's one definition) of checkpoints' models, in float64."""
    return ckpt.consensus_distance([z_of(s) for s in states], torch.float64)


#: The checkout under test: daemons import ``peer`` from here (PYTHONPATH), never from another installed copy.
ROOT = Path(__file__).resolve().parents[1]


def lpdl_peer_argv() -> list[str]:
    """``lpdl-peer`` as this interpreter running the checkout under test (an installed console script may belong
    to another checkout of the project)."""
    return [sys.executable, "-m", "peer.cli.main"]


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct TCP ports that were free a moment ago (bound together, then released)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


#: Transport settings for tests: reconnect within a second or two after a peer restarts (defaults back off to 30 s).
FAST_NET_ENV = {
    "LPDL_NET_BACKOFF_BASE_S": "0.1",
    "LPDL_NET_BACKOFF_MAX_S": "1.0",
    "LPDL_NET_CONNECT_TIMEOUT_S": "3.0",
    "LPDL_NET_ACK_TIMEOUT_S": "10.0",
    "LPDL_NET_CLOSE_TIMEOUT_S": "3.0",
}


class DaemonError(AssertionError):
    """A daemon did not reach an expected state in time; the message holds its log tail."""


@dataclass
class Daemon:
    """One ``lpdl-peer start`` process and where to find its state."""

    peer_id: str
    state_dir: Path
    address: str
    argv: list[str]
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0
    exit_codes: list[int] = field(default_factory=list)
    log_dir: Path | None = None  # where the log goes when not in the state directory (a test that fills it)

    # --- paths ---------------------------------------------------------------------------------------------------
    @property
    def log_path(self) -> Path:
        return (self.log_dir or self.state_dir) / LOG_NAME

    @property
    def control_socket(self) -> Path:
        return self.state_dir / CONTROL_SOCKET_NAME

    @property
    def checkpoint_path(self) -> Path:
        return self.state_dir / CHECKPOINT_NAME

    # --- process -------------------------------------------------------------------------------------------------
    def start(self) -> Daemon:
        """(Re)start the process; the log is appended to, so restarts keep the history."""
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"{self.peer_id} is already running")
        self.state_dir.mkdir(parents=True, exist_ok=True)
        # a control socket left by a SIGKILLed run would answer nothing: remove it so wait_ready sees the new one
        self.control_socket.unlink(missing_ok=True)
        with self.log_path.open("ab") as log:
            log.write(f"\n===== start #{self.starts + 1}: {' '.join(self.argv)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                         stdin=subprocess.DEVNULL)
        self.starts += 1
        return self

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def fail(self, what: str) -> DaemonError:
        return DaemonError(f"{self.peer_id}: {what}\n--- log tail of {self.peer_id} ---\n{self.log_tail()}")

    def status(self, timeout_s: float = 5.0) -> dict[str, Any]:
        """Status snapshot through the control socket (peer.daemon.control.read_control_socket)."""
        return asyncio.run(read_control_socket(self.control_socket, timeout_s))

    def try_status(self) -> dict[str, Any] | None:
        try:
            return self.status(timeout_s=3.0)
        except (OSError, asyncio.TimeoutError, ValueError):
            return None

    def wait_ready(self, timeout_s: float = 90.0) -> dict[str, Any]:
        """Until the control socket answers with phase 'training' (joined, serving); raises if the process dies."""
        return self.wait_status(lambda s: s.get("phase") == "training", timeout_s, "ready (phase training)")

    def wait_round(self, n: int, timeout_s: float = 120.0) -> dict[str, Any]:
        return self.wait_status(lambda s: s["round"] >= n, timeout_s, f"round >= {n}")

    def wait_status(self, predicate: Callable[[dict[str, Any]], bool], timeout_s: float, what: str,
                    poll_s: float = 0.3) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        last: dict[str, Any] | None = None
        while time.monotonic() < deadline:
            if not self.running:
                raise self.fail(f"exited (rc {self.proc.returncode if self.proc else None}) while waiting for {what}")
            if self.control_socket.exists():
                s = self.try_status()
                if s is not None:
                    last = s
                    if predicate(s):
                        return s
            time.sleep(poll_s)
        raise self.fail(f"not {what} within {timeout_s:.0f} s; last status: round "
                        f"{last and last.get('round')}, phase {last and last.get('phase')}, neighbours "
                        f"{last and {k: v.get('state') for k, v in last.get('neighbours', {}).items()}}")

    def wait_log(self, pattern: str, timeout_s: float = 60.0) -> re.Match[str]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            m = re.search(pattern, self.log_text())
            if m:
                return m
            time.sleep(0.3)
        raise self.fail(f"log never matched {pattern!r} within {timeout_s:.0f} s")

    def wait_exit(self, timeout_s: float = 60.0) -> int:
        assert self.proc is not None
        try:
            rc = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise self.fail(f"did not exit within {timeout_s:.0f} s") from None
        self.exit_codes.append(rc)
        return rc

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM (finish the round, settle, checkpoint, goodbye) and wait; returns the exit code."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.wait_exit(timeout_s)

    def kill(self) -> None:
        """SIGKILL if still running (crash injection and test cleanup); idempotent."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    # --- state ---------------------------------------------------------------------------------------------------
    def checkpoint(self) -> dict[str, Any]:
        """The checkpoint; while the daemon runs, the newest readable one (a write replaces the file in two steps,
        and for a moment only the previous one is there)."""
        if self.running:
            return ckpt.load_newest(self.checkpoint_path, self.state_dir / PREVIOUS_CHECKPOINT_NAME)[0]
        return ckpt.load(self.checkpoint_path)

    def test_accuracies(self) -> list[tuple[int, float]]:
        """(round, test accuracy 0..1) of every evaluation the log reports, in order."""
        return [(int(r), float(a) / 100.0)
                for r, a in re.findall(r"round (\d+) epoch [\d.]+: train loss \S+, test acc ([\d.]+)%",
                                       self.log_text())]


def start_daemon(state_dir: Path, peer_id: str, port: int, *, host: str = "127.0.0.1",
                 neighbors: Sequence[str] | str = (), mdns_ip: str | None = None,
                 run_flags: Sequence[str] = (), max_rounds: int = 0, eval_every: int = 20,
                 checkpoint_every: int = 50, threads: int = 1, join_wait_s: float | None = None,
                 extra: Sequence[str] = (), wrap: Callable[[list[str]], list[str]] | None = None,
                 env: dict[str, str] | None = None, launch: bool = True, tls_ca: Path | None = None) -> Daemon:
    """Build (and by default launch) one daemon with its own state directory, fixed id and listen port.

    ``neighbors``: static ``host:port`` list, or "auto" (mDNS, then give ``mdns_ip``). ``run_flags``: RunSpec flags
    (model, data, optimizer, gossip), the same for every peer of a fleet. ``tls_ca``: a fleet CA (:func:`fleet_ca`)
    that issues this peer's certificate into ``<state_dir>/tls`` (the daemon's default TLS directory) and whose
    fleet the daemon joins; None runs the daemon with ``--insecure``.
    """
    state_dir = Path(state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    if tls_ca is not None:
        if not (state_dir / "tls" / ca.CERT).exists():
            ca.issue(tls_ca, peer_id, state_dir / "tls")
        security_args = ["--fleet", ca.ca_fleet(tls_ca)]
    else:
        security_args = ["--insecure"]
    nb = neighbors if isinstance(neighbors, str) else ",".join(neighbors)
    argv = [*lpdl_peer_argv(), "start", "--state-dir", str(state_dir), "--peer-id", peer_id,
            "--listen", f"{host}:{port}", "--neighbors", nb or "auto", "--threads", str(threads),
            "--max-rounds", str(max_rounds), "--eval-every", str(eval_every),
            "--checkpoint-every", str(checkpoint_every), *security_args, *run_flags]
    if mdns_ip:
        argv += ["--mdns-ip", mdns_ip]
    if join_wait_s is not None:
        argv += ["--join-wait", str(join_wait_s)]
    argv += list(extra)
    if wrap is not None:
        argv = wrap(argv)
    full_env = {**os.environ, **FAST_NET_ENV, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(threads),
                "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
                **(env or {})}
    daemon = Daemon(peer_id=peer_id, state_dir=state_dir, address=f"{host}:{port}", argv=argv, env=full_env)
    return daemon.start() if launch else daemon


def static_fleet(tmp_path: Path, n: int, run_flags: Sequence[str], prefix: str = "peer", launch: bool = True,
                 extra: Sequence[str] = (), secure: bool = True, **kw: Any) -> list[Daemon]:
    """``n`` daemons on 127.0.0.1, each listing all the others as static neighbours (ids ``peer-000``...), peer i
    training on ``--shard i/n``; secured by a fleet CA under ``tmp_path`` unless ``secure`` is False."""
    ports = free_ports(n)
    if secure:
        kw.setdefault("tls_ca", fleet_ca(tmp_path))
    addrs = [f"127.0.0.1:{p}" for p in ports]
    fleet = []
    try:
        for i in range(n):
            fleet.append(start_daemon(tmp_path / f"{prefix}{i}", f"{prefix}-{i:03d}", ports[i],
                                      neighbors=[a for j, a in enumerate(addrs) if j != i],
                                      run_flags=run_flags, launch=launch, extra=["--shard", f"{i}/{n}", *extra],
                                      **kw))
    except BaseException:
        kill_all(fleet)
        raise
    return fleet


def kill_all(daemons: Iterable[Daemon]) -> None:
    for d in daemons:
        d.kill()


def stop_all(daemons: Sequence[Daemon], timeout_s: float = 60.0) -> list[int]:
    """SIGTERM every running daemon at once, then wait for each; returns their exit codes."""
    for d in daemons:
        if d.running:
            d.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
    return [d.wait_exit(timeout_s) for d in daemons]


def neighbour_states(status: dict[str, Any]) -> dict[str, str]:
    return {peer_id: n["state"] for peer_id, n in status["neighbours"].items()}

