"""The local control socket: a client connects, sends one line - ``status``, or ``release <peer-id>`` (lift a
quarantine, peer/gossip/robust.py) - and the daemon writes one JSON document and closes.

A Unix socket in the state directory (mode 0660), so only the service user (and its group) can read it. Torch-free:
``lpdl-peer status`` uses :func:`read_control_socket` without loading the training stack.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

#: How long a status request on the control socket may take before either side gives up (seconds).
CONTROL_TIMEOUT_S = 5.0


class ControlServer:
    """Serves ``snapshot()`` as one JSON line per connection on a Unix socket at ``path``."""

    def __init__(self, path: Path, snapshot: Callable[[], dict[str, Any]],
                 timeout_s: float = CONTROL_TIMEOUT_S,
                 release: Callable[[str], dict[str, Any]] | None = None) -> None:
        self.path = path
        self.snapshot = snapshot
        self.release = release
        self.timeout_s = timeout_s
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        self.path.unlink(missing_ok=True)
        self._server = await asyncio.start_unix_server(self._serve, path=str(self.path))
        os.chmod(self.path, 0o660)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = (await asyncio.wait_for(reader.readline(), self.timeout_s)).decode(errors="replace").split()
            if line[:1] == ["release"] and len(line) == 2 and self.release is not None:
                answer = self.release(line[1])
            else:
                answer = self.snapshot()
            writer.write(json.dumps(answer, default=str).encode() + b"\n")
            await asyncio.wait_for(writer.drain(), self.timeout_s)
        except (asyncio.TimeoutError, ConnectionError) as exc:
            log.debug("control socket client dropped: %r", exc)
        finally:
            writer.close()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        self.path.unlink(missing_ok=True)


async def read_control_socket(path: Path, timeout_s: float = CONTROL_TIMEOUT_S) -> dict[str, Any]:
    """Ask a local daemon for its status through its control socket."""
    reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(str(path)), timeout_s)
    try:
        writer.write(b"status\n")
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), timeout_s)
    finally:
        writer.close()
    return json.loads(line)


async def send_control_command(path: Path, command: str, timeout_s: float = CONTROL_TIMEOUT_S) -> dict[str, Any]:
    """Send one command line (``release <peer-id>``) to a local daemon; returns its JSON answer."""
    reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(str(path)), timeout_s)
    try:
        writer.write(command.encode() + b"\n")
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), timeout_s)
    finally:
        writer.close()
    return json.loads(line)
