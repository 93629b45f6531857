"""Start and stop the fleet's ``lpdl-peer start`` daemons, one process each: forked from the zygote (one process
that imported torch once, peer/fleet/zygote.py) where the daemons run on this host, else started as commands.

Run directory layout::

    ca/                  the run's fleet CA (``lpdl-peer ca init``): every daemon runs mutual TLS
    operator/            an operator certificate: ``lpdl-peer status --peer HOST:PORT --tls-dir RUN/operator``
    peer-<i>/            state directory of daemon i (checkpoint.pt, peer_id, control.sock while running,
                         tls/ with its own certificate)
    peer-<i>.toml        its whole resolved config (run, [node], [net]): it runs ``lpdl-peer start --config`` it
    peer-<i>.log         its stdout + stderr
    zygote.log           the zygote's own output (its import errors)
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from peer.config import env_prefix
from peer.daemon.allocator import AllocatorError, library_for, with_preload
from peer.daemon.config import DAEMON_SECTIONS, DaemonConfig
from peer.daemon.paths import control_socket_path
from peer.fleet.observe import Observation
from peer.fleet.zygote import Zygote, ZygoteError
from peer.lowp.compile_policy import AOT_BACKGROUND, ENV_AOT
from peer.security import ca
from peer.security.identity import ROLE_OPERATOR

log = logging.getLogger(__name__)

#: Started daemons are run by this interpreter, so the fleet works from a venv without its bin/ on PATH.
DAEMON_ENTRY = "from peer.cli.main import main; main()"
#: Lines of a failed daemon's log shown on the terminal.
LOG_TAIL_LINES = 20
#: The zygote's log in the run directory.
ZYGOTE_LOG = "zygote.log"


class DaemonProcess(Protocol):
    """What the fleet uses of a daemon's process: ``subprocess.Popen``, or a daemon forked by the zygote."""

    pid: int

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...


@dataclass
class Daemon:
    """One ``lpdl-peer start`` process and what the fleet learned about it.

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
    proc: DaemonProcess
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


def daemon_args(argv: list[str]) -> list[str] | None:
    """The ``lpdl-peer`` arguments of a plain daemon command (:func:`daemon_command`), which the zygote can fork;
    None for any other (a daemon placed in a network namespace runs through ``ip netns exec``)."""
    entry = [sys.executable, "-c", DAEMON_ENTRY]
    return argv[len(entry):] if argv[:len(entry)] == entry else None


def start_zygote(run_dir: Path, env: dict[str, str], allocator: str) -> Zygote | None:
    """The zygote for daemons that run on ``allocator`` (the fleet's node.allocator), or None where the daemons
    had better start as commands: a named allocator that is missing (each daemon then says so itself)."""
    try:
        found = library_for(allocator)
    except AllocatorError:
        return None
    return Zygote(with_preload(env, found[1]) if found else env, run_dir / ZYGOTE_LOG)


def launch(commands: list[list[str]], run_dir: Path, fleet: str,
           allocator: str | None = None) -> tuple[list[Daemon], Zygote | None]:
    """Start one daemon per command, each with its log file, in its own session (Ctrl-C reaches only the fleet),
    secured by the run's own fleet CA. With ``allocator`` (the daemons' node.allocator) and only plain daemon
    commands, the daemons are forked from a zygote, which the caller closes once they are stopped; a zygote that
    fails (its imports, a fork) is logged and the daemons it did not fork start as their commands. Returns the
    daemons and the zygote (None: each daemon started as its command)."""
    daemons = []
    env = daemon_environment(dict(os.environ))
    forkable = allocator is not None and all(daemon_args(argv) is not None for argv in commands)
    zygote = start_zygote(run_dir, env, allocator) if forkable and allocator is not None else None
    issue_certificates(run_dir, fleet, len(commands))  # while the zygote imports
    for index, argv in enumerate(commands):
        state_dir = run_dir / f"peer-{index}"
        state_dir.mkdir(parents=True, exist_ok=True)
        log_path = run_dir / f"peer-{index}.log"
        args = daemon_args(argv)
        proc: DaemonProcess | None = None
        if zygote is not None and args is not None:
            try:
                proc = zygote.spawn(args, env, log_path)
            except ZygoteError as exc:
                log.warning("%s; starting the daemons as their own commands", exc)
                zygote.close()
                zygote = None
        if proc is None:
            with log_path.open("wb") as log_file:
                proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                                        env=env, start_new_session=True)
        daemons.append(Daemon(index, f"{fleet}-p{index}", state_dir, log_path, proc))
    return daemons, zygote


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
