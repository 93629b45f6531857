"""``lpdl-peer status``: what a peer is doing, from its local control socket or a remote peer's Status RPC."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import click

from peer.daemon.paths import CONTROL_SOCKET_NAME, default_state_dir


async def _remote_status(address: str, timeout_s: float) -> dict[str, Any]:
    import grpc

    from peer.net.proto.lpdl.v1 import peer_pb2 as pb
    from peer.net.proto.lpdl.v1 import peer_pb2_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        reply = await peer_pb2_grpc.PeerStub(channel).Status(pb.StatusRequest(), timeout=timeout_s)
    return json.loads(reply.json)


def fetch_status(socket_path: Path | None, peer: str | None, timeout_s: float = 5.0) -> dict[str, Any]:
    """Status from a remote peer (``peer`` = host:port) or the local control socket."""
    from peer.daemon.control import read_control_socket

    if peer:
        return asyncio.run(_remote_status(peer, timeout_s))
    assert socket_path is not None
    return asyncio.run(read_control_socket(socket_path, timeout_s))


def _age(seconds_since_epoch: float) -> str:
    if not seconds_since_epoch:
        return "never"
    return f"{max(0.0, time.time() - seconds_since_epoch):.1f}s ago"


def _bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def format_status(s: dict[str, Any]) -> str:
    """Human-readable status table."""
    ev = s.get("eval") or {}
    acc = f"{ev['test_acc'] * 100:.2f}% (round {ev['round']})" if ev else "not yet"
    g, p = s["gossip"], s["precision"]
    lines = [
        f"peer      {s['peer_id']}  fleet {s['fleet']}  {s['phase']}  up {s['uptime_s']:.0f}s",
        f"training  round {s['round']}  epoch {s['epoch']:.2f}  lr {s['lr']:.4g}  loss {s['loss']:.4f}  "
        f"test acc {acc}",
        f"model     {s['model']['name']} ({s['model']['fingerprint']})  precision {p['backend']} "
        f"(requested {p['requested']}: {p['reason']})",
        f"gossip    {g['algorithm']} c={g['compression']} {g['bits']}-bit gamma={g['gamma']} {g['topology']}  "
        f"w {s['w']:.4f}  last round {s['last_round_s'] * 1000:.0f} ms",
        "",
        f"{'neighbour':<24} {'state':<12} {'address':<22} {'sent':>10} {'received':>10} {'rtt ms':>7} {'last seen':>11}",
    ]
    for peer_id, n in s["neighbours"].items():
        rtt = f"{n['rtt_s'] * 1000:.1f}" if n.get("rtt_s") else "-"
        lines.append(f"{peer_id:<24} {n['state']:<12} {n['address']:<22} {_bytes(n['bytes_sent']):>10} "
                     f"{_bytes(n['bytes_received']):>10} {rtt:>7} {_age(n['last_seen']):>11}")
    if not s["neighbours"]:
        lines.append("(no neighbours yet)")
    refused = ", ".join(f"{k} {v}" for k, v in sorted(s["refused"].items())) or "none"
    dropped = ", ".join(f"{k} {v}" for k, v in sorted(s["dropped"].items())) or "none"
    lines += ["", f"inputs    applied {s['applied']}  refused: {refused}  dropped: {dropped}"]
    return "\n".join(lines)


@click.command("status")
@click.option("--state-dir", type=click.Path(file_okay=False), default=None,
              help="State directory of the local daemon [$STATE_DIRECTORY or ~/.local/state/lpdl-peer].")
@click.option("--socket", "socket_path", type=click.Path(dir_okay=False), default=None,
              help="Control socket path [STATE_DIR/control.sock].")
@click.option("--peer", default=None, help="host:port of a remote peer (Status RPC) instead of the local socket.")
@click.option("--json", "as_json", is_flag=True, help="Print the raw JSON snapshot.")
@click.option("--watch", type=float, default=None, help="Refresh every N seconds until interrupted.")
@click.option("--timeout", type=float, default=5.0, help="Seconds to wait for an answer.")
def status(state_dir: str | None, socket_path: str | None, peer: str | None, as_json: bool, watch: float | None,
           timeout: float) -> None:
    """Show a peer's round, loss, accuracy, weight, precision backend and per-neighbour links."""
    path = Path(socket_path) if socket_path else (Path(state_dir) if state_dir else default_state_dir()) / CONTROL_SOCKET_NAME
    while True:
        try:
            snapshot = fetch_status(None if peer else path, peer, timeout)
        except (OSError, asyncio.TimeoutError) as exc:
            where = peer or str(path)
            raise click.ClickException(f"no peer answering at {where}: {exc}") from None
        except Exception as exc:  # grpc.RpcError and friends
            raise click.ClickException(f"status from {peer or path} failed: {exc}") from None
        text = json.dumps(snapshot, indent=2) if as_json else format_status(snapshot)
        if watch:
            click.clear()
        click.echo(text)
        if not watch:
            return
        time.sleep(watch)
