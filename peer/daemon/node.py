"""The peer daemon's lifecycle: start, join, the loop that calls the runtime's round, shutdown.

    start     restore the checkpoint (or join: pull a neighbour's model), serve gRPC, advertise on mDNS, open the
              control socket and metrics, tell systemd READY
    loop      live set -> edge table -> run_round (worker thread: train, encode; lock held only to plan / commit)
              -> round boundary (release paced acks) -> a few test batches of a running evaluation (one begins
              every N rounds) / checkpoint / metrics
    shutdown  (SIGTERM/SIGINT) finish the round, settle every in-flight message (ack or handshake) within
              net.close_timeout_s and log which way each went, stop inbound gossip, checkpoint, deregister, exit 0

Everything else lives in its own room: assembly and the round in peer/runtime, the transport in peer/net, the status
document in peer/daemon/status.py, state-dir names in peer/daemon/paths.py.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from peer.aio import cancel_and_wait
from peer.daemon.config import DaemonConfig
from peer.daemon.control import ControlServer
from peer.daemon.durability import CheckpointKeeper
from peer.daemon.evaluator import Finished, SpreadEvaluator
from peer.daemon.gate import PeerGate
from peer.daemon.join import JOIN_SOURCES, choose_model
from peer.daemon.memory import MemoryStages
from peer.daemon.metrics import Metrics
from peer.daemon.paths import (
    CHECKPOINT_NAME,
    CONTROL_SOCKET_NAME,
    PREVIOUS_CHECKPOINT_NAME,
    TLS_DIR_NAME,
    default_state_dir,
    load_or_create_peer_id,
    stored_peer_id,
)
from peer.daemon.kinds import ExitCode, Phase
from peer.daemon.pace import NeighbourPace, PacedTransport
from peer.daemon.status import PrecisionStatus, Progress, StatusDocument, build_status
from peer.daemon.systemd import SystemdNotifier
from peer.data import DatasetSplits
from peer.heap import trim_heap
from peer.net.accounting import LinkAccounting
from peer.net.api import PROTOCOL_VERSION, Identity, model_from_bytes
from peer.net.client import describe_rpc_error, fetch_model
from peer.net.discovery import Discovery
from peer.net.limits import CallerBuckets
from peer.net.server import PeerServer
from peer.net.snapshots import ServerSnapshot
from peer.net.transport import GrpcTransport
from peer.runtime import state
from peer.runtime.build import build_peer, build_peer_model, eval_loader, load_splits
from peer.gossip.consensus import PhaseName
from peer.gossip.reach import describe
from peer.runtime.consensus import run_peer_round
from peer.runtime.round import PeerDiverged
from peer.security.credentials import TlsConfigError, TransportSecurity

log = logging.getLogger(__name__)

#: Seconds a daemon in a consensus phase waits before trying again when no out-neighbour could take a message
#: (acks come at the neighbours' round boundaries, tens of ms apart; peer/runtime/consensus.py).
CONSENSUS_WAIT_S = 0.01

#: Attempts at the final checkpoint on shutdown, and seconds between them (a transient I/O error must not lose it).
SHUTDOWN_CHECKPOINT_ATTEMPTS = 3
SHUTDOWN_CHECKPOINT_RETRY_S = 1.0


def _raise_open_files_limit() -> None:
    """Raise the soft open-files limit to the hard one: gRPC needs a descriptor per connection, and running out
    must refuse connections (net.max_connections), not fail a checkpoint (systemd's LimitNOFILE sets the hard one)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


class Node:
    """One peer daemon.

    Args:
        config: the run (model / data / optimizer / gossip: must match the fleet's fingerprint and algorithm), the
            daemon's own settings and the transport's timeouts and sizes, loaded and validated once.
        splits: dataset (loaded from ``config.run.data`` if None; tests pass a small one).
    """

    def __init__(self, config: DaemonConfig, splits: DatasetSplits | None = None) -> None:
        self.memory = MemoryStages()
        self.memory.mark("imports")
        run = self.run_spec = config.run
        node = self.spec = config.node
        self.net = config.net
        if node.threads:
            torch.set_num_threads(node.threads)
        self.state_dir = Path(node.state_dir) if node.state_dir else default_state_dir()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.security = self._security()
        cert = self.security.identity
        # with TLS the certificate names the peer; an id kept in the state directory or given must agree with it
        self.peer_id = load_or_create_peer_id(self.state_dir, node.peer_id) if cert is None else \
            (node.peer_id or stored_peer_id(self.state_dir) or cert.name)
        if cert is not None and cert.name != self.peer_id:
            raise TlsConfigError(f"TLS certificate in {self.security.tls_dir} is for peer {cert.name!r}, this peer "
                                 f"is {self.peer_id!r} (issue one with `lpdl-peer ca issue --name {self.peer_id}`)")
        self.device = torch.device(node.device)
        splits = splits if splits is not None else load_splits(run.data)
        self.memory.mark("dataset")
        built = build_peer_model(run.model, splits, self.device, seed=run.data.seed)
        self.fingerprint = built.fingerprint
        self.precision = built.precision
        self.model_info = built.info()
        self.model_status = {"fingerprint": built.fingerprint, "source": built.source.ref,
                             "source_kind": built.source.kind, **built.layer_report()}
        trim_heap()  # the probe's and the dataset decode's transients
        self.memory.mark("model")
        self.peer = build_peer(run, self.peer_id, node.shard_index, splits, self.device, built,
                               max_peers=self.net.max_peers)
        # the full training split is not kept (the peer has its shard); evaluation reuses the training shapes, on
        # the built model (the peer trains its own copy), which holds each evaluation's snapshot
        self.evaluator = SpreadEvaluator(self.peer, built.model,
                                         eval_loader(splits, self.device, batch_size=run.data.batch_size))
        self.memory.mark("peer")
        self.progress = Progress()
        self.links = LinkAccounting()
        self.stopping = asyncio.Event()
        self.pace = NeighbourPace(node.max_unacked, node.pace_wait_s)
        self.gate = PeerGate(self.peer, self.identity(), self.status_json, ack_delay_cap_s=self.net.ack_timeout_s / 2,
                             update_rates=CallerBuckets(self.net.max_updates_per_s, self.net.update_burst,
                                                        self.net.max_peers), pace=self.pace)
        self._checkpoint_due = False
        self.keeper = CheckpointKeeper(self.checkpoint_path, self.previous_checkpoint_path, self._write_checkpoint)
        self.server: PeerServer | None = None
        self.transport: GrpcTransport | None = None
        self.paced: PacedTransport | None = None  # the transport the rounds send through (peer/daemon/pace.py)
        self.discovery: Discovery | None = None
        self.control: ControlServer | None = None
        self.metrics = Metrics(self.peer_id)
        self.notifier = SystemdNotifier()
        #: The one thread that trains, evaluates and checkpoints (tensor work off the event loop). One thread, not a
        #: pool: each thread that allocates keeps its own malloc arena and tensor caches (~80 MiB for mnist-cnn).
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lpdl-train")
        self._tasks: list[asyncio.Task] = []
        self.exit_code = ExitCode.CLEAN

    @property
    def checkpoint_path(self) -> Path:
        return self.state_dir / CHECKPOINT_NAME

    @property
    def previous_checkpoint_path(self) -> Path:
        return self.state_dir / PREVIOUS_CHECKPOINT_NAME

    @property
    def checkpoint_errors(self) -> int:
        """Checkpoint writes that failed so far (disk full, I/O errors)."""
        return self.keeper.errors

    def _security(self) -> TransportSecurity:
        """Mutual TLS from the TLS directory (default), or the explicit, loudly logged insecure mode."""
        if self.spec.insecure:
            log.warning("INSECURE MODE: no TLS; any host that reaches port %s can gossip as any peer id, pull the "
                        "model and read status. Use only in an isolated lab.", self.spec.listen.rpartition(":")[2])
            return TransportSecurity.insecure(self.spec.fleet)
        tls_dir = Path(self.spec.tls_dir) if self.spec.tls_dir else self.state_dir / TLS_DIR_NAME
        return TransportSecurity.from_dir(tls_dir, self.spec.fleet)

    def identity(self, listen_addr: str = "") -> Identity:
        return Identity(peer_id=self.peer_id, protocol_version=PROTOCOL_VERSION, fingerprint=self.fingerprint,
                        fleet=self.spec.fleet, listen_addr=listen_addr, algorithm=self.run_spec.gossip.algorithm)

    def live(self) -> dict[str, str]:
        """The live peer set, ``peer_id -> host:port``; a device the revocation list names is not in it (its edge
        closes at the next round, its inbound stream is cut by the server's revocation watch)."""
        return {} if self.discovery is None else {p: a.address for p, a in self.discovery.peers().items()
                                                  if not self.security.peer_revoked(p)}

    def status(self) -> StatusDocument:
        """The status document (peer/daemon/status.py) for metrics and, as JSON, the control socket and the Status
        RPC."""
        server = self.server.snapshot() if self.server is not None else ServerSnapshot()
        precision = PrecisionStatus(requested=self.run_spec.model.precision, backend=self.precision.backend,
                                    reason=self.precision.reason)
        document = build_status(peer=self.peer, spec=self.run_spec, fleet=self.spec.fleet, model=self.model_status,
                                precision=precision, progress=self.progress, live=self.live(),
                                edges=self.transport.snapshot() if self.transport is not None else {},
                                server=server, memory=self.memory.snapshot())
        return replace(document, storage=self.keeper.snapshot(self.gate.paused))

    def status_json(self) -> dict[str, Any]:
        """:meth:`status` as the JSON the control socket and the Status RPC send."""
        return self.status().to_json()

    # --- lifecycle ---------------------------------------------------------------------------------------------
    def release(self, neighbour: str) -> dict[str, Any]:
        """Operator release of a quarantined neighbour (``lpdl-peer release``): its messages are taken again and
        it is sent to again, its anomaly score starting from zero."""
        released = self.peer.release(neighbour)
        if released:
            log.warning("neighbour %s released from quarantine by the operator", neighbour)
        return {"peer_id": self.peer.peer_id, "neighbour": neighbour, "released": released,
                "quarantined": sorted(self.peer.quarantined())}

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
            self.gate.stopping = True  # no more rounds: take in no more mass (see _shutdown)
            # the final model's accuracy, for the summary
            await loop.run_in_executor(self.worker, self._evaluate_final)
        finally:
            await self._shutdown()
        return self.exit_code

    def request_stop(self, why: str = "stop requested") -> None:
        if not self.stopping.is_set():
            log.info("%s: finishing the round, then settling and checkpointing", why)
            self.stopping.set()
            self.gate.round_finished()

    async def _start(self) -> None:
        _raise_open_files_limit()
        restored = await asyncio.get_running_loop().run_in_executor(self.worker, self._restore)
        if not await asyncio.get_running_loop().run_in_executor(self.worker, self.keeper.check_room):
            # no room to persist what gossip would move: start paused, retry the checkpoint every round
            self.gate.paused = f"no room in {self.state_dir} for the checkpoint reserve and the next checkpoint"
            self._checkpoint_due = True
            log.error("gossip paused: %s; training goes on, no mass moves until a checkpoint is written",
                      self.gate.paused)
        host = self.spec.listen.rpartition(":")[0]
        self.server = PeerServer(self.gate, self.net, self.links, security=self.security)
        self.peer.certificate_serial = self.server.serials.get  # named by the round's quarantine log line
        port = await self.server.start(self.spec.listen)
        wildcard = host in ("0.0.0.0", "::", "[::]")
        advertise_host = self.spec.mdns_ip[0] if self.spec.mdns_ip else ("" if wildcard else host)
        self.gate.set_identity(self.identity(f"{advertise_host}:{port}" if advertise_host else f":{port}"))
        self.transport = GrpcTransport(self.gate, self.net, self.links, asyncio.get_running_loop(),
                                       security=self.security)
        self.paced = PacedTransport(self.transport, self.peer.in_flight_count, self.spec.max_unacked)
        self.discovery = Discovery(self.gate.identity(), port, addresses=list(self.spec.mdns_ip) or None,
                                   static=self.spec.static_neighbors, mdns=self.spec.auto_discovery,
                                   config=self.net, security=self.security,
                                   heard=lambda peer_id: self.links.get(peer_id).last_seen)
        await self.discovery.start()
        self.control = ControlServer(self.state_dir / CONTROL_SOCKET_NAME, self.status_json, release=self.release)
        await self.control.start()
        if self.spec.metrics_port:
            self.metrics.serve(self.spec.metrics_port, self.spec.metrics_host)
        self.memory.mark("network")
        if not restored:
            await self._join()
        self.gate.accepting = True
        self.progress.phase = Phase.TRAINING
        self.notifier.ready(f"peer {self.peer_id} serving on port {port}")
        self._tasks.append(asyncio.get_running_loop().create_task(self._watchdog_heartbeat(), name="watchdog"))
        log.info("peer %s ready: %s %s (%s), %s c=%s window %d, fleet %s, port %d", self.peer_id,
                 self.run_spec.model.name, self.precision.backend, self.precision.reason,
                 self.run_spec.gossip.algorithm, self.run_spec.gossip.compression, self.run_spec.gossip.window,
                 self.spec.fleet, port)
        if self.model_status.get("layers"):
            log.info("model %s converted for %s:\n%s", self.model_status["source"], self.precision.backend,
                     self.model_status["layers"])

    def _restore(self) -> bool:
        """Restore the newest readable checkpoint (the previous one if the newest is torn or corrupt); a temporary
        file an interrupted write left is removed first. Raises CheckpointError if checkpoints exist and none is
        readable: starting over would silently drop this peer's weight from the fleet."""
        for stale in state.remove_stale_temps(self.checkpoint_path):
            log.warning("removed %s, left by an interrupted checkpoint write", stale)
        if not self.checkpoint_path.exists() and not self.previous_checkpoint_path.exists():
            return False
        saved, used, problems = state.load_newest(self.checkpoint_path, self.previous_checkpoint_path,
                                                  self.fingerprint, max_weight=self.net.max_peers)
        for problem in problems:
            log.error("%s; falling back to %s", problem, used)
        self.progress.round = state.restore(self.peer, saved)
        log.info("restored checkpoint %s (round %d, w %.4f)", used, self.progress.round, self.peer.engine.w)
        return True

    async def _join(self) -> None:
        """First start: pull the current de-biased model from up to JOIN_SOURCES live neighbours, if any appears in
        time, and start from the one peer/daemon/join.py chooses (finite, within the fleet's norms, the medoid)."""
        assert self.discovery is not None
        deadline = time.monotonic() + self.spec.join_wait_s
        while time.monotonic() < deadline and not self.discovery.peers():
            if self.spec.static_neighbors:
                await self.discovery.refresh_static()
            await asyncio.sleep(0.1)
        pulled: dict[str, torch.Tensor] = {}
        for peer_id, address in sorted(self.live().items()):
            if len(pulled) >= JOIN_SOURCES:
                break
            try:
                data = await fetch_model(address, self.fingerprint, self.peer_id, self.net, self.links, peer_id,
                                         security=self.security)
                pulled[peer_id] = model_from_bytes(data, self.peer.flat.layout.numel)
            except Exception as exc:  # noqa: BLE001 - any failure: try the next neighbour, else start from scratch
                log.warning("join: could not pull the model from %s at %s: %s", peer_id, address,
                            describe_rpc_error(exc))
        if not pulled:
            log.info("join: no neighbour to pull a model from; starting from the initial model")
            return
        choice = choose_model(pulled, self.peer.model_vector())
        for peer_id, why in choice.refused.items():
            log.warning("join: the model pulled from %s is refused: %s", peer_id, why)
        if choice.chosen is None:
            log.warning("join: every pulled model was refused; starting from the initial model")
            return
        self.peer.load_model_vector(pulled[choice.chosen])
        log.info("joined: pulled the model of %s (%d bytes), chosen of %d pulled (%s); starting with w = 1",
                 choice.chosen, 4 * pulled[choice.chosen].numel(), len(pulled), ", ".join(sorted(pulled)))

    async def _loop(self) -> None:
        assert self.transport is not None and self.paced is not None
        loop = asyncio.get_running_loop()
        g = self.run_spec.gossip
        while not self.stopping.is_set():
            if self.spec.max_rounds and self.progress.round >= self.spec.max_rounds:
                log.info("reached max_rounds %d", self.spec.max_rounds)
                break
            if self.spec.exit_when_done and self._done():
                log.info("trained %.2f epochs%s: done", self.peer.epoch,
                         "" if self.peer.consensus_settings is None else ", consensus phase ended")
                break
            started = time.monotonic()
            live = self.live()
            self.transport.sync(live)
            await self._forget_departed(live)
            try:
                # paused (the state directory cannot take a checkpoint): train on, keep the mass; a consensus
                # phase, which only gossips, waits (begun or due)
                paused = self.gate.paused is not None
                gossip_only = self.peer.consensus is not None or (self.peer.consensus_settings is not None
                                                                  and self.peer.epoch >= self.run_spec.optim.epochs)
                # unpaced (node.max_unacked 0): nothing to wait for; a consensus phase paces itself (consensus.py)
                if self.pace.max_unacked and not (paused or gossip_only):
                    await self._keep_pace(live)
                result = None if paused and gossip_only else await loop.run_in_executor(
                    self.worker, run_peer_round, self.peer, self.paced, [] if paused else list(live),
                    self.progress.round, g.local_steps, self.run_spec.optim.epochs)
            except PeerDiverged as exc:
                # the round already rolled the model back to its last good snapshot: stop cleanly (settle,
                # checkpoint that model, deregister) and exit non-zero so a supervisor sees it
                log.error("%s; stopping", exc)
                self.exit_code = ExitCode.DIVERGED
                break
            if result is None:  # converged (serving only), a phase ended, or the phase waits for a neighbour's ack
                self.gate.round_finished()  # release the acks held for this boundary: a waiting neighbour waits on them
                self.metrics.update(self.status())
                if self.peer.phase is PhaseName.CONVERGED and not self.spec.exit_when_done:
                    await self._serve_converged()
                else:
                    await asyncio.sleep(CONSENSUS_WAIT_S)
                continue
            self.progress.round += 1
            self.gate.round_finished()
            self._report_reach()
            due = self.progress.round % self.spec.eval_every == 0
            if due or self.evaluator.running:
                await loop.run_in_executor(self.worker, self._evaluation_step, due)
            if self.progress.round % self.spec.checkpoint_every == 0 or self._checkpoint_due:
                await self._persist()
            self.progress.last_round_s = time.monotonic() - started
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

    async def _keep_pace(self, live: dict[str, str]) -> None:
        """Wait (at most node.pace_wait_s) for the live neighbours this peer has node.max_unacked messages
        unacknowledged to (peer/daemon/pace.py); log the ones given up on."""
        receivers = set(live) - self.peer.quarantined()
        waited = await self.pace.wait(lambda: {r: self.peer.in_flight_count(r) for r in receivers}, receivers,
                                     self.gate.wait_between_rounds)
        self.progress.pace_wait_s = self.pace.waited_s_total
        self.progress.not_waited_for = sorted(self.pace.exempt)
        for receiver in waited.given_up:
            log.info("round %d: %s acknowledged nothing in %.1f s with %d messages unacknowledged; not waiting for "
                     "it again until it does", self.progress.round, receiver, self.pace.wait_s,
                     self.peer.in_flight_count(receiver))

    def _done(self) -> bool:
        """Training ended, and the final consensus phase too where one is configured."""
        if self.peer.epoch < self.run_spec.optim.epochs:
            return False
        return self.peer.consensus_settings is None or self.peer.phase is PhaseName.CONVERGED

    async def _serve_converged(self) -> None:
        """After the final consensus phase: keep serving (neighbours still in their phase send to this peer and
        pull its model) and send nothing, until stopped."""
        log.info("converged: serving neighbours, sending nothing until stopped")
        self.gate.stop_pacing()  # no more round boundaries here: acknowledge at once
        await self.stopping.wait()

    async def _forget_departed(self, live: dict[str, str]) -> None:
        """Peers that left the live set: close their edge once nothing is in flight to them, then drop the state
        kept for them (out-edge, Choco replicas, link counters) once they no longer stream to us either - memory
        and checkpoints stay bounded under churn. Tried every round, so a peer forgotten late (its stream was still
        open, or it only ever sent to us) is not kept forever. Its inbound ledger stays (two ints): if it returns,
        its handshake finds what was applied (GossipEngine.forget_peer)."""
        assert self.transport is not None and self.server is not None
        await self.transport.close_departed(live)
        for peer_id in self.peer.known_peers() - set(live) - set(self.transport.edges):
            if not self.server.streaming_from(peer_id) and self.peer.forget(peer_id):
                self.links.forget(peer_id)
                self.metrics.forget(peer_id)
                log.info("peer %s forgotten (edge state, replicas and link counters dropped)", peer_id)

    def _evaluation_step(self, due: bool) -> None:
        """After a round, on the worker: snapshot the model for a new evaluation if one is ``due`` (finishing one
        still running first), and evaluate this round's batches of the running one (peer/daemon/evaluator.py)."""
        if due:
            self._record(self.evaluator.start(self.progress.round))
        self._record(self.evaluator.advance())

    def _evaluate_final(self) -> None:
        """The model at the end of the run, evaluated at once (what was running finished first); nothing new if the
        last evaluation was of this round."""
        self._record(self.evaluator.finish())
        if self.progress.last_eval is None or self.progress.last_eval.round != self.progress.round:
            self.evaluator.start(self.progress.round)
            self._record(self.evaluator.finish())

    def _record(self, finished: Finished | None) -> None:
        if finished is None:
            return
        self.progress.last_eval = e = finished.result
        # what the evaluation, a checkpoint's clones and the rounds since the last one freed goes back to the OS:
        # tcmalloc otherwise keeps every transient's pages (README fleet daemon's training stage: +88-110 -> +25-31
        # MiB; re-faulting the step's working set afterwards costs a few ms per evaluation period)
        trim_heap()
        self.memory.mark("training")  # steady state: rounds, gossip, checkpoints and an evaluation behind us
        log.info("round %d epoch %.2f: train loss %.4f, test acc %.2f%%, w %.4f", e.round, e.epoch,
                 finished.train_loss, e.test_acc * 100, finished.w)

    def _write_checkpoint(self) -> None:
        state.save(self.peer, self.checkpoint_path, self.progress.round, asdict(self.run_spec), self.fingerprint,
                   previous=self.previous_checkpoint_path,
                   info={**self.model_info,
                         "test_acc": None if self.progress.last_eval is None else self.progress.last_eval.test_acc})

    def _checkpoint(self) -> bool:
        """Write a checkpoint, keeping the previous one (worker thread). An I/O error (disk full, EMFILE, read-only
        remount) is logged and the write retried after the next round; it never stops the daemon. A state no healthy
        peer holds (non-finite, w out of bounds) is never written: the previous file stays. Returns success."""
        try:
            written = self.keeper.write()
        except state.CheckpointError as exc:
            log.error("%s; the previous checkpoint stays", exc)
            written = False
        self._checkpoint_due = not written or self.gate.paused is not None  # paused: retry every round
        return written

    async def _persist(self) -> bool:
        """Checkpoint; when the write fails, pause gossip (on the event loop, where messages are applied) and
        write the paused state into the reserve's space, so the file on disk holds this peer's mass exactly until
        the state directory has room again (peer/daemon/durability.py). Returns whether the checkpoint was written."""
        loop = asyncio.get_running_loop()
        written = await loop.run_in_executor(self.worker, self._checkpoint)
        if not written and self.keeper.failing_since is not None and self.gate.paused is None:
            self.gate.paused = f"checkpoint writes to {self.state_dir} fail: {self.keeper.last_error}"
            log.error("gossip paused: %s; training goes on, no mass moves until a checkpoint is written",
                      self.gate.paused)
            await loop.run_in_executor(self.worker, self.keeper.rescue)
        elif self.gate.paused is not None and self.keeper.healthy:
            log.warning("gossip resumed: checkpoints are written again")
            self.gate.paused = None
        return written

    async def _watchdog_heartbeat(self) -> None:
        """Ping systemd's watchdog from the event loop, independent of round length (an evaluation or a slow round
        must not get the service killed; a wedged loop must)."""
        interval = self.notifier.watchdog_interval_s()
        if interval is None:
            return
        while not self.stopping.is_set():
            self.notifier.watchdog(f"round {self.progress.round} epoch {self.peer.epoch:.2f} "
                                   f"loss {self.peer.last_loss:.4f}")
            try:
                await asyncio.wait_for(self.stopping.wait(), interval)
            except asyncio.TimeoutError:
                pass

    def _report_reach(self) -> None:
        """Log, when it changes, the most insiders within the honest spread this peer's senders let any local rule
        bound (peer/gossip/reach.py): none on a ring, one on the exponential graph from 5 peers."""
        change = self.peer.take_reach_change()
        if change is not None:
            log.info("peer %s %s", self.peer_id, describe(*change))

    def _refresh_static(self) -> None:
        """Re-identify static neighbours in the background every round while some are still unknown (a fleet
        started together finds each other within a round or two); discovery's liveness checks (every
        ``net.liveness_interval_s``) keep the known ones alive."""
        if self.discovery is None or not self.spec.static_neighbors:
            return
        if any(t.get_name() == "static-refresh" and not t.done() for t in self._tasks):
            return
        self._tasks = [t for t in self._tasks if not t.done()]
        if len(self.discovery.peers()) < len(self.spec.static_neighbors):
            self._tasks.append(asyncio.get_running_loop().create_task(self.discovery.refresh_static(),
                                                                      name="static-refresh"))

    async def _drain_inbound(self, timeout_s: float) -> None:
        """Keep serving after the goodbye until the neighbours have closed their streams to this peer (they stop
        sending once it leaves their live set and close an edge when nothing is in flight on it), at most
        ``timeout_s`` seconds, and until each sender refused since the last round has handshaked again: their last
        updates are refused and that handshake retracts them, instead of leaving them in flight to a peer that is
        gone."""
        server = self.server
        assert server is not None
        deadline = time.monotonic() + timeout_s
        while (server.open_streams() or self.gate.refusals_unsettled()) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if server.open_streams() or self.gate.refusals_unsettled():
            log.info("stopping with %d inbound stream(s) still open and %d sender(s) yet to settle a refused update "
                     "after %.1f s", server.open_streams(), self.gate.refusals_unsettled(), timeout_s)

    async def _shutdown(self) -> None:
        # From the last round on this peer sends nothing: what it took in now would be mass its neighbours never see
        # again until it is back (docs/decisions/daemon-lifecycle.md#a-stopping-peer-takes-in-no-mass)
        self.gate.stopping = True
        self.progress.phase = Phase.STOPPING
        self.notifier.stopping()
        await cancel_and_wait(self._tasks)
        self.gate.stop_pacing()
        if self.transport is not None:
            report = await self.transport.settle(2 * self.net.close_timeout_s + 1.0)
            level = logging.WARNING if report.pending else logging.INFO
            log.log(level, "in-flight updates settled on shutdown: %s", report.describe())
        if self.discovery is not None:
            await self.discovery.close()  # goodbye: neighbours drop this peer from their live sets
            if self.server is not None and self.spec.auto_discovery:
                await self._drain_inbound(self.net.drain_timeout_s)
        if self.server is not None:
            # Stop inbound gossip BEFORE the final checkpoint: a message applied (and acked) after it would be lost
            # with the process, taking its sender's mass with it
            # (docs/decisions/daemon-lifecycle.md#inbound-gossip-stops-before-the-final-checkpoint). New edges are
            # refused; open streams get the server's grace period.
            self.gate.accepting = False
            await self.server.stop()
            loop = asyncio.get_running_loop()
            for attempt in range(SHUTDOWN_CHECKPOINT_ATTEMPTS):
                if await loop.run_in_executor(self.worker, self._checkpoint):
                    break
                await asyncio.sleep(SHUTDOWN_CHECKPOINT_RETRY_S)
            else:
                if self.keeper.failing_since is not None and not self.keeper.rescued:  # gossip is over: no pause needed
                    await loop.run_in_executor(self.worker, self.keeper.rescue)
        if self.control is not None:
            await self.control.close()
        self.metrics.close()
        self.worker.shutdown(wait=False)
        self.progress.phase = Phase.STOPPED
        log.info("peer %s stopped after %d rounds (w %.4f)", self.peer_id, self.progress.round, self.peer.engine.w)
