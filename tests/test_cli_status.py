"""``lpdl-peer status``: the 80-column view, --json over a real control socket, one-line errors for dead peers."""

from __future__ import annotations

import asyncio
import json
import math
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from peer.cli.main import cli
from peer.cli.status import format_status
from peer.daemon.control import ControlServer
from peer.daemon.metrics import Metrics
from peer.daemon.status import StatusDocument


def snapshot(n_neighbours: int = 8, loss: float = 0.4321) -> dict[str, Any]:
    """A status document as a daemon of an 8-neighbour LAN fleet writes it (long ids, LAN addresses, GB counters)."""
    now = time.time()
    states = ["active", "busy", "connecting", "down", "inbound-only", "known", "active", "closed"]
    neighbours = {
        f"raspberrypi-kitchen-{i:02d}-{i * 7919:06x}": {
            "address": f"192.168.178.{100 + i}:7070", "live": True, "state": states[i % len(states)],
            "bytes_sent": 1_234_567_890 * (i + 1), "bytes_received": 987_654 * (i + 1),
            "rtt_s": 0.0123 * (i + 1) if i % 3 else None, "last_seen": now - 3.5 * i if i != 5 else 0.0,
            "delivered": 10 * i, "settled": {}, "last_error": "",
        }
        for i in range(n_neighbours)
    }
    return {
        "peer_id": "raspberrypi-livingroom-3f2a1b", "fleet": "home-lab", "phase": "training", "uptime_s": 12345.6,
        "round": 123456, "epoch": 12.34, "lr": 0.005, "loss": loss,
        "eval": {"round": 123400, "epoch": 12.3, "test_loss": 0.3, "test_acc": 0.9312},
        "w": 1.0234, "precision": {"requested": "int8", "backend": "sim8",
                                   "reason": "int8 probe: torch._int_mm exact but 9.4x slower than fp32 on this CPU "
                                             "(no AVX512-VNNI); sim8 keeps the int8 numerics at fp32 speed"},
        "model": {"name": "resnet20", "fingerprint": "0123456789abcdef"},
        "gossip": {"algorithm": "choco", "compression": 0.99, "bits": 8, "gamma": 0.02,
                   "topology": "exponential rotating"},
        "last_round_s": 0.512, "neighbours": neighbours,
        "refused": {"fingerprint": 3, "protocol": 1, "stale-seq": 12}, "dropped": {"late-after-fence": 2},
        "applied": 98765,
        "memory": {"rss_mib": 701.4, "peak_mib": 750.2, "gossip_state_mib": 9.7,
                   "after": {}, "added": {"imports": 526.0, "dataset": 10.1, "model": 241.3, "peer": 12.0,
                                         "network": 5.2, "training": 132.4},
                   "seconds": {"imports": 2.41, "dataset": 0.31, "model": 1.07, "peer": 0.2, "network": 0.05,
                               "training": 3.9}},
    }


def test_status_view_of_eight_neighbours_fits_80_columns() -> None:
    s = snapshot()
    text = format_status(StatusDocument.from_json(s))
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80, "\n".join(line for line in lines if len(line) > 80)
    table = lines[lines.index(next(line for line in lines if line.startswith("neighbour"))) + 1:]
    rows = [line for line in table if line.strip()][:8]
    assert _all_named("\n".join(rows), list(s["neighbours"])), "\n".join(rows)
    for row, (peer_id, n) in zip(rows, s["neighbours"].items()):
        name = row.split()[0]
        assert peer_id.startswith(name.split("..")[0]) and peer_id.endswith(name.split("..")[-1])
        assert n["state"] in row
    assert "never" in text and "1.2 GB" in text and "93.12%" in text
    assert "9.4x slower" in text  # the precision reason is wrapped, not cut


def _all_named(text: str, peer_ids: list[str]) -> bool:
    """Every peer id appears in a neighbour row, whole or cut in the middle ("head..tail")."""
    names = [line.split()[0] for line in text.splitlines() if line.strip()]
    return all(any(n == p or ".." in n and p.startswith(n.split("..")[0]) and p.endswith(n.split("..")[1])
                   for n in names) for p in peer_ids)


