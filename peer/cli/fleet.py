"""``lpdl-peer fleet``: a whole fleet of ``lpdl-peer start`` daemons on this machine, on loopback.

Each daemon is a separate process (its own gRPC server, mDNS on 127.0.0.1, state directory and log file) training on
shard i/N of the dataset. The fleet command watches them through their control sockets, draws a live table, and when
they have all exited (or on Ctrl-C / SIGTERM: SIGTERM to every daemon, SIGKILL after a timeout) evaluates every
peer's final checkpoint and the average of all of them, prints a summary and writes ``summary.json``.

Run directory layout (default ``runs/fleet-<timestamp>``)::

    peer-<i>/            state directory of daemon i (checkpoint.pt, peer_id, control.sock while running)
    peer-<i>.log         its stdout + stderr
    summary.json         written at the end
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import secrets
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import click

from peer.cli.options import RUN_FLAGS, pop_run_spec, run_spec_options
from peer.config import RunSpec
from peer.daemon.paths import CHECKPOINT_NAME, CONTROL_SOCKET_NAME
from peer.daemon.control import read_control_socket

#: Fleet defaults (measured on 2 shared cores, see bench/RESULTS-fleet.md): epochs of each peer's shard.
DEFAULT_EPOCHS = 4.0
#: Rounds between a daemon's own test evaluations: one epoch of a peer of the default fleet (1,000 of mnist5k's 4,000
#: training images per peer, 31 steps of 32; one round = one local step with the default --local-steps 1).
DEFAULT_EVAL_EVERY = 31
#: How often the fleet asks every daemon for its status (seconds); the table is redrawn every --refresh seconds.
POLL_S = 0.5
#: Lines of a failed daemon's log shown on the terminal.
LOG_TAIL_LINES = 20
#: Started daemons are run by this interpreter, so the fleet works from a venv without its bin/ on PATH.
DAEMON_ENTRY = "from peer.cli.main import cli; cli(prog_name='lpdl-peer')"


@dataclass
class Daemon:
    """One ``lpdl-peer start`` subprocess and what the fleet learned about it.

    Attributes:
        index: shard rank i of N.
        peer_id: its peer id (``<fleet>-p<i>``).
        state_dir: its state directory.
        log_path: file holding its stdout and stderr.
        proc: the process.
        status: last status snapshot read from its control socket (empty before the first one).
        round_samples: ``last_round_s`` of every distinct round seen (seconds).
        first_seen: (monotonic seconds, round) of the first snapshot in the training phase.
        last_seen: (monotonic seconds, round) of the latest snapshot.
        evals: every distinct evaluation the daemon reported, with the fleet's elapsed seconds.
        sent_samples: (round, bytes sent over all links) of every training snapshot.
        peak_rss_kb: highest VmHWM read from /proc (kB; 0 where /proc is unavailable).
        reported: whether an early failure was already shown.
    """

    index: int
    peer_id: str
    state_dir: Path
    log_path: Path
    proc: subprocess.Popen
    status: dict[str, Any] = field(default_factory=dict)
    round_samples: dict[int, float] = field(default_factory=dict)
    first_seen: tuple[float, int] | None = None
    last_seen: tuple[float, int] | None = None
    evals: list[dict[str, float]] = field(default_factory=list)
    sent_samples: list[tuple[int, int]] = field(default_factory=list)
    peak_rss_kb: int = 0
    reported: bool = False

    @property
    def socket_path(self) -> Path:
        return self.state_dir / CONTROL_SOCKET_NAME

    @property
    def running(self) -> bool:
        return self.proc.poll() is None

    def observe(self, snapshot: dict[str, Any], now: float, elapsed_s: float) -> None:
        """Record a status snapshot taken at monotonic time ``now``, ``elapsed_s`` after the fleet started."""
        self.status = snapshot
        rnd = int(snapshot["round"])
        if snapshot["phase"] == "training":
            if self.first_seen is None:
                self.first_seen = (now, rnd)
            self.last_seen = (now, rnd)
            self.sent_samples.append((rnd, self.bytes_total("bytes_sent")))
        if rnd > 0 and snapshot["last_round_s"] > 0:
            self.round_samples[rnd] = float(snapshot["last_round_s"])
        ev = snapshot.get("eval") or {}
        if ev and (not self.evals or self.evals[-1]["round"] != ev["round"]):
            self.evals.append({**ev, "elapsed_s": elapsed_s})
        self.peak_rss_kb = max(self.peak_rss_kb, read_peak_rss_kb(self.proc.pid))

    def bytes_total(self, key: str) -> int:
        """Bytes over all links of the last snapshot; ``key`` is bytes_sent or bytes_received."""
        return int(sum(n[key] for n in self.status.get("neighbours", {}).values()))

    def steady_sent_per_round(self) -> float:
        """Bytes sent per round over the second half of training (leaves out the one-off model pull of a joiner).

        NaN if fewer than two rounds apart were sampled in that half.
        """
        if not self.sent_samples:
            return math.nan
        last_round, last_sent = self.sent_samples[-1]
        first_round, first_sent = next((r, b) for r, b in self.sent_samples if r >= last_round / 2)
        if last_round - first_round < 2:
            return math.nan
        return (last_sent - first_sent) / (last_round - first_round)

    def mean_round_s(self) -> float:
        """Wall seconds per round between the first and the last training snapshot (NaN if under one round)."""
        if self.first_seen is None or self.last_seen is None or self.last_seen[1] <= self.first_seen[1]:
            return math.nan
        return (self.last_seen[0] - self.first_seen[0]) / (self.last_seen[1] - self.first_seen[1])


def read_peak_rss_kb(pid: int) -> int:
    """VmHWM (peak resident set, kB) of a live process from /proc; 0 if it is gone or /proc is missing."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last ``lines`` lines of a log file."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"(log unreadable: {exc})"


