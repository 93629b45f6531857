"""The peer's gRPC server: receiving end of every Gossip edge, plus GetModel, Identify, Status and health.

The Gossip stream's protocol - handshake checks, per-stream seq order, reassembly, batches, budgets, deadlines,
supersession, refusals - is the pure :class:`~peer.net.inbound.InboundStreams` (the simulator runs the same code);
this module is its I/O shell: it reads frames with the reassembly deadline, writes replies and refusals, paces the
cumulative Acks by the gate (the receiver's round boundary), tells a superseded stream why, counts bytes and logs.
No exception escapes a handler.

Trust (docs/design.md#trust): with TLS (peer/security) the sender is who its certificate says; a Hello naming anyone else
is refused (REFUSAL_UNAUTHENTICATED), so only the same authenticated peer can supersede its own stream. Gossip serves
fleet devices; GetModel devices (joiners) and operators (``lpdl-peer export --peer``), Identify and Status devices
and operators. Per-peer state exists only for accepted
senders and is capped (net.max_peers); partial updates are bounded in time (net.reassembly_timeout_s), in size
(the model layout's largest payload) and together (net.max_buffered_bytes); GetModel is rate-limited.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, NoReturn

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from peer.errors import PeerError
from peer.net import wire
from peer.net.accounting import UNKNOWN_PEER, LinkAccounting
from peer.net.api import GossipGate
from peer.net.config import NetConfig
from peer.net.guard import ConnectionCensus
from peer.net.inbound import InboundStream, InboundStreams, Received, Refusal, ack_reply
from peer.net.limits import CallerBuckets
from peer.net.proto.lpdl.v1 import peer_pb2 as pb
from peer.net.proto.lpdl.v1 import peer_pb2_grpc
from peer.net.serials import CertificateSerials
from peer.net.snapshots import ServerSnapshot
from peer.security.credentials import (
    TransportSecurity,
    Unauthenticated,
    required_security,
)
from peer.security.identity import CertIdentity
from peer.security.revocation import RevocationWatch

log = logging.getLogger(__name__)

SERVICE_NAME = "lpdl.v1.Peer"


class _Denied(PeerError):
    """Internal: the caller is not allowed this call."""

    def __init__(self, refusal: Refusal) -> None:
        super().__init__(refusal.message, reason=refusal.reason)
        self.refusal = refusal


@dataclass
class _Call:
    """The I/O side of one inbound Gossip stream."""

    context: Any                         # the call's grpc.aio.ServicerContext
    ack_seq: int = 0                     # newest seq settled on this stream (applied or dropped as duplicate)
    acked_seq: int = 0                   # newest seq whose Ack was written
    acks: asyncio.Future[None] | None = None   # the ack writer task
    write_lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one write at a time (acks vs refusals)


def _authenticate(security: TransportSecurity, context: grpc.aio.ServicerContext,
                  peers_only: bool) -> CertIdentity | None:
    """The caller's certificate identity (None when insecure); refuses non-members, revoked certificates and, with
    ``peers_only``, operators."""
    try:
        caller = security.caller(context)
    except Unauthenticated as exc:
        raise _Denied(Refusal(pb.REFUSAL_UNAUTHENTICATED, exc.reason,
                              f"refused call from {context.peer()}: {exc}")) from None
    if peers_only and caller is not None and not caller.is_peer:
        raise _Denied(Refusal(pb.REFUSAL_UNAUTHENTICATED, "not_a_peer",
                              f"refused call from {context.peer()}: {caller.uri} is not a device certificate"))
    return caller


def _host(context: grpc.aio.ServicerContext) -> str:
    """The caller's address without its port."""
    return str(context.peer()).rpartition(":")[0]


