"""``lpdl-peer release``: lift a quarantine the robust receive rule put on a neighbour (peer/gossip/robust.py), through
the local daemon's control socket. Torch-free, like ``status``."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import click

from peer.daemon.control import CONTROL_TIMEOUT_S, send_control_command
from peer.daemon.paths import control_socket_path


@click.command("release")
@click.argument("neighbour")
@click.option("--state-dir", type=click.Path(file_okay=False), default=None,
              help="State directory of the local daemon [$STATE_DIRECTORY or ~/.local/state/lpdl-peer].")
@click.option("--socket", "socket_path", type=click.Path(dir_okay=False), default=None,
              help="Control socket path [STATE_DIR/control.sock].")
def release(neighbour: str, state_dir: str | None, socket_path: str | None) -> None:
    """Take a quarantined NEIGHBOUR's messages again (its anomaly score starts from zero)."""
    path = Path(socket_path) if socket_path else control_socket_path(Path(state_dir) if state_dir else None)
    try:
        answer = asyncio.run(send_control_command(path, f"release {neighbour}", CONTROL_TIMEOUT_S))
    except (OSError, asyncio.TimeoutError, json.JSONDecodeError) as exc:
        raise click.ClickException(f"no answer from the daemon's control socket {path}: {exc}") from None
    if not answer.get("released"):
        raise click.ClickException(f"{neighbour} is not quarantined by {answer.get('peer_id', 'the daemon')} "
                                   f"(quarantined: {', '.join(answer.get('quarantined', [])) or 'none'})")
    click.echo(f"{answer['peer_id']}: released {neighbour} from quarantine")
