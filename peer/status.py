"""What a running peer shows: the status snapshot, the local control socket, Prometheus metrics, systemd notify.

The snapshot is one JSON-ready dict (schema below) served three ways: the control socket (``lpdl-peer status``), the
Status RPC (``lpdl-peer status --peer host:port``) and, as gauges and counters, the Prometheus exporter.

    peer_id, fleet, phase, uptime_s, round, epoch, lr, loss, eval {round, epoch, test_loss, test_acc}, w,
    precision {requested, backend, reason}, gossip {algorithm, compression, bits, gamma, topology},
    last_round_s, neighbours {peer_id: {address, state, bytes_sent, bytes_received, rtt_s, last_seen, ...}},
    refused {reason: count}, dropped {reason: count}, applied
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

if TYPE_CHECKING:
    from peer.node import Node

log = logging.getLogger(__name__)

#: How long a status request on the control socket may take before the daemon drops the client (seconds).
CONTROL_TIMEOUT_S = 5.0


def build_status(node: "Node") -> dict[str, Any]:
    """Snapshot of a node (cheap: no tensor work beyond reading w)."""
    g = node.run_spec.gossip
    server = node.server.snapshot() if node.server is not None else {"links": {}, "refused": {}, "dropped": {},
                                                                       "applied": 0}
    live = node.discovery.peers() if node.discovery is not None else {}
    neighbours: dict[str, dict[str, Any]] = {}
    for peer_id in sorted(set(live) | set(node.edges) | set(server["links"])):
        link = server["links"].get(peer_id, {})
        edge = node.edges[peer_id].snapshot() if peer_id in node.edges else {}
        neighbours[peer_id] = {
            "address": live[peer_id].address if peer_id in live else edge.get("address", ""),
            "live": peer_id in live,
            "state": edge.get("state", "inbound-only" if link else "known"),
            "bytes_sent": link.get("bytes_sent", 0),
            "bytes_received": link.get("bytes_received", 0),
            "rtt_s": edge.get("ack_rtt_s") or edge.get("hello_rtt_s"),
            "last_seen": max(link.get("last_seen", 0.0), edge.get("last_seen", 0.0)),
            "delivered": edge.get("delivered", 0),
            "settled": edge.get("settled", {}),
            "last_error": edge.get("last_error", ""),
        }
    return {
        "peer_id": node.peer_id,
        "fleet": node.spec.fleet,
        "phase": node.phase,
        "uptime_s": time.time() - node.started,
        "round": node.round,
        "epoch": node.worker.epoch,
        "lr": node.worker.lr(),
        "loss": node.worker.last_loss,
        "eval": dict(node.last_eval),
        "w": node.worker.engine.w,
        "precision": {"requested": node.run_spec.model.precision, "backend": node.precision.backend,
                      "reason": node.precision.reason},
        "model": {"name": node.run_spec.model.name, "fingerprint": node.fingerprint},
        "gossip": {"algorithm": g.algorithm, "compression": g.compression, "bits": g.bits, "gamma": g.effective_gamma,
                   "topology": g.topology + (" rotating" if g.rotating else "")},
        "last_round_s": node.last_round_s,
        "neighbours": neighbours,
        "refused": server["refused"],
        "dropped": server["dropped"],
        "applied": server["applied"],
    }


class ControlServer:
    """Local control socket: a client connects, the daemon writes one JSON status document and closes.

    A Unix socket in the state directory (mode 0660) so only the service user (and its group) can read it.
    """

    def __init__(self, path: Path, snapshot: Callable[[], dict[str, Any]]) -> None:
        self.path = path
        self.snapshot = snapshot
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        self.path.unlink(missing_ok=True)
        self._server = await asyncio.start_unix_server(self._serve, path=str(self.path))
        os.chmod(self.path, 0o660)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await asyncio.wait_for(reader.readline(), CONTROL_TIMEOUT_S)
            writer.write(json.dumps(self.snapshot(), default=str).encode() + b"\n")
            await asyncio.wait_for(writer.drain(), CONTROL_TIMEOUT_S)
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


class Metrics:
    """Prometheus metrics of one peer, on a private registry (so several peers can live in one test process)."""

    def __init__(self, peer_id: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"registry": self.registry}
        self.round = Gauge("lpdl_round", "Gossip rounds completed", **labels)
        self.epoch = Gauge("lpdl_epoch", "Epochs of the local shard trained", **labels)
        self.loss = Gauge("lpdl_train_loss", "Mean training loss of the last round", **labels)
        self.accuracy = Gauge("lpdl_test_accuracy", "Last test accuracy of the local de-biased model (0..1)",
                              **labels)
        self.weight = Gauge("lpdl_pushsum_weight", "Push-sum weight w", **labels)
        self.round_seconds = Gauge("lpdl_round_seconds", "Wall time of the last round (s)", **labels)
        self.bytes_sent = Counter("lpdl_link_sent_bytes", "Bytes sent per neighbour", ["neighbour"], **labels)
        self.bytes_received = Counter("lpdl_link_received_bytes", "Bytes received per neighbour", ["neighbour"],
                                      **labels)
        self.refused = Counter("lpdl_refused_inputs", "Refused inputs by reason", ["reason"], **labels)
        self._seen: dict[tuple[str, str], float] = {}
        self._http = None

    def serve(self, port: int, host: str = "127.0.0.1") -> None:
        """Start the HTTP exporter (prometheus_client's own server thread)."""
        self._http = start_http_server(port, addr=host, registry=self.registry)
        log.info("metrics on http://%s:%d/metrics", host, port)

    def update(self, status: dict[str, Any]) -> None:
        """Refresh from a status snapshot (counters advance by the difference since the last update)."""
        self.round.set(status["round"])
        self.epoch.set(status["epoch"])
        self.loss.set(status["loss"])
        self.weight.set(status["w"])
        self.round_seconds.set(status["last_round_s"])
        if status["eval"]:
            self.accuracy.set(status["eval"]["test_acc"])
        for peer_id, n in status["neighbours"].items():
            self._advance(self.bytes_sent, ("sent", peer_id), n["bytes_sent"], peer_id)
            self._advance(self.bytes_received, ("received", peer_id), n["bytes_received"], peer_id)
        for reason, count in status["refused"].items():
            self._advance(self.refused, ("refused", reason), count, reason)

    def _advance(self, counter: Counter, key: tuple[str, str], total: float, label: str) -> None:
        delta = total - self._seen.get(key, 0.0)
        if delta > 0:
            counter.labels(label).inc(delta)
            self._seen[key] = total

    def close(self) -> None:
        if self._http is not None:
            server, thread = self._http
            server.shutdown()
            thread.join(timeout=2.0)
            self._http = None


class SystemdNotifier:
    """sd_notify READY / WATCHDOG / STOPPING / STATUS when run under systemd (Type=notify); no-op otherwise."""

    def __init__(self) -> None:
        self._notifier = None
        if os.environ.get("NOTIFY_SOCKET"):
            import sdnotify
            self._notifier = sdnotify.SystemdNotifier()

    def _send(self, text: str) -> None:
        if self._notifier is not None:
            self._notifier.notify(text)

    def ready(self, status: str) -> None:
        self._send(f"READY=1\nSTATUS={status}")

    def watchdog(self, status: str) -> None:
        self._send(f"WATCHDOG=1\nSTATUS={status}")

    def stopping(self) -> None:
        self._send("STOPPING=1")

    def watchdog_interval_s(self) -> float | None:
        """Half of systemd's WatchdogSec (from WATCHDOG_USEC), or None when no watchdog is armed."""
        usec = os.environ.get("WATCHDOG_USEC")
        if self._notifier is None or not usec or not usec.isdigit():
            return None
        return int(usec) / 2e6
