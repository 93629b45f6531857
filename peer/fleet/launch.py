"""Start and stop the fleet's ``lpdl-peer start`` daemons, one subprocess each.

Run directory layout::

    ca/                  the run's fleet CA (``lpdl-peer ca init``): every daemon runs mutual TLS
    operator/            an operator certificate: ``lpdl-peer status --peer HOST:PORT --tls-dir RUN/operator``
    peer-<i>/            state directory of daemon i (checkpoint.pt, peer_id, control.sock while running,
                         tls/ with its own certificate)
    peer-<i>.log         its stdout + stderr
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from peer.cli.options import run_flag_args
from peer.config import RunSpec
from peer.daemon.paths import control_socket_path
from peer.fleet.observe import Observation
from peer.security import ca
from peer.security.identity import ROLE_OPERATOR

#: Started daemons are run by this interpreter, so the fleet works from a venv without its bin/ on PATH.
DAEMON_ENTRY = "from peer.cli.main import main; main()"
#: Lines of a failed daemon's log shown on the terminal.
LOG_TAIL_LINES = 20


@dataclass
class Daemon:
    """One ``lpdl-peer start`` subprocess and what the fleet learned about it.

    Attributes:
        index: shard rank i of N.
        peer_id: its peer id (``<fleet>-p<i>``).
        state_dir: its state directory.
        log_path: file holding its stdout and stderr.
        proc: the process.
        seen: what its status snapshots said.
        reported: whether an early failure was already shown.
    """

    index: int
    peer_id: str
    state_dir: Path
    log_path: Path
    proc: subprocess.Popen
    seen: Observation = field(default_factory=Observation)
    reported: bool = False

    @property
    def socket_path(self) -> Path:
        return control_socket_path(self.state_dir)

    @property
    def running(self) -> bool:
        return self.proc.poll() is None


def node_flag_args(threads: int, eval_every: int, exit_when_done: bool, config_path: str | None) -> list[str]:
    """Daemon settings shared by the whole fleet (no join wait: all daemons start from scratch together; a
    checkpoint right after each evaluation, which the fleet's history reads)."""
    args = ["--threads", str(threads), "--eval-every", str(eval_every), "--checkpoint-every", str(eval_every),
            "--join-wait", "0", "--exit-when-done" if exit_when_done else "--keep-running"]
    return args + (["--config", config_path] if config_path else [])


def daemon_command(spec: RunSpec, node_args: list[str], fleet: str, index: int, n_peers: int, listen: str,
                   state_dir: Path) -> list[str]:
    """argv of daemon ``index``: exactly ``spec``, loopback gRPC and mDNS, its shard, state directory and peer id."""
    return [sys.executable, "-c", DAEMON_ENTRY, "start", *run_flag_args(spec), *node_args,
            "--listen", listen, "--neighbors", "auto", "--mdns-ip", "127.0.0.1", "--fleet", fleet,
            "--peer-id", f"{fleet}-p{index}", "--shard", f"{index}/{n_peers}", "--state-dir", str(state_dir)]


def issue_certificates(run_dir: Path, fleet: str, n_peers: int) -> Path:
    """The run's fleet CA, each daemon's certificate in ``peer-<i>/tls`` (its default TLS directory) and an
    operator certificate in ``operator/``; returns the CA directory. Certificates already there are kept."""
    ca_dir = run_dir / "ca"
    if not (ca_dir / ca.CA_CERT).exists():
        ca.init_ca(ca_dir, fleet)
    for index in range(n_peers):
        tls_dir = run_dir / f"peer-{index}" / "tls"
        if not (tls_dir / ca.CERT).exists():
            ca.issue(ca_dir, f"{fleet}-p{index}", tls_dir)
    if not (run_dir / "operator" / ca.CERT).exists():
        ca.issue(ca_dir, f"{fleet}-operator", run_dir / "operator", role=ROLE_OPERATOR)
    return ca_dir


#: Environment a local fleet gives its daemons (and its own evaluation) unless the user set it: eager quantization
#: passes. Even compiling each kernel once per host (the shared cache, peer/lowp/compiler_env.py), 4 compiled daemons
#: on 2 cores reached 90% about 3x later than fp32 and peaked ~290 MiB higher; eager int8 ~1.1x and +25-30 MiB
#: (docs/decisions/lowp-passes.md#the-readme-fleets-passes).
FLEET_ENV_DEFAULTS: dict[str, str] = {"LPDL_LOWP_EAGER": "1"}


def launch(commands: list[list[str]], run_dir: Path, fleet: str) -> list[Daemon]:
    """Start one daemon per command, each with its log file, in its own session (Ctrl-C reaches only the fleet),
    secured by the run's own fleet CA."""
    daemons = []
    env = {**FLEET_ENV_DEFAULTS, **os.environ, "PYTHONUNBUFFERED": "1"}
    issue_certificates(run_dir, fleet, len(commands))
    for index, argv in enumerate(commands):
        state_dir = run_dir / f"peer-{index}"
        state_dir.mkdir(parents=True, exist_ok=True)
        log_path = run_dir / f"peer-{index}.log"
        with log_path.open("wb") as log_file:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                                    env=env, start_new_session=True)
        daemons.append(Daemon(index, f"{fleet}-p{index}", state_dir, log_path, proc))
    return daemons


def stop_all(daemons: list[Daemon], timeout_s: float) -> list[Daemon]:
    """SIGTERM every running daemon (finish the round, settle, checkpoint); SIGKILL those left after ``timeout_s``.

    A second Ctrl-C while waiting kills the stragglers at once. Returns the daemons that had to be killed.
    """
    for d in daemons:
        if d.running:
            d.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    try:
        for d in daemons:
            try:
                d.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
    except KeyboardInterrupt:
        pass
    killed = [d for d in daemons if d.running]
    for d in killed:
        d.proc.kill()
        d.proc.wait()
    return killed


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last ``lines`` lines of a log file."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"(log unreadable: {exc})"