# --- launching --------------------------------------------------------------------------------------------------
def run_flag_args(spec: RunSpec) -> list[str]:
    """Every field of the resolved RunSpec as ``lpdl-peer start`` flags, so each daemon runs exactly this spec."""
    args: list[str] = []
    for flag, section, field_name, _, _ in RUN_FLAGS:
        value = getattr(getattr(spec, section), field_name)
        if value is None:
            continue
        if isinstance(value, bool):
            on, _, off = flag.partition("/")
            args.append(on if value else off)
        else:
            args += [flag, str(value)]
    return args


def daemon_command(spec_args: list[str], node_args: list[str], fleet: str, index: int, n_peers: int,
                   listen: str, state_dir: Path) -> list[str]:
    """argv of daemon ``index``: loopback gRPC and mDNS, its shard, its own state directory and peer id."""
    return [sys.executable, "-c", DAEMON_ENTRY, "start", *spec_args, *node_args,
            "--listen", listen, "--neighbors", "auto", "--mdns-ip", "127.0.0.1", "--fleet", fleet,
            "--peer-id", f"{fleet}-p{index}", "--shard", f"{index}/{n_peers}", "--state-dir", str(state_dir)]


def launch(commands: list[list[str]], run_dir: Path, fleet: str) -> list[Daemon]:
    """Start one daemon per command, each with its log file, in its own session (Ctrl-C reaches only the fleet)."""
    daemons = []
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for index, argv in enumerate(commands):
        state_dir = run_dir / f"peer-{index}"
        state_dir.mkdir(parents=True, exist_ok=True)
        log_path = run_dir / f"peer-{index}.log"
        with log_path.open("wb") as log_file:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                                    env=env, start_new_session=True)
        daemons.append(Daemon(index, f"{fleet}-p{index}", state_dir, log_path, proc))
    return daemons


# --- watching ---------------------------------------------------------------------------------------------------
async def _poll_all(daemons: list[Daemon], timeout_s: float) -> list[dict[str, Any] | None]:
    async def one(d: Daemon) -> dict[str, Any] | None:
        if not d.running or not d.socket_path.exists():
            return None
        try:
            return await read_control_socket(d.socket_path, timeout_s)
        except (OSError, asyncio.TimeoutError, ValueError):
            return None  # starting, stopping, or too busy to answer this time

    return await asyncio.gather(*(one(d) for d in daemons))


def poll(daemons: list[Daemon], started: float, timeout_s: float = 2.0) -> None:
    """Read every running daemon's status once and record it."""
    snapshots = asyncio.run(_poll_all(daemons, timeout_s))
    now = time.monotonic()
    for d, snapshot in zip(daemons, snapshots):
        if snapshot is not None:
            d.observe(snapshot, now, now - started)


def _fmt_bytes(n: float) -> str:
    return f"{n / 1e6:.2f}MB" if n >= 1e5 else f"{n / 1e3:.1f}kB"


