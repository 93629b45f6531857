"""Sending end of one directed Gossip edge (self -> receiver), plus the small unary/streaming client calls.

Exactly-once (DESIGN.md 3, peer/gossip/ledger.py): the engine subtracts a message's mass when it is built; the
:class:`EdgeSender` carries it; an Ack settles it (gate.on_ack). Any break - transport error, Refusal, ack timeout,
cancellation - ends the stream, and the next (re)connect starts with a handshake whose reply settles the message
(gate.on_hello_reply: delivered, or mass taken back and the seq fenced at the receiver). A message is therefore
never resent: after every handshake the sender's slot is empty.

Messages issued by the engine while a handshake is in progress (edge looked idle) are never sent: the reply is
clamped to ``last_applied <= hello.next_seq - 1`` before the gate sees it, which leaves the verdict of the
announced message unchanged and makes an unannounced one RETRACTED, and ``_floor`` makes the sender drop it.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import random
import time
from typing import Any

import grpc

from peer.gossip import ledger
from peer.gossip.engine import OutMessage
from peer.net import wire
from peer.net.accounting import LinkAccounting
from peer.net.api import GossipGate, Identity
from peer.net.config import NetConfig
from peer.net.proto.lpdl.v1 import peer_pb2 as pb
from peer.net.proto.lpdl.v1 import peer_pb2_grpc

log = logging.getLogger(__name__)


class EdgeState(enum.Enum):
    """Connection state of an edge, as shown in status."""

    CONNECTING = "connecting"  # dialing or handshaking
    ACTIVE = "active"          # stream up, nothing in flight
    BUSY = "busy"              # stream up, an update awaits its Ack
    DOWN = "down"              # waiting to reconnect (backoff)
    CLOSED = "closed"


class StreamBroken(Exception):
    """The stream can no longer be trusted; reconnect and let the handshake settle."""


class Refused(StreamBroken):
    """The receiver refused the Hello or an update (code + reason + message from the wire)."""

    def __init__(self, refusal: pb.Refusal) -> None:
        super().__init__(f"{pb.RefusalCode.Name(refusal.code)} ({refusal.reason}): {refusal.message}")
        self.reason = refusal.reason or pb.RefusalCode.Name(refusal.code)


# What a broken stream looks like: our own verdicts, gRPC errors, timeouts, socket errors, and
# InvalidStateError from grpc.aio when writing to a call the other side already finished.
_BROKEN = (StreamBroken, grpc.RpcError, asyncio.TimeoutError, asyncio.InvalidStateError, OSError)


def backoff_delay(attempt: int, base_s: float, max_s: float, rng: random.Random) -> float:
    """Jittered exponential backoff: uniform in [d/2, d], d = min(max_s, base_s * 2**attempt) (seconds)."""
    delay = min(max_s, base_s * (2.0 ** min(attempt, 30)))
    return rng.uniform(delay / 2.0, delay)


class EdgeSender:
    """Keeps one Gossip stream to ``receiver_id`` at ``address`` and carries at most one message at a time.

    Args:
        gate: the daemon's gate (hello_for / on_hello_reply / on_ack for this edge).
        receiver_id: the receiver's peer id (static neighbours: learn it with :func:`identify` first).
        address: ``host:port`` of the receiver's server.
        config: timeouts, backoff and chunking.
        links: per-link accounting (shared with the server), a new one if None.
        rng: randomness for backoff jitter (tests pass a seeded one).

    Usage: ``start()`` once; ``await submit(msg)`` when the engine produced a message for this edge (only when
    ``engine.busy(receiver)`` was False, so at most one is in flight); ``await close()`` on shutdown.
    """

    def __init__(self, gate: GossipGate, receiver_id: str, address: str, config: NetConfig | None = None,
                 links: LinkAccounting | None = None, rng: random.Random | None = None) -> None:
        self.gate = gate
        self.receiver_id = receiver_id
        self.address = address
        self.config = config or NetConfig()
        self.links = links or LinkAccounting()
        self._rng = rng or random.Random()
        self.state = EdgeState.DOWN
        self.hello_rtt_s: float | None = None   # last Hello -> HelloReply round trip (seconds)
        self.ack_rtt_s: float | None = None     # last first-chunk-sent -> Ack round trip (seconds)
        self.last_seen: float = 0.0             # wall clock of the last frame from the receiver
        self.last_error: str = ""
        self.handshakes = 0
        self.delivered = 0                      # updates acked
        self.settled: dict[str, int] = {"delivered": 0, "retracted": 0}  # in-flight messages settled by handshake
        self._slot: OutMessage | None = None    # the one message this edge carries
        self._sent = False                      # whether _slot went out on the current stream
        self._ack_started = 0.0                 # monotonic time the slot's first chunk went out
        self._floor = 0                         # messages with seq <= floor are settled and never sent
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._closing = False
        self._task: asyncio.Task | None = None
        self._call: grpc.aio.StreamStreamCall | None = None

    # --- public ------------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the connect / handshake / send loop (idempotent)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"edge->{self.receiver_id}")

    @property
    def ready(self) -> bool:
        """Stream up and nothing in flight: a message submitted now goes out at once."""
        return self.state is EdgeState.ACTIVE and self._slot is None

    async def submit(self, msg: OutMessage) -> None:
        """Queue ``msg`` (the edge's single in-flight message); returns at once, delivery is asynchronous."""
        if msg.receiver != self.receiver_id:
            raise ValueError(f"message for {msg.receiver!r} submitted to the edge to {self.receiver_id!r}")
        if self._closing:
            raise RuntimeError(f"edge to {self.receiver_id} is closed")
        if msg.seq <= self._floor:
            log.debug("edge %s: message seq %d already settled by a handshake; not sent", self.receiver_id, msg.seq)
            return
        if self._slot is not None and self._slot.seq > self._floor:
            raise RuntimeError(f"edge to {self.receiver_id} already carries seq {self._slot.seq}")
        self._slot, self._sent = msg, False
        self._idle.clear()
        self._wake.set()

    async def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Wait until no message is carried (acked or settled); False on timeout."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False

    async def close(self) -> None:
        """Stop, after settling: wait for an outstanding Ack, else a final handshake decides the message.

        Bounded by about 2 * close_timeout_s; if the receiver is unreachable the message stays pending in the
        engine (checkpointed) and the next run's first handshake settles it."""
        if self._closing:
            return
        self._closing = True
        if self._slot is not None and self.state is EdgeState.BUSY:
            await self.wait_idle(self.config.close_timeout_s)
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._slot is not None or self.handshakes == 0:
            # never handshaken: the engine may still hold a message a previous sender (or run) left in doubt
            await self._final_settle()
        self.state = EdgeState.CLOSED

    def snapshot(self) -> dict[str, Any]:
        """Status of this edge (seconds, wall-clock last_seen, bytes from the shared accounting)."""
        link = self.links.get(self.receiver_id)
        return {
            "receiver": self.receiver_id, "address": self.address, "state": self.state.value,
            "hello_rtt_s": self.hello_rtt_s, "ack_rtt_s": self.ack_rtt_s, "last_seen": self.last_seen,
            "bytes_sent": link.bytes_sent, "bytes_received": link.bytes_received,
            "delivered": self.delivered, "settled": dict(self.settled), "handshakes": self.handshakes,
            "in_flight_seq": self._slot.seq if self._slot is not None else 0, "last_error": self.last_error,
        }

    # --- connection loop ---------------------------------------------------------------------------------------
    async def _run(self) -> None:
        attempt = 0
        while not self._closing:
            self.state = EdgeState.CONNECTING
            try:
                async with self._channel() as channel:
                    await asyncio.wait_for(channel.channel_ready(), self.config.connect_timeout_s)
                    call = self._call = peer_pb2_grpc.PeerStub(channel).Gossip()
                    try:
                        await self._handshake(call)
                        attempt = 0
                        await self._serve(call)
                    finally:
                        call.cancel()
                        self._call = None
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if self._closing or (current is not None and current.cancelling()):
                    raise
                # grpc.aio raises CancelledError from a call that was cancelled under us: just a broken stream
                self.last_error = "stream call cancelled"
                log.info("edge %s -> %s (%s) broken: call cancelled", self.gate.identity().peer_id,
                         self.receiver_id, self.address)
            except _BROKEN as exc:
                self.last_error = f"{type(exc).__name__}: {exc}"
                level = logging.WARNING if isinstance(exc, Refused) else logging.INFO
                log.log(level, "edge %s -> %s (%s) broken: %s", self.gate.identity().peer_id, self.receiver_id,
                        self.address, self.last_error)
            except Exception as exc:  # noqa: BLE001 - a bug here must not silently kill the edge forever
                self.last_error = f"{type(exc).__name__}: {exc}"
                log.exception("edge %s -> %s: unexpected error; reconnecting", self.gate.identity().peer_id,
                              self.receiver_id)
            self.state = EdgeState.DOWN
            delay = backoff_delay(attempt, self.config.backoff_base_s, self.config.backoff_max_s, self._rng)
            attempt += 1
            await asyncio.sleep(delay)

    def _channel(self) -> grpc.aio.Channel:
        return grpc.aio.insecure_channel(self.address, options=self.config.channel_options())

    async def _write(self, call: grpc.aio.StreamStreamCall, frame: pb.GossipFrame) -> None:
        self.links.sent(self.receiver_id, frame.ByteSize())
        await call.write(frame)

    async def _read(self, call: grpc.aio.StreamStreamCall) -> pb.GossipReply:
        reply = await call.read()
        if reply is grpc.aio.EOF:
            raise StreamBroken("receiver closed the stream")
        self.links.received(self.receiver_id, reply.ByteSize())
        self.last_seen = time.time()
        if reply.WhichOneof("reply") == "refusal":
            raise Refused(reply.refusal)
        return reply

    async def _handshake(self, call: grpc.aio.StreamStreamCall) -> None:
        """Hello -> HelloReply; settles whatever was in flight. Raises StreamBroken/Refused/TimeoutError."""
        hello = self.gate.hello_for(self.receiver_id)
        started = time.monotonic()
        frame = wire.hello_frame(self.gate.identity(), self.receiver_id, hello)
        await asyncio.wait_for(self._write(call, frame), self.config.connect_timeout_s)
        reply = await asyncio.wait_for(self._read(call), self.config.connect_timeout_s)
        if reply.WhichOneof("reply") != "hello_reply":
            raise StreamBroken(f"expected HelloReply, got {reply.WhichOneof('reply')}")
        answered_by = reply.hello_reply.receiver.peer_id
        if answered_by != self.receiver_id:
            raise StreamBroken(f"{self.address} is peer {answered_by!r}, not {self.receiver_id!r}")
        self.hello_rtt_s = time.monotonic() - started
        got = wire.reply_from_pb(reply.hello_reply)
        clamped = ledger.HelloReply(last_applied=min(got.last_applied, hello.next_seq - 1), fence=got.fence,
                                    reset=got.reset)
        verdict = self.gate.on_hello_reply(self.receiver_id, clamped)
        unannounced = verdict is not ledger.Verdict.NOTHING and hello.retract_seq == 0
        self._floor = max(self._floor, hello.next_seq if unannounced else hello.next_seq - 1)
        if verdict is not ledger.Verdict.NOTHING:
            self.settled[verdict.value] += 1
            log.info("edge %s: in-flight message %s by handshake", self.receiver_id, verdict.value)
        if self._slot is not None and self._slot.seq <= self._floor:
            self._clear_slot()
        self.handshakes += 1

    async def _serve(self, call: grpc.aio.StreamStreamCall) -> None:
        """Send the slot's message when there is one, read Acks; returns only by raising."""
        reads: asyncio.Task = asyncio.ensure_future(self._read(call))
        try:
            while True:
                self._wake.clear()
                if self._slot is not None and not self._sent:
                    await self._send_slot(call)
                self.state = EdgeState.BUSY if self._slot is not None else EdgeState.ACTIVE
                wake = asyncio.ensure_future(self._wake.wait())
                timeout = self.config.ack_timeout_s if self._sent else None
                try:
                    done, _ = await asyncio.wait({reads, wake}, timeout=timeout,
                                                 return_when=asyncio.FIRST_COMPLETED)
                finally:
                    wake.cancel()
                if not done:
                    raise StreamBroken(f"no Ack for seq {self._slot.seq if self._slot else 0} within "
                                       f"{self.config.ack_timeout_s} s")
                if reads in done:
                    self._on_reply(reads.result())
                    reads = asyncio.ensure_future(self._read(call))
        finally:
            reads.cancel()
            await asyncio.gather(reads, return_exceptions=True)

    async def _send_slot(self, call: grpc.aio.StreamStreamCall) -> None:
        msg = self._slot
        assert msg is not None
        self._sent = True
        self._ack_started = time.monotonic()
        algorithm = self.gate.identity().algorithm
        for frame in wire.update_chunks(msg.seq, msg.round, msg.weight, msg.scale, algorithm, msg.payload,
                                        self.config.chunk_bytes):
            await self._write(call, frame)

    def _on_reply(self, reply: pb.GossipReply) -> None:
        if reply.WhichOneof("reply") != "ack":
            raise StreamBroken(f"unexpected {reply.WhichOneof('reply')} on an open stream")
        seq = reply.ack.seq
        if self._slot is None or not self._sent or self._slot.seq != seq:
            log.debug("edge %s: stale ack for seq %d ignored", self.receiver_id, seq)
            return
        self.ack_rtt_s = time.monotonic() - self._ack_started
        self.gate.on_ack(self.receiver_id, seq)
        self._floor = max(self._floor, seq)
        self.delivered += 1
        self._clear_slot()

    def _clear_slot(self) -> None:
        self._slot, self._sent = None, False
        self._idle.set()

    async def _final_settle(self) -> None:
        """One handshake on a fresh stream so no mass stays in doubt; if unreachable the engine keeps it pending
        (its checkpoint carries it and the next run's handshake settles it)."""
        try:
            async with self._channel() as channel:
                await asyncio.wait_for(channel.channel_ready(), self.config.close_timeout_s)
                call = peer_pb2_grpc.PeerStub(channel).Gossip()
                try:
                    await asyncio.wait_for(self._handshake(call), self.config.close_timeout_s)
                finally:
                    call.cancel()
        except _BROKEN as exc:
            log.warning("edge %s: could not settle in-flight seq %d on close (%r); it stays pending",
                        self.receiver_id, self._slot.seq if self._slot else 0, exc)


async def identify(address: str, config: NetConfig | None = None) -> Identity:
    """Ask the peer at ``address`` who it is (static neighbours: learn the id before opening an edge)."""
    config = config or NetConfig()
    async with grpc.aio.insecure_channel(address, options=config.channel_options()) as channel:
        reply = await peer_pb2_grpc.PeerStub(channel).Identify(pb.IdentifyRequest(),
                                                                timeout=config.connect_timeout_s)
    return wire.identity_from_pb(reply)


async def fetch_model(address: str, fingerprint: str, requester_id: str = "", config: NetConfig | None = None,
                      links: LinkAccounting | None = None, peer_id: str = "") -> bytes:
    """Pull a neighbour's de-biased model bytes (GetModel), checking fingerprint and total length.

    Raises:
        ValueError: wrong fingerprint, length mismatch or a model over ``config.max_model_bytes``.
        grpc.RpcError: transport failure or the server refused (FAILED_PRECONDITION on fingerprint).
    """
    config = config or NetConfig()
    parts: list[bytes] = []
    received = 0
    total = -1
    async with grpc.aio.insecure_channel(address, options=config.channel_options()) as channel:
        request = pb.GetModelRequest(fingerprint=fingerprint, requester_id=requester_id)
        async for chunk in peer_pb2_grpc.PeerStub(channel).GetModel(request):
            if links is not None:
                links.received(peer_id or address, chunk.ByteSize())
            if total < 0:
                if chunk.fingerprint != fingerprint:
                    raise ValueError(f"GetModel from {address}: fingerprint {chunk.fingerprint!r}, "
                                     f"expected {fingerprint!r}")
                total = chunk.total_length
                if total > config.max_model_bytes:
                    raise ValueError(f"GetModel from {address}: model of {total} bytes exceeds max_model_bytes "
                                     f"{config.max_model_bytes}")
            received += len(chunk.data)
            if received > total:
                raise ValueError(f"GetModel from {address}: more than the announced {total} bytes")
            parts.append(chunk.data)
    if received != total:
        raise ValueError(f"GetModel from {address}: got {received} of {total} bytes")
    return b"".join(parts)
