"""Start and stop the fleet's ``lpdl-peer start`` daemons, one subprocess each.

Run directory layout::

    ca/                  the run's fleet CA (``lpdl-peer ca init``): every daemon runs mutual TLS
    operator/            an operator certificate: ``lpdl-peer status --peer HOST:PORT --tls-dir RUN/operator``
    peer-<i>/            state directory of daemon i (checkpoint.pt, peer_id, control.sock while running,
                         tls/ with its own certificate)
    peer-<i>.toml        its whole resolved config (run, [node], [net]): it runs ``lpdl-peer start --config`` it
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

from peer.config import env_prefix
from peer.daemon.config import DAEMON_SECTIONS, DaemonConfig
from peer.daemon.paths import control_socket_path
from peer.fleet.observe import Observation
from peer.lowp.compile_policy import AOT_BACKGROUND, ENV_AOT
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


def write_daemon_config(config: DaemonConfig, run_dir: Path, index: int) -> Path:
    """Daemon ``index``'s resolved config as ``run_dir/peer-<index>.toml``; returns the path."""
    path = run_dir / f"peer-{index}.toml"
    path.write_text(config.toml(), encoding="utf-8")
    return path


def daemon_command(config_path: Path) -> list[str]:
    """argv of a daemon that runs exactly the config in ``config_path``."""
    return [sys.executable, "-c", DAEMON_ENTRY, "start", "--config", str(config_path)]


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


#: Environment a local fleet gives its daemons (and its own evaluation) unless the user set it: N daemons on one
#: machine must not each compile the same quantization kernels, nor wait minutes for them at the first run - the
#: passes come from the host's ahead-of-time store, and what it lacks runs eagerly while a background process
#: compiles it (peer/lowp/aot_queue.py; docs/decisions/eager-passes.md#a-local-fleet).
FLEET_ENV_DEFAULTS: dict[str, str] = {ENV_AOT: AOT_BACKGROUND}


def daemon_environment(environ: dict[str, str]) -> dict[str, str]:
    """The environment a fleet's daemon runs in: ``environ`` without the config variables
    (``LPDL_<SECTION>_<FIELD>``): the fleet resolved them into each daemon's file already, and a variable would
    otherwise beat the file's fleet-wide settings (listen address, shard, state directory)."""
    prefixes = tuple(env_prefix(section) for section in DAEMON_SECTIONS)
    return {**FLEET_ENV_DEFAULTS, **{k: v for k, v in environ.items() if not k.startswith(prefixes)},
            "PYTHONUNBUFFERED": "1"}


def launch(commands: list[list[str]], run_dir: Path, fleet: str) -> list[Daemon]:
    """Start one daemon per command, each with its log file, in its own session (Ctrl-C reaches only the fleet),
    secured by the run's own fleet CA."""
    daemons = []
    env = daemon_environment(dict(os.environ))
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
