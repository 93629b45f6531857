"""``lpdl-peer release`` through a real control socket (peer/daemon/control.py): the daemon's release hook is
called with the neighbour, and an unknown neighbour is a clear error."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

from click.testing import CliRunner

from peer.cli.main import cli
from peer.daemon.control import ControlServer


def test_release_reaches_the_daemon_and_names_what_it_did(tmp_path: Path) -> None:
    quarantined = {"peer-3"}
    calls: list[str] = []

    def release(neighbour: str) -> dict[str, Any]:
        calls.append(neighbour)
        released = neighbour in quarantined
        quarantined.discard(neighbour)
        return {"peer_id": "peer-1", "neighbour": neighbour, "released": released,
                "quarantined": sorted(quarantined)}

    path = tmp_path / "control.sock"
    loop = asyncio.new_event_loop()
    server = ControlServer(path, lambda: {"peer_id": "peer-1"}, release=release)
    loop.run_until_complete(server.start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        runner = CliRunner()
        ok = runner.invoke(cli, ["release", "peer-3", "--socket", str(path)])
        assert ok.exit_code == 0 and "released peer-3" in ok.output
        again = runner.invoke(cli, ["release", "peer-3", "--socket", str(path)])
        assert again.exit_code != 0 and "not quarantined" in again.output
        assert calls == ["peer-3", "peer-3"]
        missing = runner.invoke(cli, ["release", "peer-3", "--socket", str(tmp_path / "none.sock")])
        assert missing.exit_code != 0 and "control socket" in missing.output
    finally:
        asyncio.run_coroutine_threadsafe(server.close(), loop).result(5)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