def test_status_watch_on_an_80_column_terminal_shows_all_eight_neighbours(control_socket: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """`status --watch` (one refresh, then Ctrl-C) draws the same view: 80 columns, all 8 neighbours, memory."""
    def interrupt(_seconds: float) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr("peer.cli.status.time.sleep", interrupt)
    result = CliRunner().invoke(cli, ["status", "--socket", str(control_socket), "--watch", "2"], terminal_width=80)
    lines = result.output.splitlines()
    assert "raspberrypi-livingroom-3f2a1b" in result.output and "memory    RSS 701 MiB" in result.output
    start_up = next(line for line in lines if line.startswith("start-up"))
    assert "imports 2.4 s" in start_up and "model 1.1 s" in start_up and "training" not in start_up
    assert max(len(line) for line in lines) <= 80, "\n".join(line for line in lines if len(line) > 80)
    assert _all_named(result.output, list(snapshot()["neighbours"]))
    assert sum(1 for n in snapshot()["neighbours"].values() if n["state"] in result.output) == 8


def test_status_view_shows_dash_for_a_loss_not_yet_reported() -> None:
    text = format_status(StatusDocument.from_json(snapshot(n_neighbours=0, loss=math.nan)))
    assert "loss -" in text and "nan" not in text.lower()
    assert "(no neighbours yet)" in text


def test_status_view_names_a_quarantined_neighbours_certificate_and_a_routed_around_sink() -> None:
    doc = snapshot(n_neighbours=2)
    first, second = sorted(doc["neighbours"])
    doc["neighbours"][first].update(certificate_serial="5f3a09c2e1", robust={
        "score": 6.0, "clipped_fraction": 0.5, "quarantined_since": 12, "reason": "implausible_model"})
    doc["neighbours"][second].update(robust={
        "score": 0.0, "clipped_fraction": 0.0, "quarantined_since": None, "reason": "", "sink": True,
        "silent_rounds": 4, "routed_around_since": 30, "next_probe": 70, "implied_distance": 0.48,
        "outlier_factor": 0.073, "outlier_since": 41, "heading": -0.06, "heading_factor": 0.4})
    text = " ".join(format_status(StatusDocument.from_json(doc)).split())  # unwrapped
    assert f"{first}: score 6.00, clipped 50.0%, QUARANTINED since round 12 (implausible_model), certificate " \
           "serial 5f3a09c2e1" in text
    assert f"sink {second}: silent in 4 scheduled rounds, routed around since round 30 (next probe round 70)" in text
    assert f"outlier {second}: its model is 0.48 of this peer's norm away, far beyond the other neighbours'; its " \
           "radius and share are cut to 7.3%, not closing since round 41" in text
    assert f"outlier {first}" not in text  # quarantined, and an older document without the fields
    assert f"heading {second}: its replica travelled against this peer's own (cosine -0.06); its radius is cut " \
           "to 40%" in text
    assert f"heading {first}" not in text
    metrics = Metrics("p0")
    metrics.update(StatusDocument.from_json(doc))
    sample = metrics.registry.get_sample_value
    assert sample("lpdl_neighbour_quarantined", {"neighbour": first}) == 1.0
    assert sample("lpdl_neighbour_sink", {"neighbour": first}) == 0.0
    assert sample("lpdl_neighbour_sink", {"neighbour": second}) == 1.0
    assert sample("lpdl_neighbour_routed_around", {"neighbour": second}) == 1.0
    assert sample("lpdl_neighbour_routed_around", {"neighbour": first}) == 0.0
    assert sample("lpdl_neighbour_outlier_factor", {"neighbour": second}) == pytest.approx(0.073)
    assert sample("lpdl_neighbour_outlier_factor", {"neighbour": first}) == 1.0
    assert sample("lpdl_neighbour_heading_factor", {"neighbour": second}) == pytest.approx(0.4)
    assert sample("lpdl_neighbour_heading_factor", {"neighbour": first}) == 1.0


@pytest.fixture
def control_socket(tmp_path: Path) -> Iterator[Path]:
    """A real control socket serving snapshot(), on its own event loop thread (as a daemon serves it)."""
    path = tmp_path / "control.sock"
    loop = asyncio.new_event_loop()
    server = ControlServer(path, snapshot)
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(server.start(), loop).result(10)
    yield path
    asyncio.run_coroutine_threadsafe(server.close(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


def test_status_json_and_table_from_a_control_socket(control_socket: Path) -> None:
    as_json = CliRunner().invoke(cli, ["status", "--socket", str(control_socket), "--json"])
    assert as_json.exit_code == 0, as_json.output
    assert json.loads(as_json.output)["neighbours"].keys() == snapshot()["neighbours"].keys()
    table = CliRunner().invoke(cli, ["status", "--state-dir", str(control_socket.parent)])
    assert table.exit_code == 0, table.output
    assert "raspberrypi-livingroom-3f2a1b" in table.output and "applied 98765" in table.output


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_status_of_a_dead_peer_is_one_line_naming_address_and_cause() -> None:
    address = f"127.0.0.1:{_closed_port()}"
    result = CliRunner().invoke(cli, ["status", "--peer", address, "--timeout", "5"])
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output
    assert address in lines[0] and "UNAVAILABLE" in lines[0] and "refused" in lines[0].lower()
    assert "AioRpcError" not in result.output and "Traceback" not in result.output


def test_status_of_a_peer_that_never_answers_is_one_line_after_the_timeout() -> None:
    """A TCP listener that accepts and stays silent (a wedged or non-gRPC service): deadline, one line."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        result = CliRunner().invoke(cli, ["status", "--peer", address, "--timeout", "0.5"])
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output
    assert address in lines[0] and "DEADLINE_EXCEEDED" in lines[0]


def test_remote_status_of_a_secured_peer_needs_an_operator_certificate(tmp_path: Path) -> None:
    """`status --peer` with an operator certificate reads a secured peer; without one it gets one line and a hint."""
    import asyncio
    import threading

    from peer.net.server import PeerServer
    from peer.security import ca
    from peer.security.credentials import TransportSecurity
    from tests.test_net_support import FLEET, make_gate

    ca.init_ca(tmp_path / "ca", FLEET)
    ca.issue(tmp_path / "ca", "peer-b", tmp_path / "peer-b")
    ca.issue(tmp_path / "ca", "ops", tmp_path / "ops", role="operator")
    loop = asyncio.new_event_loop()
    server = PeerServer(make_gate("peer-b"), security=TransportSecurity.from_dir(tmp_path / "peer-b", FLEET))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    port = asyncio.run_coroutine_threadsafe(server.start("127.0.0.1:0"), loop).result(30)
    try:
        address = f"127.0.0.1:{port}"
        ok = CliRunner().invoke(cli, ["status", "--peer", address, "--tls-dir", str(tmp_path / "ops"), "--json"])
        assert ok.exit_code == 0, ok.output
        assert json.loads(ok.output)["peer_id"] == "peer-b"
        refused = CliRunner().invoke(cli, ["status", "--peer", address, "--state-dir", str(tmp_path / "none"),
                                           "--timeout", "5"])
        assert refused.exit_code == 1 and len(refused.output.strip().splitlines()) == 1
        assert "operator certificate" in refused.output
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def test_status_view_and_metrics_show_a_neighbour_left_out_on_quarantine_notices() -> None:
    doc = snapshot(n_neighbours=2)
    first, second = sorted(doc["neighbours"])
    doc["neighbours"][first].update(robust={
        "score": 0.0, "clipped_fraction": 0.0, "quarantined_since": None, "reason": "",
        "named_by": ["peer-005", "peer-007"], "left_out_on_notice_since": 7})
    text = " ".join(format_status(StatusDocument.from_json(doc)).split())  # unwrapped
    assert f"noticed {first}: out of the fleet's schedule since round 7: quarantined by peer-005, peer-007, " \
           "every peer it sends to" in text
    assert f"noticed {second}" not in text
    metrics = Metrics("p0")
    metrics.update(StatusDocument.from_json(doc))
    assert metrics.registry.get_sample_value("lpdl_neighbour_routed_around", {"neighbour": first}) == 1.0


def test_status_view_and_metrics_say_how_many_insiders_the_graph_lets_a_local_rule_bound() -> None:
    def view(**gossip: Any) -> tuple[str, float | None]:
        doc = snapshot(n_neighbours=2)
        doc["gossip"].update({"robust": True, **gossip})
        for key in [k for k, v in gossip.items() if v is None]:
            del doc["gossip"][key]
        parsed = StatusDocument.from_json(json.loads(json.dumps(doc)))
        metrics = Metrics("p0")
        metrics.update(parsed)
        text = format_status(parsed)
        assert max(len(line) for line in text.splitlines()) <= 80
        return " ".join(text.split()), metrics.registry.get_sample_value("lpdl_max_insiders")

    text, gauge = view(topology="ring", senders=1, max_insiders=0)
    assert "robust on; hears 1 peer a period of the graph: no local rule can bound an insider that stays within " \
           "the honest spread (3 senders needed for one: a denser gossip.topology); gross ones are quarantined" in text
    assert gauge == 0.0
    text, gauge = view(senders=5, max_insiders=2)
    assert "hears 5 peers a period of the graph: at most 2 insiders within the honest spread can be bounded" in text
    assert gauge == 2.0
    text, gauge = view(senders=0, max_insiders=0)  # every sender quarantined
    assert "hears no peer a period of the graph: every peer scheduled to send here is quarantined" in text
    text, gauge = view(robust=False, senders=3, max_insiders=None)
    assert "robust off (gossip.robust = false)" in text and math.isnan(gauge)
    text, gauge = view(senders=None, max_insiders=None)
    assert "no peer scheduled to send here yet" in text and math.isnan(gauge)
    text, gauge = view(robust=None, senders=None, max_insiders=None)  # a daemon of an earlier version
    assert "robust on" not in text and "robust off" not in text and math.isnan(gauge)
