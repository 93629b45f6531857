"""Sending end of one directed Gossip edge (self -> receiver), plus the small unary/streaming client calls.

The edge's protocol (docs/design.md#exactly-once-mass-transfer) - queue, framing and batching, the window of
unacknowledged updates, ack checks, the floor of settled seqs, the handshake's bookkeeping - is the pure
:class:`~peer.net.outbound.OutboundStream` (the simulator runs the same code); :class:`EdgeSender` is its I/O shell: it dials, writes the frames, reads the replies, times
out Acks, reconnects with backoff after any break (transport error, Refusal, ack timeout, cancellation) and, on
close, runs one last handshake so no mass stays in doubt.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import random
import time
from collections.abc import Callable

import grpc

from peer.aio import cancel_and_wait
from peer.gossip.algorithms import Sent
from peer.gossip.engine import OutMessage
from peer.gossip.ledger import Settlement
from peer.net import wire
from peer.net.accounting import LinkAccounting
from peer.net.api import GossipGate, Identity
from peer.net.config import NetConfig
from peer.net.outbound import OutboundStream, Refused, StreamBroken
from peer.net.proto.lpdl.v1 import peer_pb2 as pb
from peer.net.proto.lpdl.v1 import peer_pb2_grpc
from peer.net.snapshots import EdgeSnapshot
from peer.security.credentials import (
    TransportSecurity,
    Unauthenticated,
    required_security,
)

log = logging.getLogger(__name__)


class EdgeState(enum.Enum):
    """Connection state of an edge, as shown in status."""

    CONNECTING = "connecting"  # dialing or handshaking
    ACTIVE = "active"          # stream up, nothing awaiting an Ack
    BUSY = "busy"              # stream up, updates await their Ack
    DOWN = "down"              # waiting to reconnect (backoff)
    CLOSED = "closed"


# What a broken stream looks like: our own verdicts, gRPC errors, timeouts, socket errors, a revoked receiver, and
# InvalidStateError from grpc.aio when writing to a call the other side already finished.
GOSSIP_METHOD = "/lpdl.v1.Peer/Gossip"
_BROKEN = (StreamBroken, grpc.RpcError, asyncio.TimeoutError, asyncio.InvalidStateError, OSError, Unauthenticated)


async def _ready_unless_refused(channel: grpc.aio.Channel) -> None:
    """Wait for the channel to connect, but fail at the first failed attempt instead of retrying with backoff
    (a peer that already stopped refuses the connection: a shutdown need not wait out its deadline)."""
    state = channel.get_state(try_to_connect=True)
    while state is not grpc.ChannelConnectivity.READY:
        if state is grpc.ChannelConnectivity.TRANSIENT_FAILURE:
            raise StreamBroken("peer unreachable (connection failed)")
        await channel.wait_for_state_change(state)
        state = channel.get_state(try_to_connect=True)


def backoff_delay(attempt: int, base_s: float, max_s: float, rng: random.Random) -> float:
    """Jittered exponential backoff: uniform in [d/2, d], d = min(max_s, base_s * 2**attempt) (seconds)."""
    delay = min(max_s, base_s * (2.0 ** min(attempt, 30)))
    return rng.uniform(delay / 2.0, delay)


def describe_rpc_error(exc: BaseException) -> str:
    """One line for a failed call: the gRPC status code and details, or the exception's own text."""
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class EdgeSender:
    """Keeps one Gossip stream to ``receiver_id`` at ``address`` and carries its messages in order.

    Args:
        gate: the daemon's gate (hello_for / on_hello_reply / on_ack / in_flight_count for this edge).
        receiver_id: the receiver's peer id (static neighbours: learn it with :func:`identify` first).
        address: ``host:port`` of the receiver's server.
        config: timeouts, backoff and chunking.
        links: per-link accounting (shared with the server), a new one if None.
        rng: randomness for backoff jitter (tests pass a seeded one).
        security: mutual TLS: the receiver must hold the certificate of ``receiver_id``; or
            ``TransportSecurity.insecure()`` chosen explicitly for a lab. Required: None raises TypeError.

    Usage: ``start()`` once; ``submit(msg)`` for each message the peer committed for this edge (the peer's window
    bounds how many are unsettled); ``await close()`` on shutdown.

    Memory: the edge holds the payloads of at most ``window`` unsettled updates (queued, or written and awaiting
    their Ack: window x update size, 32 x 64 KiB = 2 MiB with the defaults) plus the frame being written, at most
    ``config.batch_bytes`` (or one ``chunk_bytes`` chunk) and a few dozen bytes per update, which gRPC copies once
    more while it sends. Queued updates are packed several to a frame (wire.update_frames) only when the sender
    lags, so a peer that keeps up sends each update alone, as the simulator counts it.
    """

    def __init__(self, gate: GossipGate, receiver_id: str, address: str, config: NetConfig | None = None,
                 links: LinkAccounting | None = None, rng: random.Random | None = None, *,
                 security: TransportSecurity) -> None:
        self.gate = gate
        self.security = required_security(security, "EdgeSender")
        self.receiver_id = receiver_id
        self.address = address
        self.config = config or NetConfig()
        self.links = links or LinkAccounting()
        self.stream = OutboundStream(gate, receiver_id, self.config)
        self._rng = rng or random.Random()
        self.state = EdgeState.DOWN
        self.hello_rtt_s: float | None = None   # last Hello -> HelloReply round trip (seconds)
        self.last_seen: float = 0.0             # wall clock of the last frame from the receiver
        self.last_error: str = ""
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._closing = False
        self._task: asyncio.Task[None] | None = None
        self._call: grpc.aio.StreamStreamCall | None = None  # the current stream (fault injection cancels it)

    # --- public ------------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the connect / handshake / send loop (idempotent)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"edge->{self.receiver_id}")

    @property
    def ready(self) -> bool:
        """Stream up and handshaken: a message submitted now goes out at once."""
        return self.state in (EdgeState.ACTIVE, EdgeState.BUSY)

    @property
    def delivered(self) -> int:
        """Updates settled by an Ack."""
        return self.stream.delivered

    @property
    def batched(self) -> int:
        """Updates that went in an UpdateBatch with others (a lagging edge)."""
        return self.stream.batched

    def submit(self, msg: OutMessage) -> None:
        """Queue ``msg``; returns at once, delivery is asynchronous. A message a handshake already settled is
        dropped (it must never reach the receiver)."""
        if self._closing:
            raise RuntimeError(f"edge to {self.receiver_id} is closed")
        if not self.stream.submit(msg):
            log.debug("edge %s: message seq %d already settled by a handshake; not sent", self.receiver_id, msg.seq)
            return
        self._idle.clear()
        self._wake.set()

    def queue_side_frame(self, queue: Callable[[OutboundStream], None]) -> None:
        """``queue`` a frame without mass on the stream (``OutboundStream.notify`` or ``.probe``); returns at once
        (dropped if the edge is closing)."""
        if not self._closing:
            queue(self.stream)
            self._wake.set()

    async def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Wait until nothing is queued or awaiting an Ack; False on timeout."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False

    async def close(self) -> Settlement[Sent]:
        """Stop after settling: wait up to close_timeout_s for outstanding Acks, then one handshake decides what
        is left. Returns what the handshake settled; messages it could not reach stay in flight in the peer
        (checkpointed), and the next run's first handshake settles them."""
        if self._closing:
            return Settlement()
        self._closing = True
        if not self.stream.idle and self.ready:
            await self.wait_idle(self.config.close_timeout_s)  # Acks can only come on a live stream
        if self._task is not None:
            await cancel_and_wait([self._task])
        settlement: Settlement[Sent] = Settlement()
        if self.gate.in_flight_count(self.receiver_id):
            settlement = await self._final_settle()
        self.state = EdgeState.CLOSED
        return settlement

    def snapshot(self) -> EdgeSnapshot:
        """Status of this edge (seconds, wall-clock last_seen, bytes from the shared accounting)."""
        link = self.links.get(self.receiver_id)
        return EdgeSnapshot(
            receiver=self.receiver_id, address=self.address, state=self.state.value,
            hello_rtt_s=self.hello_rtt_s, ack_rtt_s=self.stream.ack_rtt_s, last_seen=self.last_seen,
            bytes_sent=link.bytes_sent, bytes_received=link.bytes_received,
            delivered=self.stream.delivered, batched=self.stream.batched, settled=dict(self.stream.settled),
            handshakes=self.stream.handshakes, last_error=self.last_error)

    # --- connection loop ---------------------------------------------------------------------------------------
    async def _run(self) -> None:
        attempt = 0
        while not self._closing:
            self.state = EdgeState.CONNECTING
            try:
                async with self._channel() as channel:
                    await asyncio.wait_for(channel.channel_ready(), self.config.connect_timeout_s)
                    call = self._call = _gossip_call(channel)
                    try:
                        await self._handshake(call)
                        attempt = 0
                        await self._serve(call)
                    finally:
                        call.cancel()
                        self._call = None
                        self.stream.broken()
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if self._closing or (current is not None and current.cancelling()):
                    raise
                # grpc.aio raises CancelledError from a call that was cancelled under us: just a broken stream
                self.last_error = "stream call cancelled"
                log.info("edge %s -> %s (%s) broken: call cancelled", self.gate.identity().peer_id,
                         self.receiver_id, self.address)
            except _BROKEN as exc:
                self.last_error = describe_rpc_error(exc)
                # a receiver joining or stopping refuses as NOT_READY: routine, nothing for the operator to do
                refused = isinstance(exc, Refused) and exc.code != pb.REFUSAL_NOT_READY
                level = logging.WARNING if refused else logging.INFO
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
        return self.security.channel(self.address, self.config.channel_options(), peer_id=self.receiver_id)

    async def _write(self, call: grpc.aio.StreamStreamCall, data: bytes) -> None:
        self.links.sent(self.receiver_id, len(data))  # frames come serialized: their length is the byte count
        await call.write(data)

    async def _read(self, call: grpc.aio.StreamStreamCall) -> pb.GossipReply:
        reply: pb.GossipReply = await call.read()  # or grpc.aio.EOF
        if reply is grpc.aio.EOF:
            raise StreamBroken("receiver closed the stream")
        self.links.received(self.receiver_id, reply.ByteSize())
        self.last_seen = time.time()
        return reply

    async def _handshake(self, call: grpc.aio.StreamStreamCall) -> Settlement[Sent]:
        """Hello -> HelloReply; settles every in-flight message. Raises StreamBroken/Refused/TimeoutError."""
        started = time.monotonic()
        await asyncio.wait_for(self._write(call, self.stream.hello()), self.config.connect_timeout_s)
        reply = await asyncio.wait_for(self._read(call), self.config.connect_timeout_s)
        settlement = self.stream.on_reply(reply, time.monotonic())
        self.hello_rtt_s = time.monotonic() - started
        if settlement.seqs():
            log.info("edge %s: handshake settled %d in-flight update(s): %d delivered, %d retracted%s",
                     self.receiver_id, len(settlement.seqs()), len(settlement.delivered),
                     len(settlement.retracted), " (edge reset)" if settlement.reset else "")
        self._update_idle()
        return settlement

    async def _serve(self, call: grpc.aio.StreamStreamCall) -> None:
        """Write queued messages as they come while a reader task takes Acks; returns only by raising."""
        reader = asyncio.ensure_future(self._read_acks(call))
        try:
            while True:
                self._wake.clear()
                while self.stream.queued:
                    for frame in self.stream.frames(time.monotonic):
                        await self._write(call, frame)
                self.state = EdgeState.BUSY if self.stream.unacked else EdgeState.ACTIVE
                if self.stream.queued:
                    continue
                wake = asyncio.ensure_future(self._wake.wait())
                try:
                    await asyncio.wait({reader, wake}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    wake.cancel()
                if reader.done():
                    reader.result()  # raises why the stream broke
        finally:
            await cancel_and_wait([reader])

    async def _read_acks(self, call: grpc.aio.StreamStreamCall) -> None:
        """Read Acks until the stream breaks; an update unacknowledged for ack_timeout_s breaks it too."""
        read: asyncio.Task[pb.GossipReply] = asyncio.ensure_future(self._read(call))
        try:
            while True:
                deadline = self.stream.ack_deadline  # an update written meanwhile is checked within 2x of it
                timeout = self.config.ack_timeout_s if deadline is None else max(0.0, deadline - time.monotonic())
                done, _ = await asyncio.wait({read}, timeout=timeout)
                if done:
                    self.stream.on_reply(read.result(), time.monotonic())
                    self._update_idle()
                    read = asyncio.ensure_future(self._read(call))
                else:
                    self.stream.check_ack_deadline(time.monotonic())
        finally:
            await cancel_and_wait([read])

    def _update_idle(self) -> None:
        if self.stream.idle:
            self._idle.set()

    async def _final_settle(self) -> Settlement[Sent]:
        """One handshake on a fresh stream so no mass stays in doubt; if unreachable within close_timeout_s the
        messages stay in flight in the peer (its checkpoint carries them, the next run's handshake settles them)."""
        try:
            async with self._channel() as channel:
                await asyncio.wait_for(_ready_unless_refused(channel), self.config.close_timeout_s)
                call = _gossip_call(channel)
                try:
                    return await asyncio.wait_for(self._handshake(call), self.config.close_timeout_s)
                finally:
                    call.cancel()
                    self.stream.broken()
        except _BROKEN as exc:
            log.warning("edge %s: %d in-flight update(s) could not be settled on close (%s); they stay in flight "
                        "in the checkpoint and the next handshake with this peer settles them", self.receiver_id,
                        self.gate.in_flight_count(self.receiver_id), describe_rpc_error(exc))
            return Settlement()


def _gossip_call(channel: grpc.aio.Channel) -> grpc.aio.StreamStreamCall:
    """A Gossip stream whose frames the sender serializes itself (EdgeSender._write) so it counts their bytes
    without serializing twice."""
    return channel.stream_stream(GOSSIP_METHOD, request_serializer=None,
                                 response_deserializer=pb.GossipReply.FromString)()


async def identify(address: str, config: NetConfig | None = None, *, security: TransportSecurity,
                   peer_id: str | None = None) -> Identity:
    """Ask the peer at ``address`` who it is (static neighbours: learn the id before opening an edge). With TLS and
    ``peer_id`` the server must hold that device's certificate; without ``peer_id`` any device of the fleet answers
    and the id it claims is proven only when an edge dials it (the edge's TLS checks that exact id). ``security``
    is required (``TransportSecurity.insecure()`` explicitly for a lab)."""
    config = config or NetConfig()
    security = required_security(security, "identify")
    async with security.channel(address, config.channel_options(), peer_id=peer_id) as channel:
        reply = await peer_pb2_grpc.PeerStub(channel).Identify(pb.IdentifyRequest(),
                                                                timeout=config.connect_timeout_s)
    return wire.identity_from_pb(reply)


async def fetch_model(address: str, fingerprint: str, requester_id: str = "", config: NetConfig | None = None,
                      links: LinkAccounting | None = None, peer_id: str = "", *,
                      security: TransportSecurity) -> bytes:
    """Pull a neighbour's de-biased model bytes (GetModel), checking fingerprint and total length. With TLS and a
    ``peer_id``, the server must hold that peer's certificate; ``security`` is required
    (``TransportSecurity.insecure()`` explicitly for a lab).

    Raises:
        ValueError: wrong fingerprint, length mismatch or a model over ``config.max_model_bytes``.
        grpc.RpcError: transport failure or the server refused (FAILED_PRECONDITION on fingerprint).
    """
    config = config or NetConfig()
    parts: list[bytes] = []
    received = 0
    total = -1
    security = required_security(security, "fetch_model")
    async with security.channel(address, config.channel_options(), peer_id=peer_id or None) as channel:
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
