"""The peer daemon: one asyncio loop tying trainer, gossip engine, transport, discovery, status and checkpoints.

Round loop (DESIGN.md 2), asynchronous and barrier-free:
    train H local steps (worker thread)  ->  choose out-neighbours from the live set (topology schedule)
    ->  engine.send_round over the edges that are connected and idle (worker thread: compression)
    ->  hand each message to its edge's stream  ->  z <- x / w  ->  evaluate / checkpoint / status.
Messages from other peers are applied as they arrive, on the loop, under the same lock the trainer takes for its
optimizer step, exactly once (the transport's handshake settles every message whose ack was lost).

Shutdown (SIGTERM/SIGINT): finish the round, settle in-flight mass on every edge (ack or handshake), checkpoint,
deregister from mDNS (goodbye), stop the server, exit 0.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import signal
import socket
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from peer import checkpoint
from peer.config import NodeSpec, RunSpec
from peer.data import BatchLoader, DatasetSplits, load_dataset, skew_partition
from peer.evaluate import evaluate
from peer.gossip import ledger
from peer.gossip.engine import GossipInputError, OutMessage
from peer.gossip.topology import Topology
from peer.net.api import PROTOCOL_VERSION, EngineGate, Identity, model_from_bytes
from peer.net.accounting import LinkAccounting
from peer.net.client import EdgeSender, EdgeState, fetch_model
from peer.net.config import NetConfig
from peer.net.discovery import Discovery
from peer.net.server import PeerServer
from peer.status import ControlServer, Metrics, SystemdNotifier, build_status
from peer.worker import PeerWorker, build_peer_model

log = logging.getLogger(__name__)

CHECKPOINT_NAME = "checkpoint.pt"
PEER_ID_NAME = "peer_id"
CONTROL_SOCKET_NAME = "control.sock"


def default_state_dir() -> Path:
    """$STATE_DIRECTORY (systemd StateDirectory=), else ~/.local/state/lpdl-peer."""
    env = os.environ.get("STATE_DIRECTORY")
    if env:
        return Path(env.split(":")[0])
    return Path.home() / ".local" / "state" / "lpdl-peer"


def load_or_create_peer_id(state_dir: Path, wanted: str = "") -> str:
    """The peer's stable id: the configured one, else the one kept in the state directory, else a new one."""
    path = state_dir / PEER_ID_NAME
    if wanted:
        return wanted
    if path.exists():
        existing = path.read_text().strip()
        if existing:
            return existing
    peer_id = f"{socket.gethostname().split('.')[0][:24]}-{secrets.token_hex(3)}"
    path.write_text(peer_id + "\n")
    return peer_id


class NodeGate(EngineGate):
    """The engine gate whose Status RPC serves the whole daemon's status, and which refuses inbound edges while
    the peer is joining (a joiner replaces its model; mass received before that would be lost, so senders are
    refused and take their mass back)."""

    def __init__(self, node: "Node", *args: Any) -> None:
        super().__init__(*args)
        self._node = node
        self.accepting = False
        self._round_done = asyncio.Event()

    def round_finished(self) -> None:
        """Release the acks held back since the last round (called by the round loop and at shutdown)."""
        self._round_done.set()
        self._round_done = asyncio.Event()

    async def before_ack(self, sender_id: str) -> None:
        """Ack at this peer's next round boundary (at most half the sender's ack timeout later).

        Without this, a peer that pauses (evaluation, checkpoint, a slower CPU) receives many messages from a fast
        neighbour per own round: push-sum stays unbiased, but weights swing by orders of magnitude (measured
        w = 0.002 vs 1.998 between two daemons) and compressed gossip's replica error is amplified by each burst.
        """
        if self._node.stopping.is_set():
            return
        try:
            await asyncio.wait_for(self._round_done.wait(), self._node.net.ack_timeout_s / 2)
        except asyncio.TimeoutError:
            pass

    def answer_hello(self, sender_id: str, hello: ledger.Hello) -> ledger.HelloReply:
        if not self.accepting:
            raise GossipInputError("not_ready", "this peer is joining the fleet (pulling the model); retry shortly")
        return super().answer_hello(sender_id, hello)

    def status(self) -> dict[str, Any]:
        return self._node.status()

    def set_identity(self, identity: Identity) -> None:
        """Fill in the listen address once the server has bound its port (before discovery advertises it)."""
        self._identity = identity


