"""Where a daemon keeps its state, by name (torch-free: ``lpdl-peer status`` and ``--help`` import only this).

State directory layout::

    peer_id          the peer's stable id (one line)
    checkpoint.pt    the last checkpoint (peer/runtime/state.py), replaced atomically
    checkpoint.prev.pt  the one before (used when checkpoint.pt is unreadable)
    tls/             default TLS directory: ca.pem, cert.pem, key.pem, revoked (peer/security/ca.py)
    control.sock     local control socket while the daemon runs (mode 0660)
"""

from __future__ import annotations

import os
import secrets
import socket
from pathlib import Path

CHECKPOINT_NAME = "checkpoint.pt"
PREVIOUS_CHECKPOINT_NAME = "checkpoint.prev.pt"
TLS_DIR_NAME = "tls"
PEER_ID_NAME = "peer_id"
CONTROL_SOCKET_NAME = "control.sock"


def default_state_dir() -> Path:
    """$STATE_DIRECTORY (systemd StateDirectory=), else ~/.local/state/lpdl-peer."""
    env = os.environ.get("STATE_DIRECTORY")
    if env:
        return Path(env.split(":")[0])
    return Path.home() / ".local" / "state" / "lpdl-peer"


def control_socket_path(state_dir: Path | None = None) -> Path:
    """The control socket of the daemon whose state directory is ``state_dir`` (default: :func:`default_state_dir`)."""
    return (state_dir or default_state_dir()) / CONTROL_SOCKET_NAME


def stored_peer_id(state_dir: Path) -> str:
    """The id kept in the state directory ("" if none yet)."""
    path = state_dir / PEER_ID_NAME
    return path.read_text().strip() if path.exists() else ""


def load_or_create_peer_id(state_dir: Path, wanted: str = "") -> str:
    """The peer's stable id: the configured one, else the one kept in the state directory, else a new one (kept)."""
    if wanted:
        return wanted
    existing = stored_peer_id(state_dir)
    if existing:
        return existing
    path = state_dir / PEER_ID_NAME
    peer_id = f"{socket.gethostname().split('.')[0][:24]}-{secrets.token_hex(3)}"
    path.write_text(peer_id + "\n")
    return peer_id