def table_row(d: Daemon) -> str:
    """One line of the live table for a daemon."""
    s = d.status
    code = d.proc.poll()
    phase = s.get("phase", "starting") if code is None else f"exit {code}"
    if not s:
        return f"{d.peer_id:<18} {phase:<9}"
    ev = s.get("eval") or {}
    acc = f"{ev['test_acc'] * 100:.1f}%" if ev else "-"
    nbrs = s["neighbours"].values()
    active = sum(1 for n in nbrs if n["state"] in ("active", "busy"))
    return (f"{d.peer_id:<18} {phase:<9} {s['round']:>6} {s['epoch']:>6.2f} {s['loss']:>7.4f} {acc:>6} "
            f"{s['w']:>7.4f} {_fmt_bytes(d.bytes_total('bytes_sent')):>9} "
            f"{_fmt_bytes(d.bytes_total('bytes_received')):>9} {active:>2}/{len(nbrs):<2} "
            f"{s['last_round_s'] * 1000:>7.0f}")


TABLE_HEADER = (f"{'peer':<18} {'phase':<9} {'round':>6} {'epoch':>6} {'loss':>7} {'acc':>6} {'w':>7} "
                f"{'sent':>9} {'received':>9} {'nbrs':>5} {'ms/rnd':>7}")


def render_table(daemons: list[Daemon], elapsed_s: float) -> str:
    """The live table: one line per daemon (acc = its last own evaluation; nbrs = active edges / known peers)."""
    backend = next((d.status["precision"]["backend"] for d in daemons if d.status), "?")
    head = f"{len(daemons)} daemons, precision backend {backend}, {elapsed_s:.0f}s elapsed"
    return "\n".join([head, TABLE_HEADER, *(table_row(d) for d in daemons)])


class LiveTable:
    """Redraws the table in place on a terminal; appends it on a pipe or file (logs, CI)."""

    def __init__(self) -> None:
        self.tty = sys.stdout.isatty()
        self.lines = 0

    def show(self, text: str) -> None:
        if self.tty and self.lines:
            sys.stdout.write(f"\x1b[{self.lines}F\x1b[J")
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
        self.lines = text.count("\n") + 1

    def note(self, text: str) -> None:
        """A message that stays above the table."""
        self.lines = 0
        click.echo(text)


def report_failures(daemons: list[Daemon], table: LiveTable) -> None:
    """Show the log tail of every daemon that exited non-zero, once."""
    for d in daemons:
        code = d.proc.poll()
        if code not in (None, 0) and not d.reported:
            d.reported = True
            table.note(f"\n{d.peer_id} exited with code {code}; last lines of {d.log_path}:\n{log_tail(d.log_path)}\n")


def watch(daemons: list[Daemon], started: float, refresh_s: float) -> None:
    """Poll and redraw until every daemon has exited (KeyboardInterrupt propagates)."""
    table = LiveTable()
    next_draw = 0.0
    while True:
        poll(daemons, started)
        report_failures(daemons, table)
        now = time.monotonic()
        alive = any(d.running for d in daemons)
        if now >= next_draw or not alive:
            table.show(render_table(daemons, now - started))
            next_draw = now + refresh_s
        if not alive:
            return
        time.sleep(POLL_S)