class Node:
    """One peer daemon.

    Args:
        run: model / data / optimizer / gossip settings (must match the fleet's fingerprint and algorithm).
        node: daemon settings.
        net: transport timeouts and sizes.
        splits: dataset (loaded from ``run.data`` if None; tests pass a small one).
    """

    def __init__(self, run: RunSpec, node: NodeSpec, net: NetConfig | None = None,
                 splits: DatasetSplits | None = None) -> None:
        self.run_spec = run
        self.spec = node
        self.net = net or NetConfig()
        if node.threads:
            torch.set_num_threads(node.threads)
        self.state_dir = Path(node.state_dir) if node.state_dir else default_state_dir()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.peer_id = load_or_create_peer_id(self.state_dir, node.peer_id)
        self.device = torch.device(node.device)
        self.splits = splits if splits is not None else load_dataset(run.data.dataset, run.data.root)
        built = build_peer_model(run.model, self.splits, self.device, seed=run.data.seed)
        self.fingerprint = built.fingerprint
        self.precision = built.precision
        rank, total = node.shard_index
        shard = skew_partition(self.splits.train.labels.numpy(), total, run.data.skew, seed=run.data.seed)[rank]
        augment = self.splits.augment if run.data.augment is None else run.data.augment
        loader = BatchLoader(self.splits.train, shard, batch_size=run.data.batch_size, mean=self.splits.mean,
                             std=self.splits.std, augment=augment, drop_last=len(shard) >= run.data.batch_size,
                             seed=run.data.seed + 1000 + rank, device=self.device)
        self.lock = threading.Lock()
        self.worker = PeerWorker(self.peer_id, built.model, loader.stream(), len(loader), run.optim, run.gossip,
                                 seed=run.data.seed + rank, lock=self.lock)
        self.test_batches = list(BatchLoader(self.splits.test, batch_size=256, mean=self.splits.mean,
                                             std=self.splits.std, shuffle=False, device=self.device))
        g = run.gossip
        self.topology = Topology(kind=g.topology, rotating=g.rotating, k=g.k, seed=run.data.seed)
        self.links = LinkAccounting()
        self.round = 0
        self.started = time.time()
        self.last_eval: dict[str, float] = {}
        self.last_round_s = 0.0
        self.phase = "starting"
        self.divergences = 0
        self.edges: dict[str, EdgeSender] = {}
        self.stopping = asyncio.Event()
        self.server: PeerServer | None = None
        self.gate: NodeGate | None = None
        self.discovery: Discovery | None = None
        self.metrics = Metrics(self.peer_id)
        self.notifier = SystemdNotifier()
        self.control: ControlServer | None = None
        self._heartbeat: asyncio.Task | None = None
        self._static_refresh: asyncio.Task | None = None

    # --- identity / status -------------------------------------------------------------------------------------
    def identity(self, listen_addr: str = "") -> Identity:
        return Identity(peer_id=self.peer_id, protocol_version=PROTOCOL_VERSION, fingerprint=self.fingerprint,
                        fleet=self.spec.fleet, listen_addr=listen_addr, algorithm=self.run_spec.gossip.algorithm)

    def status(self) -> dict[str, Any]:
        """JSON-ready snapshot for `lpdl-peer status`, the Status RPC and metrics."""
        return build_status(self)

    # --- lifecycle ---------------------------------------------------------------------------------------------
    async def run(self) -> int:
        """Serve, train and gossip until stopped; returns the process exit code."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, self.request_stop, sig.name)
            except (NotImplementedError, RuntimeError):  # not the main thread (tests)
                pass
        try:
            await self._start()
            await self._loop()
            if self.last_eval.get("round") != self.round:
                await loop.run_in_executor(None, self._evaluate)  # the final model's accuracy, for status/summary
        finally:
            await self._shutdown()
        return 0

    def request_stop(self, why: str = "stop requested") -> None:
        if not self.stopping.is_set():
            log.info("%s: finishing the round, then settling and checkpointing", why)
            self.stopping.set()
            if self.gate is not None:
                self.gate.round_finished()

    async def _start(self) -> None:
        restored = self._restore()
        host = self.spec.listen.rpartition(":")[0]
        self.gate = NodeGate(self, self.worker.engine, self.identity(), self.lock)
        self.server = PeerServer(self.gate, self.net, self.links)
        port = await self.server.start(self.spec.listen)
        wildcard = host in ("0.0.0.0", "::", "[::]")
        advertise_host = self.spec.mdns_ip[0] if self.spec.mdns_ip else ("" if wildcard else host)
        self.gate.set_identity(self.identity(f"{advertise_host}:{port}" if advertise_host else f":{port}"))
        self.discovery = Discovery(self.gate.identity(), port, addresses=list(self.spec.mdns_ip) or None,
                                   static=self.spec.static_neighbors, mdns=self.spec.auto_discovery,
                                   config=self.net)
        await self.discovery.start()
        self.control = ControlServer(self.state_dir / CONTROL_SOCKET_NAME, self.status)
        await self.control.start()
        if self.spec.metrics_port:
            self.metrics.serve(self.spec.metrics_port, self.spec.metrics_host)
        if not restored:
            await self._join()
        self.gate.accepting = True
        self.phase = "training"
        self.notifier.ready(f"peer {self.peer_id} serving on port {port}")
        self._heartbeat = asyncio.get_running_loop().create_task(self._watchdog_heartbeat(), name="watchdog")
        log.info("peer %s ready: %s %s (%s), %s c=%s, fleet %s, port %d", self.peer_id, self.run_spec.model.name,
                 self.precision.backend, self.precision.reason, self.run_spec.gossip.algorithm,
                 self.run_spec.gossip.compression, self.spec.fleet, port)

    def _restore(self) -> bool:
        path = self.state_dir / CHECKPOINT_NAME
        if not path.exists():
            return False
        state = checkpoint.load(path, expected_fingerprint=self.fingerprint)
        with self.lock:
            self.worker.engine.load_state_dict(state["engine"])
            self.worker.optimizer.load_state_dict(state["optimizer"])
            self.worker.steps = int(state["steps"])
            self.round = int(state["round"])
            self.worker.engine.state.debias_into(self.worker.flat.z)
        log.info("restored checkpoint %s (round %d, w %.4f)", path, self.round, self.worker.engine.w)
        return True

    async def _join(self) -> None:
        """First start: pull the current de-biased model from a live neighbour, if one appears in time."""
        assert self.discovery is not None
        deadline = time.monotonic() + self.spec.join_wait_s
        while time.monotonic() < deadline and not self.discovery.peers():
            if self.spec.static_neighbors:
                await self.discovery.refresh_static()
            await asyncio.sleep(0.1)
        for peer_id, addr in sorted(self.discovery.peers().items()):
            try:
                data = await fetch_model(addr.address, self.fingerprint, self.peer_id, self.net, self.links, peer_id)
                self.worker.load_model_vector(model_from_bytes(data, self.worker.flat.layout.numel))
                log.info("joined: pulled the model of %s (%d bytes), starting with w = 1", peer_id, len(data))
                return
            except Exception as exc:  # any failure: try the next neighbour, else start from scratch
                log.warning("join: could not pull the model from %s at %s: %s", peer_id, addr.address, exc)
        log.info("join: no neighbour to pull a model from; starting from the initial model")

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while not self.stopping.is_set():
            if self.spec.max_rounds and self.round >= self.spec.max_rounds:
                log.info("reached max_rounds %d", self.spec.max_rounds)
                break
            if self.spec.exit_when_done and self.worker.epoch >= self.run_spec.optim.epochs:
                log.info("trained %.2f epochs: done", self.worker.epoch)
                break
            started = time.monotonic()
            await loop.run_in_executor(None, self.worker.train_steps, self.run_spec.gossip.local_steps)
            await self._gossip(loop)
            self.worker.end_round()
            self.round += 1
            self.gate.round_finished()
            if self.round % self.spec.eval_every == 0:
                await loop.run_in_executor(None, self._evaluate)
            if self.round % self.spec.checkpoint_every == 0:
                await loop.run_in_executor(None, self._checkpoint)
            self.last_round_s = time.monotonic() - started
            self.metrics.update(self.status())
            self._refresh_static()
            spare = self.spec.round_interval_s - (time.monotonic() - started)
            if spare > 0:
                try:
                    await asyncio.wait_for(self.stopping.wait(), spare)
                except asyncio.TimeoutError:
                    pass
            else:
                await asyncio.sleep(0)  # let the transport run between rounds

    async def _gossip(self, loop: asyncio.AbstractEventLoop) -> None:
        assert self.discovery is not None
        live = self.discovery.peers()
        for peer_id, addr in live.items():
            edge = self.edges.get(peer_id)
            if edge is None or (edge.address != addr.address and edge.state is EdgeState.DOWN):
                if edge is not None:
                    await edge.close()
                self.edges[peer_id] = edge = EdgeSender(self.gate, peer_id, addr.address, self.net, self.links)
                edge.start()
        await self._close_departed_edges(live)
        out = self.topology.out_neighbours([*live, self.peer_id], self.peer_id, self.round)
        ready = [p for p in out if self.edges[p].ready]
        if not ready:
            return
        messages = await loop.run_in_executor(None, self._send_round, out, ready)
        for msg in messages:
            await self.edges[msg.receiver].submit(msg)

    async def _close_departed_edges(self, live: dict) -> None:
        """Stop reconnecting to peers that left the live set (goodbye or expiry), once nothing is in flight to them;
        an edge still carrying mass keeps trying, so the handshake can settle it if the peer comes back."""
        for peer_id in [p for p in self.edges if p not in live and not self.worker.engine.busy(p)]:
            edge = self.edges.pop(peer_id)
            await edge.close()
            log.info("peer %s left the live set: edge closed", peer_id)

    def _send_round(self, out: list[str], ready: list[str]) -> list[OutMessage]:
        """engine.send_round over the ready edges, with the share of the full out-set (column-stochastic)."""
        unavailable = [p for p in out if p not in ready]
        with self.lock:
            if not bool(torch.isfinite(self.worker.engine.x).all()):
                self._diverged()
                return []
            return self.worker.engine.send_round(out, self.round, unavailable=unavailable)

    def _diverged(self) -> None:
        """The local model went NaN/Inf (lr too high for this w, bad data): never gossip it; roll back to the last
        checkpoint if there is one (caller holds the lock)."""
        log.error("local model is not finite (loss %s): not gossiping it", self.worker.last_loss)
        self.divergences += 1
        path = self.state_dir / CHECKPOINT_NAME
        if path.exists():
            state = checkpoint.load(path, expected_fingerprint=self.fingerprint)
            self.worker.engine.state.x.copy_(state["engine"]["x"] * (self.worker.engine.w / state["engine"]["w"]))
            self.worker.optimizer.buf.zero_()
            self.worker.engine.state.debias_into(self.worker.flat.z)
            log.error("rolled the model back to checkpoint %s (round %d), keeping w", path, state["round"])

    def _evaluate(self) -> None:
        loss, acc = evaluate(self.worker.model, self.test_batches)
        self.last_eval = {"round": self.round, "epoch": self.worker.epoch, "test_loss": loss, "test_acc": acc}
        log.info("round %d epoch %.2f: train loss %.4f, test acc %.2f%%, w %.4f", self.round, self.worker.epoch,
                 self.worker.last_loss, acc * 100, self.worker.engine.w)

    def _checkpoint(self) -> None:
        with self.lock:
            state = {"fingerprint": self.fingerprint, "peer_id": self.peer_id, "round": self.round,
                     "steps": self.worker.steps, "engine": _clone(self.worker.engine.state_dict()),
                     "optimizer": _clone(self.worker.optimizer.state_dict()),
                     "buffers": _clone(dict(self.worker.model.named_buffers())),
                     "spec": asdict(self.run_spec)}
        checkpoint.save_atomic(state, self.state_dir / CHECKPOINT_NAME)

    async def _watchdog_heartbeat(self) -> None:
        """Ping systemd's watchdog from the event loop, independent of round length (an evaluation or a slow round
        must not get the service killed; a wedged loop must)."""
        interval = self.notifier.watchdog_interval_s()
        if interval is None:
            return
        while not self.stopping.is_set():
            self.notifier.watchdog(f"round {self.round} epoch {self.worker.epoch:.2f} loss {self.worker.last_loss:.4f}")
            try:
                await asyncio.wait_for(self.stopping.wait(), interval)
            except asyncio.TimeoutError:
                pass

    def _refresh_static(self) -> None:
        """Re-identify static neighbours in the background: every round while some are still unknown (a fleet
        started together finds each other within a round or two), then every 20 rounds (keeps them alive)."""
        if self.discovery is None or not self.spec.static_neighbors:
            return
        if self._static_refresh is not None and not self._static_refresh.done():
            return
        missing = len(self.discovery.peers()) < len(self.spec.static_neighbors)
        if missing or self.round % 20 == 0:
            self._static_refresh = asyncio.get_running_loop().create_task(self.discovery.refresh_static())

    async def _shutdown(self) -> None:
        self.phase = "stopping"
        self.notifier.stopping()
        for task in (self._heartbeat, self._static_refresh):
            if task is not None:
                task.cancel()
        await asyncio.gather(*(edge.close() for edge in self.edges.values()), return_exceptions=True)
        if self.server is not None:
            # Stop inbound gossip BEFORE the final checkpoint: a message applied (and acked) after it would be lost
            # with the process, taking its sender's mass with it (measured: sum w 3 -> 2.32 over two clean
            # restarts of a 3-peer fleet). New edges are refused; open streams get the server's grace period.
            if self.gate is not None:
                self.gate.accepting = False
            await self.server.stop()
            await asyncio.get_running_loop().run_in_executor(None, self._checkpoint)
        if self.discovery is not None:
            await self.discovery.close()
        if self.control is not None:
            await self.control.close()
        self.metrics.close()
        self.phase = "stopped"
        log.info("peer %s stopped after %d rounds (w %.4f)", self.peer_id, self.round, self.worker.engine.w)


def _clone(obj: Any) -> Any:
    """Deep-copy tensors so a checkpoint written outside the lock is a consistent snapshot."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_clone(v) for v in obj)
    return obj
