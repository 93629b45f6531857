"""``lpdl-peer start``: run the peer daemon in the foreground (systemd, docker and the testbeds call this)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import click

from peer.cli.options import pop_run_spec, run_spec_options
from peer.config import ConfigError, NodeSpec, load_sections
from peer.net.config import NetConfig

#: (flag, NodeSpec field, click type, help)
NODE_FLAGS: list[tuple[str, str, Any, str]] = [
    ("--listen", "listen", str, "gRPC listen address host:port (port 0 = any) [0.0.0.0:7070]."),
    ("--neighbors", "neighbors", str, "'auto' (mDNS) and/or host:port,... static neighbours [auto]."),
    ("--mdns-ip", "mdns_ip", str, "IPv4 address(es) to run and advertise mDNS on [primary interface]."),
    ("--fleet", "fleet", str, "Fleet name; peers of other fleets are ignored [default]."),
    ("--state-dir", "state_dir", str, "Checkpoints, identity, control socket [$STATE_DIRECTORY or ~/.local/state/lpdl-peer]."),
    ("--peer-id", "peer_id", str, "Stable peer id [generated once, kept in the state dir]."),
    ("--shard", "shard", str, "Train on shard R/N of the dataset [0/1 = all]."),
    ("--device", "device", str, "torch device [cpu]."),
    ("--threads", "threads", int, "torch intra-op threads [torch default]."),
    ("--max-rounds", "max_rounds", int, "Stop after this many rounds [0 = no limit]."),
    ("--exit-when-done/--keep-running", "exit_when_done", None, "Exit after optim.epochs epochs [keep running]."),
    ("--eval-every", "eval_every", int, "Rounds between test evaluations [20]."),
    ("--checkpoint-every", "checkpoint_every", int, "Rounds between checkpoints [50]."),
    ("--round-interval", "round_interval_s", float, "Minimum seconds per round [0]."),
    ("--join-wait", "join_wait_s", float, "Seconds to wait for a neighbour to pull the model from at first start [3]."),
    ("--metrics-port", "metrics_port", int, "Prometheus exporter port [0 = off]."),
    ("--metrics-host", "metrics_host", str, "Address the Prometheus exporter binds [127.0.0.1]."),
]


def node_options(func: Callable) -> Callable:
    """Add every NodeSpec flag to a click command."""
    for flag, _, kind, help_text in reversed(NODE_FLAGS):
        func = (click.option(flag, default=None, help=help_text) if kind is None
                else click.option(flag, type=kind, default=None, help=help_text))(func)
    return func


def pop_node_spec(kwargs: dict[str, Any], config_path: str | None) -> tuple[NodeSpec, NetConfig]:
    """NodeSpec and NetConfig from the [node]/[net] tables, LPDL_NODE_*/LPDL_NET_* variables and the flags."""
    flags: dict[str, Any] = {}
    for flag, field_name, _, _ in NODE_FLAGS:
        value = kwargs.pop(flag.split("/")[0].lstrip("-").replace("-", "_"))
        if value is not None:
            flags[field_name] = value
    try:
        built = load_sections({"node": NodeSpec, "net": NetConfig}, config_path, flags={"node": flags})
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    return built["node"], built["net"]


@click.command("start")
@run_spec_options()
@node_options
def start(**kwargs: Any) -> None:
    """Run a peer: train on local data, find neighbours, gossip compressed updates. SIGTERM stops cleanly."""
    config_path = kwargs.get("config_path")
    node_spec, net = pop_node_spec(kwargs, config_path)
    spec = pop_run_spec(kwargs)
    # torch, grpc and zeroconf only now that the daemon really starts
    from peer.checkpoint import CheckpointError
    from peer.data import DatasetError
    from peer.node import Node

    try:
        node = Node(spec, node_spec, net)
    except (DatasetError, CheckpointError, ConfigError) as exc:
        raise click.ClickException(str(exc)) from None
    raise SystemExit(asyncio.run(node.run()))