def _model_chunks(data: bytes, fingerprint: str, step: int) -> Iterator[pb.ModelChunk]:
    """The serialized model in ``step``-byte chunks (at least one); the first names its fingerprint and length."""
    view = memoryview(data)
    for offset in range(0, max(len(data), 1), step):
        chunk = pb.ModelChunk(data=bytes(view[offset:offset + step]))
        if offset == 0:
            chunk.fingerprint, chunk.total_length = fingerprint, len(data)
        yield chunk


def _revocation_watch(security: TransportSecurity, config: NetConfig,
                      on_cut: Callable[[CertIdentity], None]) -> RevocationWatch | None:
    """The watch that ends revoked holders' open calls, where the server checks a revocation list at all."""
    if security.revocations is None:
        return None
    return RevocationWatch(security.revocations, config.revocation_check_s, on_cut)


def _log_refused(reason: str, message: str) -> None:
    # not_ready, paused: this peer is joining, stopping or paused (said once when it paused), a routine refusal its
    # senders settle by handshake
    log.log(logging.INFO if reason in ("not_ready", "paused") else logging.WARNING, "%s [refused: %s]", message,
            reason)


class PeerServer:
    """Serves one peer's gate over gRPC.

    Args:
        gate: the daemon's gate (sync, cheap calls).
        config: transport settings (message sizes, keepalive, chunk limits).
        links: per-link accounting shared with the edge senders (a new one if None).
        security: mutual TLS (peer/security), or ``TransportSecurity.insecure()`` chosen explicitly (anyone reaching
            the port is trusted by the identity it claims: tests and labs only). Required: None raises TypeError.
    """

    def __init__(self, gate: GossipGate, config: NetConfig | None = None, links: LinkAccounting | None = None, *,
                 security: TransportSecurity) -> None:
        self.gate = gate
        self.config = config or NetConfig()
        self.links = links or LinkAccounting()
        self.security = required_security(security, "PeerServer")
        self.inbound = InboundStreams(gate, self.config)
        self.counters = self.inbound.counters
        self.buffered = self.inbound.buffered
        self.max_payload_bytes = self.inbound.max_payload_bytes  # largest update buffered (bytes)
        self._get_model_buckets = CallerBuckets(self.config.get_model_rate_per_s, self.config.get_model_burst,
                                                self.config.max_peers)
        self.health = health.aio.HealthServicer()
        self.census = ConnectionCensus()
        self.revocation_watch = _revocation_watch(self.security, self.config,
                                                  lambda _: self.inbound.count_refused("revoked"))
        self._calls: dict[InboundStream, _Call] = {}
        self.serials = CertificateSerials(self.config.max_peers)  # named by quarantines, for `ca revoke`
        self._server: grpc.aio.Server | None = None
        self.port: int = 0

    async def start(self, address: str = "127.0.0.1:0") -> int:
        """Bind ``address`` (host:port, port 0 = any) and start serving; returns the bound port."""
        server = grpc.aio.server(options=self.config.server_options(),
                                 maximum_concurrent_rpcs=self.config.max_concurrent_rpcs)
        _add_peer_service(_Servicer(self), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        credentials = self.security.server_credentials(self.census.opened)
        port: int = server.add_secure_port(address, credentials) if credentials is not None else \
            server.add_insecure_port(address)
        if port == 0:
            raise OSError(f"gRPC server could not bind {address}")
        await server.start()
        await self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        self._server, self.port = server, port
        if self.revocation_watch is not None:
            self.revocation_watch.start()
        log.info("peer %s serving gRPC on %s (port %d, %s)", self.gate.identity().peer_id, address, port,
                 "mutual TLS" if self.security.secure else "INSECURE: no TLS, callers unauthenticated")
        return port

    async def stop(self, grace_s: float = 1.0) -> None:
        """Report NOT_SERVING, then stop accepting and give open calls ``grace_s`` seconds."""
        if self._server is None:
            return
        await self.health.enter_graceful_shutdown()
        if self.revocation_watch is not None:
            await self.revocation_watch.stop()
        await self._server.stop(grace_s)
        self._server = None

    def streaming_from(self, peer_id: str) -> bool:
        """Whether ``peer_id`` has an open Gossip stream to this server."""
        return self.inbound.get(peer_id) is not None

    def open_streams(self) -> int:
        """Number of open inbound Gossip streams."""
        return len(self.inbound)

    def snapshot(self) -> ServerSnapshot:
        """Transport section of the status: links, counters, open inbound streams."""
        return ServerSnapshot(
            links=self.links.counters(),
            refused={**self.counters.refused, **self.census.refused()}, dropped=dict(self.counters.dropped),
            applied=self.counters.applied, inbound_streams=self.inbound.senders(),
            buffered_bytes=self.buffered.used, tls=self.security.secure, certificate_serials=self.serials.snapshot())

    # --- Gossip ------------------------------------------------------------------------------------------------
    async def gossip(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> None:
        """One inbound edge. Frames arrive serialized (see _add_peer_service), are counted by their length (a
        ByteSize() would serialize them again) and handed to the stream's state machine as they are."""
        call = _Call(context)
        try:
            caller = _authenticate(self.security, context, peers_only=True)
            self.census.authenticated(context.peer())
        except _Denied as denied:
            self._count_refused(denied.refusal.reason, denied.refusal.message)
            await self._refuse(call, UNKNOWN_PEER, denied.refusal)
            return
        stream = self.inbound.open(context.peer(), self.serials.remember(caller))  # the caller's peer id
        self._calls[stream] = call
        untrack = self._watch(caller, "gossip stream")
        error: str | None = None
        try:
            await self._serve(requests, stream, call)
        except Exception as exc:  # noqa: BLE001 - a broken peer must never take the server down
            error = repr(exc)
            if stream.partial is None:
                log.info("gossip stream from %s ended: %s", stream.who, error)
        finally:
            untrack()
            if call.acks is not None:
                call.acks.cancel()
            del self._calls[stream]
            truncated = stream.close(error)
            if truncated is not None:
                _log_refused(truncated.reason, truncated.message)

    async def _serve(self, requests: AsyncIterator[bytes], stream: InboundStream, call: _Call) -> None:
        """Frames until the sender half-closes, the stream is refused or superseded."""
        incoming, loop = aiter(requests), asyncio.get_running_loop()
        while True:
            try:
                deadline = stream.deadline
                raw = await (anext(incoming) if deadline is None else
                             asyncio.wait_for(anext(incoming), max(deadline - loop.time(), 0.0)))
            except StopAsyncIteration:
                break
            except asyncio.TimeoutError:
                refusal = stream.expire()
                _log_refused(refusal.reason, refusal.message)
                return await self._refuse(call, stream.sender, refusal)
            if stream.superseded:  # told so (REFUSAL_SUPERSEDED); its sender closes it
                log.info("gossip stream from %s superseded by a newer stream; closed", stream.who)
                return
            self.links.received(stream.sender or UNKNOWN_PEER, len(raw))  # what arrived, parsable or not
            if await self._act(stream, call, stream.on_frame(raw, loop.time())):
                return
        if call.acks is not None:
            await call.acks  # the sender half-closed: its last updates still get their Ack

    async def _act(self, stream: InboundStream, call: _Call, received: Received) -> bool:
        """Carry out what one frame asked for; True when the stream is over (refused)."""
        if received.superseded is not None:
            self._supersede(received.superseded)
        for seq, applied in received.delivered:
            if not applied:
                log.info("update seq %d from %s dropped: already applied or fenced (retracted by its sender)",
                         seq, stream.who)
        if received.reply is not None:
            await self._write(call, stream.sender, received.reply)
        if received.refusal is not None:
            _log_refused(received.refusal.reason, received.refusal.message)
            await self._refuse(call, stream.sender, received.refusal)
            return True
        if received.ack is not None:
            self._queue_ack(stream, call, received.ack)
        return False

    def _queue_ack(self, stream: InboundStream, call: _Call, seq: int) -> None:
        """Acks are cumulative: one writer task per stream sends the newest applied seq whenever the gate's pacing
        allows (this peer's next round boundary), while the stream keeps reading the sender's window."""
        call.ack_seq = seq
        if call.acks is None or call.acks.done():
            call.acks = asyncio.ensure_future(self._write_acks(stream, call))

    async def _write_acks(self, stream: InboundStream, call: _Call) -> None:
        while call.acked_seq < call.ack_seq:
            await self.gate.before_ack(stream.sender)
            await asyncio.sleep(0)  # let updates already received on this stream be applied: one Ack covers them
            seq = call.ack_seq
            await self._write(call, stream.sender, ack_reply(seq))
            call.acked_seq = seq

    def _supersede(self, old: InboundStream) -> None:
        """The same authenticated sender opened a newer stream: tell the old one why; its sender ends it."""
        log.info("gossip stream from %s superseded by a newer stream of the same peer", old.who)
        old_call = self._calls.get(old)
        if old_call is None:
            return

        async def notify() -> None:
            try:
                await asyncio.wait_for(self._write(old_call, old.sender, old.superseded_reply()),
                                       self.config.connect_timeout_s)
            except Exception as exc:  # noqa: BLE001 - the old stream may be dead already
                log.debug("could not tell %s it was superseded: %r", old.who, exc)

        asyncio.ensure_future(notify())

    async def _refuse(self, call: _Call, peer_id: str, refusal: Refusal) -> None:
        try:
            await self._write(call, peer_id, refusal.reply())
        except Exception as exc:  # noqa: BLE001 - the peer may already be gone; the refusal is logged anyway
            log.debug("could not send refusal to %s: %r", peer_id or UNKNOWN_PEER, exc)

    def _watch(self, caller: CertIdentity | None, what: str) -> Callable[[], None]:
        """End this call if its caller's certificate is revoked while it is open (peer/security/revocation.py)."""
        return self.revocation_watch.track_task(caller, what) if self.revocation_watch is not None else lambda: None

    def _count_refused(self, reason: str, message: str) -> None:
        self.inbound.count_refused(reason)
        _log_refused(reason, message)

    async def _write(self, call: _Call, peer_id: str, reply: pb.GossipReply) -> None:
        async with call.write_lock:
            self.links.sent(peer_id or UNKNOWN_PEER, reply.ByteSize())
            await call.context.write(reply)

    # --- GetModel / Identify / Status --------------------------------------------------------------------------
    async def _authorize(self, context: grpc.aio.ServicerContext, what: str,
                         peers_only: bool) -> CertIdentity | None:
        """Abort the call unless the caller is a fleet device (or, unless ``peers_only``, an operator); returns
        its identity (None when insecure)."""
        try:
            caller = _authenticate(self.security, context, peers_only)
            self.census.authenticated(context.peer())
            return caller
        except _Denied as denied:
            refusal = denied.refusal
            self._count_refused(refusal.reason, f"{what}: {refusal.message}")
            await _abort(context, grpc.StatusCode.PERMISSION_DENIED if refusal.reason == "not_a_peer" else
                                grpc.StatusCode.UNAUTHENTICATED, refusal.message)

    async def get_model(self, request: pb.GetModelRequest,
                        context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ModelChunk]:
        caller = await self._authorize(context, "GetModel", peers_only=False)  # joiners and operators' exports
        # link counters only for an authenticated caller (insecure: the one claimed id of a lab)
        who = caller.name if caller is not None else (request.requester_id or UNKNOWN_PEER)
        me = self.gate.identity()
        if request.fingerprint != me.fingerprint:
            reason = "fingerprint" if request.fingerprint else "no_fingerprint"
            self._count_refused(reason, f"refused GetModel from {context.peer()}: fingerprint mismatch "
                                        f"(theirs={request.fingerprint!r}, ours={me.fingerprint!r})")
            await _abort(context, grpc.StatusCode.FAILED_PRECONDITION,
                                f"fingerprint mismatch: theirs={request.fingerprint!r} ours={me.fingerprint!r}")
        # per caller: an insider draining its own budget leaves a joiner's untouched (insecure: per host)
        if not self._get_model_buckets.allow(caller.uri if caller is not None else _host(context)):
            self._count_refused("get_model_rate", f"refused GetModel from {context.peer()}: more than "
                                                  f"{self.config.get_model_burst} calls at "
                                                  f"{self.config.get_model_rate_per_s:g}/s")
            await _abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, "GetModel rate limit; retry later")
        data = self.gate.model_bytes()
        self.links.received(who, request.ByteSize())
        for chunk in _model_chunks(data, me.fingerprint, self.config.model_chunk_bytes):
            self.links.sent(who, chunk.ByteSize())
            yield chunk
        log.info("served model (%d bytes) to %s at %s", len(data), who, context.peer())

    async def identify(self, context: grpc.aio.ServicerContext) -> pb.PeerIdentity:
        await self._authorize(context, "Identify", peers_only=False)
        return wire.identity_to_pb(self.gate.identity())

    async def status_json(self, context: grpc.aio.ServicerContext) -> str:
        """The daemon's status document, the same one its control socket serves (fleet devices and operators)."""
        await self._authorize(context, "Status", peers_only=False)
        return json.dumps(self.gate.status(), default=str)


def _add_peer_service(servicer: peer_pb2_grpc.PeerServicer, server: grpc.aio.Server) -> None:
    """The generated add_PeerServicer_to_server, except that Gossip frames reach the servicer serialized: the
    server reads each one once (frames.read_frame, payloads uncopied) and counts its length (a protobuf ByteSize()
    re-serializes the whole frame)."""
    handlers = {
        "Gossip": grpc.stream_stream_rpc_method_handler(
            servicer.Gossip, request_deserializer=None, response_serializer=pb.GossipReply.SerializeToString),
        "GetModel": grpc.unary_stream_rpc_method_handler(
            servicer.GetModel, request_deserializer=pb.GetModelRequest.FromString,
            response_serializer=pb.ModelChunk.SerializeToString),
        "Identify": grpc.unary_unary_rpc_method_handler(
            servicer.Identify, request_deserializer=pb.IdentifyRequest.FromString,
            response_serializer=pb.PeerIdentity.SerializeToString),
        "Status": grpc.unary_unary_rpc_method_handler(
            servicer.Status, request_deserializer=pb.StatusRequest.FromString,
            response_serializer=pb.StatusReply.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


class _Servicer(peer_pb2_grpc.PeerServicer):
    """Thin adapter from generated method names to :class:`PeerServer`."""

    def __init__(self, server: PeerServer) -> None:
        self._server = server

    async def Gossip(self, request_iterator: AsyncIterator[bytes],  # noqa: N802 - generated name
                     context: grpc.aio.ServicerContext) -> None:
        await self._server.gossip(request_iterator, context)

    async def GetModel(self, request: pb.GetModelRequest,  # noqa: N802
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ModelChunk]:
        async for chunk in self._server.get_model(request, context):
            yield chunk

    async def Identify(self, request: pb.IdentifyRequest,  # noqa: N802
                       context: grpc.aio.ServicerContext) -> pb.PeerIdentity:
        return await self._server.identify(context)

    async def Status(self, request: pb.StatusRequest,  # noqa: N802
                     context: grpc.aio.ServicerContext) -> pb.StatusReply:
        return pb.StatusReply(json=await self._server.status_json(context))


async def _abort(context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
    """End the call with ``code`` and ``message``: ServicerContext.abort raises grpc's own exception, so the
    handler stops here (grpc ships no types that say so)."""
    await context.abort(code, message)
    raise AssertionError("grpc.aio.ServicerContext.abort returned")
