"""``lpdl-peer start``: run the peer daemon in the foreground (systemd, docker and the testbeds call this)."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import click

from peer.cli import main as entry
from peer.cli.options import RUN_FLAGS, SpecFlag, pop_daemon_config, run_spec_options, spec_options
from peer.config import ConfigError
from peer.daemon.allocator import AllocatorError, reexec_with
from peer.daemon.kinds import ALLOCATORS
from peer.daemon.memory import limit_malloc_arenas
from peer.lowp.compile_policy import AOT_BACKGROUND, ENV_AOT

NODE_FLAGS: list[SpecFlag] = [
    SpecFlag("--listen", "node", "listen", str, "gRPC listen address host:port (port 0 = any)."),
    SpecFlag("--neighbors", "node", "neighbors", str, "'auto' (mDNS) and/or host:port,... static neighbours."),
    SpecFlag("--mdns-ip", "node", "mdns_ip", str, "IPv4 address(es) to run and advertise mDNS on.",
             "primary interface"),
    SpecFlag("--fleet", "node", "fleet", str, "Fleet name; peers of other fleets are ignored."),
    SpecFlag("--state-dir", "node", "state_dir", str, "Checkpoints, identity, control socket.",
             "$STATE_DIRECTORY or ~/.local/state/lpdl-peer"),
    SpecFlag("--peer-id", "node", "peer_id", str, "Stable peer id.", "generated once, kept in the state dir"),
    SpecFlag("--shard", "node", "shard", str, "Train on shard R/N of the dataset (0/1 = all)."),
    SpecFlag("--device", "node", "device", str, "torch device."),
    SpecFlag("--threads", "node", "threads", int, "torch intra-op threads (0 = torch's default)."),
    SpecFlag("--allocator", "node", "allocator", click.Choice(ALLOCATORS),
             "malloc to run on: auto = tcmalloc, else jemalloc, where installed (far less RSS growth than glibc)."),
    SpecFlag("--max-rounds", "node", "max_rounds", int, "Stop after this many rounds (0 = no limit)."),
    SpecFlag("--exit-when-done/--keep-running", "node", "exit_when_done", None, "Exit after optim.epochs epochs."),
    SpecFlag("--eval-every", "node", "eval_every", int, "Rounds between test evaluations."),
    SpecFlag("--checkpoint-every", "node", "checkpoint_every", int, "Rounds between checkpoints."),
    SpecFlag("--round-interval", "node", "round_interval_s", float, "Minimum seconds per round."),
    SpecFlag("--max-unacked", "node", "max_unacked", int, "Messages unacknowledged on one edge before the next round "
             "waits for that neighbour: at most this many rounds per round of each peer it sends to (0 = no bound)."),
    SpecFlag("--pace-wait", "node", "pace_wait_s", float, "Longest one round waits for lagging neighbours (s)."),
    SpecFlag("--join-wait", "node", "join_wait_s", float,
             "Seconds to wait for a neighbour to pull the model from at first start."),
    SpecFlag("--metrics-port", "node", "metrics_port", int, "Prometheus exporter port (0 = off)."),
    SpecFlag("--metrics-host", "node", "metrics_host", str, "Address the Prometheus exporter binds."),
    SpecFlag("--tls-dir", "node", "tls_dir", str, "TLS directory from `lpdl-peer ca issue` (ca.pem, cert.pem, "
             "key.pem, revoked).", "STATE_DIR/tls"),
    SpecFlag("--insecure/--secure", "node", "insecure", None, "No TLS: trust every caller's claimed identity "
             "(a lab only)."),
]


@click.command("start")
@run_spec_options()
@spec_options(NODE_FLAGS)
def start(**kwargs: Any) -> None:
    """Run a peer: train on local data, find neighbours, gossip compressed updates. SIGTERM stops cleanly."""
    config = pop_daemon_config(kwargs, RUN_FLAGS + NODE_FLAGS)  # the file read once, every table at once
    if entry.PROCESS_ENTRY:  # this process is the command (not a caller running it in-process): it may re-execute
        try:
            reexec_with(config.node.allocator)  # returns only when staying on this allocator; same PID otherwise
        except AllocatorError as exc:
            raise click.ClickException(str(exc)) from None
    if "MALLOC_ARENA_MAX" not in os.environ:  # glibc's own knob wins where the operator set it
        limit_malloc_arenas()  # before torch and gRPC start their threads
    if entry.PROCESS_ENTRY:  # a daemon compiles no pass graph: the host's store, filled in the background
        os.environ.setdefault(ENV_AOT, AOT_BACKGROUND)
    # torch, grpc and zeroconf only now that the daemon really starts
    from peer.daemon.node import Node
    from peer.data import DatasetError
    from peer.runtime.state import CheckpointError
    from peer.security.credentials import TlsConfigError

    try:
        node = Node(config)
    except (DatasetError, CheckpointError, ConfigError, TlsConfigError) as exc:
        raise click.ClickException(str(exc)) from None
    try:
        code = asyncio.run(node.run())
    except CheckpointError as exc:  # neither the newest nor the previous checkpoint is readable
        raise click.ClickException(str(exc)) from None
    if entry.PROCESS_ENTRY:  # the shutdown is complete: skip the C exit handlers' ~110 MiB (peer/daemon/exit.py)
        from peer.daemon.exit import hard_exit
        hard_exit(code)
    raise SystemExit(code)