def stop_all(daemons: list[Daemon], timeout_s: float) -> None:
    """SIGTERM every running daemon (finish the round, settle, checkpoint); SIGKILL those left after ``timeout_s``.

    A second Ctrl-C while waiting kills the stragglers at once.
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
    for d in daemons:
        if d.running:
            click.echo(f"{d.peer_id} did not stop within {timeout_s:.0f}s: SIGKILL", err=True)
            d.proc.kill()
            d.proc.wait()


# --- final evaluation -------------------------------------------------------------------------------------------
@dataclass
class CheckpointEval:
    """Test accuracy (in [0, 1]) of the peers' final checkpoints and of their average.

    Attributes:
        per_peer: accuracy of each peer's de-biased model, None where a peer left no checkpoint.
        averaged: accuracy of the averaged model (None if no checkpoint was found).
        consensus_distance: mean_i ||z_i - z_bar|| (parameter units, peer/runtime/state.py).
        backend: precision backend the evaluation ran with.
    """

    per_peer: list[float | None]
    averaged: float | None
    consensus_distance: float | None
    backend: str


def evaluate_checkpoints(spec: RunSpec, state_dirs: list[Path]) -> CheckpointEval:
    """Evaluate each peer's final de-biased model z = x / w, and the average of all of them, on the test split.

    Loads ``checkpoint.pt`` from each state directory; the averaged model and the consensus distance use the one
    definition of peer/runtime/state.py (z_bar = mean z_i with mean floating buffers; mean_i ||z_i - z_bar||).
    """
    import torch

    from peer.data import load_dataset
    from peer.runtime import state
    from peer.runtime.build import build_peer_model, test_batches
    from peer.runtime.evaluation import evaluate
    from peer.runtime.flat import FlatModel

    splits = load_dataset(spec.data.dataset, spec.data.root)
    built = build_peer_model(spec.model, splits, torch.device("cpu"), seed=spec.data.seed)
    flat = FlatModel(built.model)
    batches = test_batches(splits, torch.device("cpu"))
    states = []
    for state_dir in state_dirs:
        path = state_dir / CHECKPOINT_NAME
        states.append(state.load(path, built.fingerprint) if path.exists() else None)
    found = [s for s in states if s is not None]

    def accuracy(z: torch.Tensor, buffers: dict[str, torch.Tensor]) -> float:
        with torch.no_grad():
            flat.z.copy_(z)
        state.load_buffers(built.model, buffers)
        return evaluate(built.model, batches)[1]

    per_peer = [None if s is None else accuracy(state.debiased(s), s["buffers"]) for s in states]
    if not found:
        return CheckpointEval(per_peer, None, None, built.precision.backend)
    zs = [state.debiased(s) for s in found]
    averaged = accuracy(state.average_model(zs), state.average_buffers([s["buffers"] for s in found]))
    return CheckpointEval(per_peer, averaged, state.consensus_distance(zs), built.precision.backend)


# --- summary ----------------------------------------------------------------------------------------------------
def peer_summary(d: Daemon, accuracy: float | None) -> dict[str, Any]:
    """Per-peer figures (bytes and rounds from the last status snapshot, accuracy from the final checkpoint)."""
    s = d.status
    rounds = int(s.get("round", 0))
    sent, received = d.bytes_total("bytes_sent"), d.bytes_total("bytes_received")
    samples = list(d.round_samples.values())
    return {
        "peer_id": d.peer_id, "shard": d.index, "exit_code": d.proc.returncode, "log": str(d.log_path),
        "final_test_acc": accuracy, "last_own_eval": s.get("eval") or None, "rounds": rounds,
        "epoch": s.get("epoch"), "w": s.get("w"), "bytes_sent": sent, "bytes_received": received,
        "bytes_sent_per_round": sent / rounds if rounds else None,
        "steady_bytes_sent_per_round": _finite_or_none(d.steady_sent_per_round()),
        "mean_round_s": _finite_or_none(d.mean_round_s()),
        "median_round_s": statistics.median(samples) if samples else None,
        "peak_rss_mb": d.peak_rss_kb / 1024 if d.peak_rss_kb else None,
        "evals": d.evals,
    }


def _finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None


def build_summary(spec: RunSpec, daemons: list[Daemon], fleet: str, run_dir: Path, wall_s: float,
                  interrupted: bool) -> dict[str, Any]:
    """Everything summary.json holds: spec, per-peer figures, fleet mean and averaged-model accuracy."""
    result = evaluate_checkpoints(spec, [d.state_dir for d in daemons])
    peers = [peer_summary(d, acc) for d, acc in zip(daemons, result.per_peer)]
    accs = [a for a in result.per_peer if a is not None]
    precision = next((d.status["precision"] for d in daemons if d.status), {"backend": result.backend})
    return {
        "fleet": fleet, "run_dir": str(run_dir), "peers": len(daemons), "wall_s": wall_s,
        "interrupted": interrupted, "ok": not interrupted and all(p["exit_code"] == 0 for p in peers),
        "precision": precision, "spec": asdict(spec), "gamma": spec.gossip.effective_gamma,
        "mean_peer_acc": sum(accs) / len(accs) if accs else None, "averaged_model_acc": result.averaged,
        "consensus_distance": result.consensus_distance,
        "per_peer": peers,
    }


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.2f}%"


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def format_summary(summary: dict[str, Any]) -> str:
    """Human-readable end-of-run summary."""
    header = (f"{'peer':<18} {'exit':>4} {'final acc':>9} {'rounds':>6} {'MB sent':>8} {'MB recv':>8} "
              f"{'ms/round':>8} {'peak RSS MB':>11}")
    lines = ["", header]
    for p in summary["per_peer"]:
        lines.append(f"{p['peer_id']:<18} {_num(p['exit_code'], 'd'):>4} {_pct(p['final_test_acc']):>9} "
                     f"{p['rounds']:>6} {p['bytes_sent'] / 1e6:>8.3f} {p['bytes_received'] / 1e6:>8.3f} "
                     f"{_num(_ms(p['mean_round_s']), '.0f'):>8} "
                     f"{_num(p['peak_rss_mb'], '.0f'):>11}")
    prec = summary["precision"]
    lines += [
        "",
        f"fleet mean accuracy   {_pct(summary['mean_peer_acc'])}",
        (f"averaged model        {_pct(summary['averaged_model_acc'])}  (consensus distance "
         f"{_num(summary['consensus_distance'], '.4f')})"),
        f"precision backend     {prec.get('backend')}" + (f" ({prec['reason']})" if prec.get("reason") else ""),
        f"wall time             {summary['wall_s']:.1f}s" + ("  (interrupted)" if summary["interrupted"] else ""),
        f"summary               {summary['run_dir']}/summary.json",
    ]
    return "\n".join(lines)


# --- command ----------------------------------------------------------------------------------------------------
def default_run_dir() -> Path:
    return Path("runs") / time.strftime("fleet-%Y%m%d-%H%M%S")


def node_flag_args(threads: int, eval_every: int, exit_when_done: bool, config_path: str | None) -> list[str]:
    """Daemon settings shared by the whole fleet."""
    args = ["--threads", str(threads), "--eval-every", str(eval_every), "--join-wait", "0",
            "--exit-when-done" if exit_when_done else "--keep-running"]
    return args + (["--config", config_path] if config_path else [])


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


@click.command("fleet")
@run_spec_options
@click.option("--peers", "n_peers", type=click.IntRange(1, 64), default=4, help="Number of daemons.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="Run directory: state dirs, logs, summary.json [runs/fleet-<timestamp>].")
@click.option("--base-port", type=click.IntRange(0, 65535), default=0,
              help="Daemon i listens on 127.0.0.1:BASE+i [0 = ephemeral ports].")
@click.option("--fleet-name", default=None, help="mDNS fleet name [fleet-<random>, unique per run].")
@click.option("--threads", type=click.IntRange(1), default=1, help="torch threads per daemon.")
@click.option("--eval-every", type=click.IntRange(1), default=DEFAULT_EVAL_EVERY,
              help="Rounds between each daemon's own test evaluations.")
@click.option("--exit-when-done/--keep-running", default=True,
              help="Daemons exit after --epochs; otherwise they run until Ctrl-C.")
@click.option("--refresh", type=click.FloatRange(0.5), default=2.0, help="Seconds between table redraws.")
@click.option("--stop-timeout", type=click.FloatRange(0), default=30.0,
              help="Seconds a daemon gets to stop after SIGTERM before SIGKILL.")
def fleet(n_peers: int, out_dir: str | None, base_port: int, fleet_name: str | None, threads: int, eval_every: int,
          exit_when_done: bool, refresh: float, stop_timeout: float, **kwargs: Any) -> None:
    """Run N daemons on loopback (mDNS discovery), show live progress, then evaluate and summarise the fleet.

    Training flags (--epochs, --precision, --algorithm, --compression, --gamma, --lr, --skew, --model, ...) are
    passed to every daemon; --epochs defaults to 4 here (about 90 s and 92% test accuracy on MNIST with 4 peers on
    2 cores). Daemon logs go to RUN_DIR/peer-<i>.log. Exit code: 0, 1 if a daemon failed, 130 if interrupted.
    """
    config_path = kwargs.get("config_path")
    spec = pop_run_spec(kwargs, defaults={"optim": {"epochs": DEFAULT_EPOCHS}})
    run_dir = Path(out_dir) if out_dir else default_run_dir()
    if run_dir.exists() and any(run_dir.iterdir()):
        raise click.UsageError(f"run directory {run_dir} is not empty; choose another --out")
    run_dir.mkdir(parents=True, exist_ok=True)
    name = fleet_name or f"fleet-{secrets.token_hex(3)}"
    spec_args = run_flag_args(spec)
    node_args = node_flag_args(threads, eval_every, exit_when_done, config_path)
    commands = [daemon_command(spec_args, node_args, name, i, n_peers,
                               f"127.0.0.1:{base_port + i if base_port else 0}", run_dir / f"peer-{i}")
                for i in range(n_peers)]
    g = spec.gossip
    click.echo(f"fleet {name}: {n_peers} daemons, {spec.model.name} {spec.model.precision}, {g.algorithm} "
               f"c={g.compression} gamma={g.effective_gamma:.3g}, lr {spec.optim.lr}, {spec.optim.epochs:g} epochs; "
               f"logs {run_dir}/peer-<i>.log")
    signal.signal(signal.SIGTERM, _raise_interrupt)
    started = time.monotonic()
    daemons = launch(commands, run_dir, name)
    interrupted = False
    try:
        watch(daemons, started, refresh)
    except KeyboardInterrupt:
        interrupted = True
        click.echo("\ninterrupted: stopping the daemons (SIGTERM)")
    finally:
        stop_all(daemons, stop_timeout)
    wall_s = time.monotonic() - started
    summary = build_summary(spec, daemons, name, run_dir, wall_s, interrupted)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    click.echo(format_summary(summary))
    if not summary["ok"]:
        raise SystemExit(130 if interrupted else 1)
