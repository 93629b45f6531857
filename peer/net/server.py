"""The peer's gRPC server: receiving end of every Gossip edge, plus GetModel, Identify, Status and health.

Gossip stream protocol (client = sender of mass; see proto/lpdl/v1/peer.proto):
    Hello -> HelloReply | Refusal        identity checks (protocol, fleet, fingerprint, algorithm, self, receiver)
    Update chunks -> cumulative Acks     strict reassembly (reassembly.py), seq strictly increasing per stream;
                                         acks paced by the gate (the receiver's round boundary)
    UpdateBatch -> one cumulative Ack    several whole updates in one frame (protocol 5), all checked first
Every Refusal is followed by the end of the stream (status OK); the sender reconnects and its handshake settles
any in-flight message, so a refusal never loses or duplicates mass. No exception escapes a handler, and a refused
frame changes no engine state (a batch whose later update the ENGINE refuses keeps the earlier ones applied,
exactly as separate frames would; the handshake settles them as delivered). A newer stream from the same sender
supersedes the older one, which gets REFUSAL_SUPERSEDED; the ledger fence makes late updates of the old stream
harmless anyway.

Trust (docs/design.md#trust): with TLS (peer/security) the sender is who its certificate says; a Hello naming anyone else
is refused (REFUSAL_UNAUTHENTICATED), so only the same authenticated peer can supersede its own stream. Gossip serves
fleet devices; GetModel devices (joiners) and operators (``lpdl-peer export --peer``), Identify and Status devices
and operators. Per-peer state exists only for accepted
senders and is capped (net.max_peers); partial updates are bounded in time (net.reassembly_timeout_s), in size
(the model layout's largest payload) and together (net.max_buffered_bytes); GetModel is rate-limited.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from peer.gossip.engine import GossipInputError
from peer.gossip.ledger import MAX_WINDOW
from peer.net import frames, wire
from peer.net.accounting import UNKNOWN_PEER, LinkAccounting
from peer.net.api import GossipGate
from peer.net.config import NetConfig
from peer.net.limits import ByteBudget, TokenBucket
from peer.net.proto.lpdl.v1 import peer_pb2 as pb
from peer.net.proto.lpdl.v1 import peer_pb2_grpc
from peer.net.reassembly import ChunkError, CompleteUpdate, Reassembler
from peer.security.credentials import TransportSecurity, Unauthenticated
from peer.security.identity import CertIdentity

log = logging.getLogger(__name__)

SERVICE_NAME = "lpdl.v1.Peer"

_IDENTITY_CODES = {
    "protocol": pb.REFUSAL_PROTOCOL, "fleet": pb.REFUSAL_FLEET, "fingerprint": pb.REFUSAL_FINGERPRINT,
    "algorithm": pb.REFUSAL_ALGORITHM, "self": pb.REFUSAL_SELF,
}
#: Refusal code of each reason the gate may give for a Hello (GossipInputError.reason).
_HELLO_CODES = {"bad_hello": pb.REFUSAL_BAD_FRAME, "not_ready": pb.REFUSAL_NOT_READY, "self": pb.REFUSAL_SELF,
                "peer_limit": pb.REFUSAL_LIMIT}


class _Refuse(Exception):
    """Internal: refuse the current frame and end the stream."""

    def __init__(self, code: int, reason: str, message: str, seq: int = 0) -> None:
        super().__init__(message)
        self.code, self.reason, self.message, self.seq = code, reason, message, seq


@dataclass
class _InStream:
    """Server-side state of one Gossip stream."""

    remote: str                          # transport address (for logs)
    reassembler: Reassembler
    caller: CertIdentity | None = None   # who the TLS certificate says is calling (None: insecure mode)
    sender: str = ""                     # peer id, set by an accepted Hello
    expected_seq: int = 0                # first acceptable seq (from the handshake)
    last_seq: int = 0                    # last complete update's seq on this stream
    superseded: bool = False
    ack_seq: int = 0                     # newest seq settled on this stream (applied or dropped as duplicate)
    acked_seq: int = 0                   # newest seq whose Ack was written
    acks: asyncio.Future | None = None   # the ack writer task
    partial_since: float = 0.0           # loop time the update being reassembled started
    context: Any = None                  # the call's grpc.aio.ServicerContext (to tell a superseded stream)
    write_lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one write at a time (acks vs refusals)

    @property
    def who(self) -> str:
        return f"{self.sender or '<no hello>'}@{self.remote}"


@dataclass
class ServerCounters:
    """Counters keyed by reason (plain data; the daemon exports them as metrics)."""

    refused: collections.Counter[str] = field(default_factory=collections.Counter)
    dropped: collections.Counter[str] = field(default_factory=collections.Counter)
    applied: int = 0


class PeerServer:
    """Serves one peer's gate over gRPC.

    Args:
        gate: the daemon's gate (sync, cheap calls).
        config: transport settings (message sizes, keepalive, chunk limits).
        links: per-link accounting shared with the edge senders (a new one if None).
        security: mutual TLS (peer/security); None = insecure (anyone reaching the port is trusted by the identity
            it claims: tests and labs only).
    """

    def __init__(self, gate: GossipGate, config: NetConfig | None = None, links: LinkAccounting | None = None,
                 security: TransportSecurity | None = None) -> None:
        self.gate = gate
        self.config = config or NetConfig()
        self.links = links or LinkAccounting()
        self.security = security or TransportSecurity.insecure(gate.identity().fleet)
        self.counters = ServerCounters()
        self.buffered = ByteBudget(self.config.max_buffered_bytes)
        self.max_payload_bytes = min(self.config.max_payload_bytes, gate.max_payload_bytes())
        self._get_model_bucket = TokenBucket(self.config.get_model_rate_per_s, self.config.get_model_burst)
        self.health = health.aio.HealthServicer()
        self._streams: dict[str, _InStream] = {}
        self._server: grpc.aio.Server | None = None
        self.port: int = 0

    async def start(self, address: str = "127.0.0.1:0") -> int:
        """Bind ``address`` (host:port, port 0 = any) and start serving; returns the bound port."""
        server = grpc.aio.server(options=self.config.server_options(),
                                 maximum_concurrent_rpcs=self.config.max_concurrent_rpcs)
        _add_peer_service(_Servicer(self), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        credentials = self.security.server_credentials()
        port = server.add_secure_port(address, credentials) if credentials is not None else \
            server.add_insecure_port(address)
        if port == 0:
            raise OSError(f"gRPC server could not bind {address}")
        await server.start()
        await self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        self._server, self.port = server, port
        log.info("peer %s serving gRPC on %s (port %d, %s)", self.gate.identity().peer_id, address, port,
                 "mutual TLS" if self.security.secure else "INSECURE: no TLS, callers unauthenticated")
        return port

    async def stop(self, grace_s: float = 1.0) -> None:
        """Report NOT_SERVING, then stop accepting and give open calls ``grace_s`` seconds."""
        if self._server is None:
            return
        await self.health.enter_graceful_shutdown()
        await self._server.stop(grace_s)
        self._server = None

    def streaming_from(self, peer_id: str) -> bool:
        """Whether ``peer_id`` has an open Gossip stream to this server."""
        return peer_id in self._streams

    def open_streams(self) -> int:
        """Number of open inbound Gossip streams."""
        return len(self._streams)

    def snapshot(self) -> dict[str, Any]:
        """Transport section of the status: links, counters, open inbound streams."""
        return {
            "links": self.links.snapshot(),
            "refused": dict(self.counters.refused),
            "dropped": dict(self.counters.dropped),
            "applied": self.counters.applied,
            "inbound_streams": sorted(self._streams),
            "buffered_bytes": self.buffered.used,
            "tls": self.security.secure,
        }

    # --- Gossip ------------------------------------------------------------------------------------------------
    async def gossip(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> None:
        """One inbound edge. Frames arrive serialized (see _add_peer_service), are counted by their length (a
        ByteSize() would serialize them again) and read by frames.read_frame, which leaves the payloads in place."""
        stream = _InStream(remote=context.peer(), context=context,
                           reassembler=Reassembler(self.config.max_chunk_bytes, self.max_payload_bytes))
        incoming = aiter(requests)
        try:
            try:
                stream.caller = self._authenticate(context, peers_only=True)
            except _Refuse as refusal:
                await self._refuse(context, stream, refusal)
                return
            while True:
                try:
                    raw = await self._next_frame(incoming, stream)
                except StopAsyncIteration:
                    break
                except _Refuse as refusal:
                    await self._refuse(context, stream, refusal)
                    return
                if stream.superseded:  # told so (REFUSAL_SUPERSEDED); its sender closes it
                    log.info("gossip stream from %s superseded by a newer stream; closed", stream.who)
                    return
                self.links.received(stream.sender or UNKNOWN_PEER, len(raw))  # what arrived, parsable or not
                try:
                    reply = self._on_frame(stream, self._read_frame(stream, raw))
                except _Refuse as refusal:
                    await self._refuse(context, stream, refusal)
                    return
                if reply is not None and reply.WhichOneof("reply") == "ack":
                    self._queue_ack(context, stream, reply.ack)
                elif reply is not None:
                    await self._write(context, stream, reply)
            if stream.reassembler.partial is not None:
                head = stream.reassembler.partial
                self._count_refused("truncated", f"gossip stream from {stream.who} ended inside update seq "
                                                 f"{head.seq} after {stream.reassembler.received_chunks} of "
                                                 f"{head.chunk_count} chunks; update dropped")
            if stream.acks is not None:
                await stream.acks  # the sender half-closed: its last updates still get their Ack
        except Exception as exc:  # noqa: BLE001 - a broken peer must never take the server down
            if stream.reassembler.partial is not None:
                self._count_refused("truncated", f"gossip stream from {stream.who} broke inside update seq "
                                                 f"{stream.reassembler.partial.seq}: {exc!r}; update dropped")
            else:
                log.info("gossip stream from %s ended: %r", stream.who, exc)
        finally:
            self.buffered.give(stream.reassembler.buffered)
            stream.reassembler.reset()
            if stream.acks is not None:
                stream.acks.cancel()
            if stream.sender and self._streams.get(stream.sender) is stream:
                del self._streams[stream.sender]

    async def _next_frame(self, incoming: AsyncIterator[bytes], stream: _InStream) -> bytes:
        """The next frame; while an update is partly received, only until its reassembly deadline."""
        if stream.reassembler.partial is None:
            return await anext(incoming)
        left = stream.partial_since + self.config.reassembly_timeout_s - asyncio.get_running_loop().time()
        try:
            return await asyncio.wait_for(anext(incoming), max(left, 0.0))
        except asyncio.TimeoutError:
            head = stream.reassembler.partial
            raise _Refuse(pb.REFUSAL_LIMIT, "reassembly_timeout",
                          f"update seq {head.seq} from {stream.who} not complete within "
                          f"{self.config.reassembly_timeout_s:g} s ({stream.reassembler.received_chunks} of "
                          f"{head.chunk_count} chunks); partial update dropped", head.seq) from None

    def _authenticate(self, context: grpc.aio.ServicerContext, peers_only: bool) -> CertIdentity | None:
        """The caller's certificate identity (None when insecure); refuses non-members, revoked certificates and,
        with ``peers_only``, operators."""
        try:
            caller = self.security.caller(context)
        except Unauthenticated as exc:
            raise _Refuse(pb.REFUSAL_UNAUTHENTICATED, exc.reason, f"refused call from {context.peer()}: {exc}") \
                from None
        if peers_only and caller is not None and not caller.is_peer:
            raise _Refuse(pb.REFUSAL_UNAUTHENTICATED, "not_a_peer",
                          f"refused call from {context.peer()}: {caller.uri} is not a device certificate")
        return caller

    def _queue_ack(self, context: grpc.aio.ServicerContext, stream: _InStream, ack: pb.Ack) -> None:
        """Acks are cumulative: one writer task per stream sends the newest applied seq whenever the gate's pacing
        allows (this peer's next round boundary), while the stream keeps reading the sender's window."""
        stream.ack_seq = ack.seq
        if stream.acks is None or stream.acks.done():
            stream.acks = asyncio.ensure_future(self._write_acks(context, stream))

    async def _write_acks(self, context: grpc.aio.ServicerContext, stream: _InStream) -> None:
        while stream.acked_seq < stream.ack_seq:
            await self.gate.before_ack(stream.sender)
            await asyncio.sleep(0)  # let updates already received on this stream be applied: one Ack covers them
            seq = stream.ack_seq
            await self._write(context, stream, pb.GossipReply(ack=pb.Ack(seq=seq, applied=True)))
            stream.acked_seq = seq

    def _read_frame(self, stream: _InStream, raw: bytes) -> frames.Frame:
        """The frame in ``raw``, its payloads left in place (frames.read_frame); refused if malformed."""
        try:
            return frames.read_frame(raw)
        except frames.FrameError as exc:
            if exc.reason == "batch_size":  # checked in the order of _on_batch: first a Hello, then the size
                if not stream.sender:
                    raise _Refuse(pb.REFUSAL_BAD_FRAME, "no_hello", f"UpdateBatch before Hello from {stream.remote}",
                                  exc.seq) from None
                raise _Refuse(pb.REFUSAL_BAD_FRAME, "batch_size", f"UpdateBatch from {stream.who} {exc}; expected "
                                                                  f"1..{MAX_WINDOW}", exc.seq) from None
            raise _Refuse(pb.REFUSAL_BAD_FRAME, "malformed",
                          f"gossip frame of {len(raw)} bytes from {stream.who} is not a valid GossipFrame ({exc})") \
                from None

    def _on_frame(self, stream: _InStream, frame: frames.Frame) -> pb.GossipReply | None:
        kind = frame.kind
        if kind == "hello":
            if stream.sender:
                raise _Refuse(pb.REFUSAL_BAD_FRAME, "hello_twice", f"second Hello on the stream from {stream.who}")
            assert frame.hello is not None
            return self._on_hello(stream, frame.hello)
        if kind == "update":
            assert frame.update is not None
            if not stream.sender:
                raise _Refuse(pb.REFUSAL_BAD_FRAME, "no_hello", f"Update before Hello from {stream.remote}",
                              frame.update.seq)
            return self._on_update(stream, frame.update)
        if kind == "batch":
            return self._on_batch(stream, frame.updates)
        raise _Refuse(pb.REFUSAL_BAD_FRAME, "empty_frame",
                      f"frame with neither Hello, Update nor UpdateBatch from {stream.who}")

    def _on_batch(self, stream: _InStream, updates: list[frames.UpdateView]) -> pb.GossipReply | None:
        """Whole updates packed in one frame. Every one is checked (whole, seq order, algorithm, sizes) before any
        is applied, so a malformed batch changes nothing; then each is applied as if sent alone, in order, and one
        cumulative Ack covers them. Only the engine's own refusal of one update (a payload it cannot take) can stop a
        batch after earlier updates were applied - as it would stop separate frames; the sender's next handshake
        settles those as delivered and the rest as retracted."""
        first_seq = updates[0].seq if updates else 0
        if not stream.sender:
            raise _Refuse(pb.REFUSAL_BAD_FRAME, "no_hello", f"UpdateBatch before Hello from {stream.remote}",
                          first_seq)
        if not updates or len(updates) > MAX_WINDOW:
            raise _Refuse(pb.REFUSAL_BAD_FRAME, "batch_size",
                          f"UpdateBatch from {stream.who} holds {len(updates)} updates; expected 1..{MAX_WINDOW}",
                          first_seq)
        if stream.reassembler.partial is not None:
            raise _Refuse(pb.REFUSAL_BAD_FRAME, "batch_in_partial",
                          f"UpdateBatch from {stream.who} while update seq {stream.reassembler.partial.seq} is "
                          f"partly received", first_seq)
        next_seq = max(stream.expected_seq, stream.last_seq + 1)
        checked: list[CompleteUpdate] = []
        whole_updates = Reassembler(self.config.max_chunk_bytes, self.max_payload_bytes)  # empty after each one
        for update in updates:
            if update.chunk_index != 0 or update.chunk_count != 1:
                raise _Refuse(pb.REFUSAL_BAD_CHUNK, "batch_chunked",
                              f"UpdateBatch from {stream.who} holds update seq {update.seq} as chunk "
                              f"{update.chunk_index} of {update.chunk_count}; a batch carries whole updates only",
                              update.seq)
            self._check_opening(stream, update, next_seq)
            try:
                whole = whole_updates.feed(update, update.data)
            except ChunkError as exc:
                raise _Refuse(pb.REFUSAL_BAD_CHUNK, exc.reason, f"update from {stream.who} refused: {exc}",
                              update.seq) from exc
            assert whole is not None  # one chunk of one: complete or refused
            checked.append(whole)
            next_seq = update.seq + 1
        applied = True
        for whole in checked:
            applied = self._deliver(stream, whole)
        return pb.GossipReply(ack=pb.Ack(seq=checked[-1].seq, applied=applied))  # one reply: Acks are cumulative

    def _on_hello(self, stream: _InStream, hello: pb.Hello) -> pb.GossipReply:
        me = self.gate.identity()
        theirs = wire.identity_from_pb(hello.sender)
        if not theirs.peer_id:
            raise _Refuse(pb.REFUSAL_BAD_FRAME, "no_peer_id", f"Hello from {stream.remote} has an empty peer_id")
        if stream.caller is not None and theirs.peer_id != stream.caller.name:
            raise _Refuse(pb.REFUSAL_UNAUTHENTICATED, "sender_mismatch",
                          f"refused gossip from {stream.remote}: the Hello claims peer {theirs.peer_id!r} but the "
                          f"certificate is {stream.caller.name!r}")
        mismatch = me.mismatch(theirs)
        if mismatch is not None:
            reason, ours, other = mismatch
            raise _Refuse(_IDENTITY_CODES[reason], reason,
                          f"refused gossip from peer {theirs.peer_id!r} at {stream.remote}: {reason} mismatch "
                          f"(theirs={other!r}, ours={ours!r})")
        if hello.receiver_id and hello.receiver_id != me.peer_id:
            raise _Refuse(pb.REFUSAL_WRONG_RECEIVER, "wrong_receiver",
                          f"refused gossip from peer {theirs.peer_id!r} at {stream.remote}: it wants peer "
                          f"{hello.receiver_id!r} but this is {me.peer_id!r}")
        old = self._streams.get(theirs.peer_id)
        if old is None and len(self._streams) >= self.config.max_peers:
            raise _Refuse(pb.REFUSAL_LIMIT, "peer_limit",
                          f"refused gossip from peer {theirs.peer_id!r} at {stream.remote}: {len(self._streams)} "
                          f"inbound streams open (net.max_peers {self.config.max_peers})")
        try:
            reply = self.gate.answer_hello(theirs.peer_id, wire.hello_from_pb(hello))
        except GossipInputError as exc:
            raise _Refuse(_HELLO_CODES.get(exc.reason, pb.REFUSAL_BAD_FRAME), exc.reason,
                          f"hello from {theirs.peer_id}@{stream.remote} refused: {exc}") from None
        except ValueError as exc:  # a Hello the wire could carry but the ledger cannot hold
            raise _Refuse(pb.REFUSAL_BAD_FRAME, "bad_hello",
                          f"hello from {theirs.peer_id}@{stream.remote} refused: {exc}") from None
        if old is not None and old is not stream:
            self._supersede(old)
        stream.sender = theirs.peer_id
        self._streams[stream.sender] = stream
        stream.expected_seq = max(hello.next_seq, reply.fence + 1)
        log.debug("hello from %s: next_seq=%d first_in_flight=%d -> last_applied=%d fence=%d reset=%s",
                  stream.who, hello.next_seq, hello.first_in_flight, reply.last_applied, reply.fence, reply.reset)
        return wire.reply_to_pb(reply, me)

    def _supersede(self, old: _InStream) -> None:
        """The same authenticated sender opened a newer stream: tell the old one why, then end it."""
        old.superseded = True
        self.counters.refused["superseded"] += 1
        log.info("gossip stream from %s superseded by a newer stream of the same peer", old.who)
        refusal = pb.GossipReply(refusal=pb.Refusal(code=pb.REFUSAL_SUPERSEDED, reason="superseded",
                                                    message=f"a newer stream from {old.sender} replaced this one"))

        async def notify() -> None:
            try:
                await asyncio.wait_for(self._write(old.context, old, refusal), self.config.connect_timeout_s)
            except Exception as exc:  # noqa: BLE001 - the old stream may be dead already
                log.debug("could not tell %s it was superseded: %r", old.who, exc)

        asyncio.ensure_future(notify())

    def _check_opening(self, stream: _InStream, chunk: frames.UpdateView, next_seq: int) -> None:
        """Refuse the first chunk of an update whose seq is below ``next_seq`` (replayed or out of order) or whose
        algorithm is not this peer's."""
        if chunk.seq < next_seq:
            raise _Refuse(pb.REFUSAL_BAD_SEQ, "seq_order",
                          f"update from {stream.who} has seq {chunk.seq}; this stream expects seq >= "
                          f"{next_seq} (replayed or out of order)", chunk.seq)
        algorithm = self.gate.identity().algorithm
        if algorithm and chunk.algorithm != algorithm:
            raise _Refuse(pb.REFUSAL_ALGORITHM, "algorithm",
                          f"update seq {chunk.seq} from {stream.who} uses algorithm {chunk.algorithm!r}, "
                          f"this peer runs {algorithm!r}", chunk.seq)

    def _on_update(self, stream: _InStream, chunk: frames.UpdateView) -> pb.GossipReply | None:
        if chunk.chunk_index == 0 and stream.reassembler.partial is None:
            self._check_opening(stream, chunk, max(stream.expected_seq, stream.last_seq + 1))
        data = chunk.data  # a memoryview into the received frame: not copied (frames.py)
        before = stream.reassembler.buffered
        if not self.buffered.take(len(data)):
            self.buffered.give(before)
            stream.reassembler.reset()
            raise _Refuse(pb.REFUSAL_LIMIT, "buffer_full",
                          f"update seq {chunk.seq} from {stream.who} refused: partial updates already hold "
                          f"{self.buffered.used} bytes (net.max_buffered_bytes {self.config.max_buffered_bytes})",
                          chunk.seq)
        try:
            update = stream.reassembler.feed(chunk, data)
        except ChunkError as exc:
            self.buffered.give(before + len(data))
            raise _Refuse(pb.REFUSAL_BAD_CHUNK, exc.reason, f"update from {stream.who} refused: {exc}",
                          chunk.seq) from exc
        if update is None:
            if before == 0:
                stream.partial_since = asyncio.get_running_loop().time()
            return None
        self.buffered.give(before + len(data))
        return pb.GossipReply(ack=pb.Ack(seq=update.seq, applied=self._deliver(stream, update)))

    def _deliver(self, stream: _InStream, update: CompleteUpdate) -> bool:
        """Hand a complete, checked update to the gate: True if applied, False if dropped as a duplicate."""
        stream.last_seq = update.seq
        try:
            applied = self.gate.receive(stream.sender, update.seq, update.weight, update.scale, update.payload)
        except GossipInputError as exc:
            raise _Refuse(pb.REFUSAL_BAD_UPDATE, exc.reason,
                          f"update seq {update.seq} from {stream.who} refused by the engine: {exc}",
                          update.seq) from exc
        if applied:
            self.counters.applied += 1
        else:
            self.counters.dropped["duplicate"] += 1
            log.info("update seq %d from %s dropped: already applied or fenced (retracted by its sender)",
                     update.seq, stream.who)
        return applied

    async def _refuse(self, context: grpc.aio.ServicerContext, stream: _InStream, refusal: _Refuse) -> None:
        self._count_refused(refusal.reason, refusal.message)
        reply = pb.GossipReply(refusal=pb.Refusal(code=refusal.code, reason=refusal.reason,
                                                  message=refusal.message, seq=refusal.seq))
        try:
            await self._write(context, stream, reply)
        except Exception as exc:  # noqa: BLE001 - the peer may already be gone; the refusal is logged anyway
            log.debug("could not send refusal to %s: %r", stream.who, exc)

    def _count_refused(self, reason: str, message: str) -> None:
        self.counters.refused[reason] += 1
        log.warning("%s [refused: %s]", message, reason)

    async def _write(self, context: grpc.aio.ServicerContext, stream: _InStream, reply: pb.GossipReply) -> None:
        async with stream.write_lock:
            self.links.sent(stream.sender or UNKNOWN_PEER, reply.ByteSize())
            await context.write(reply)

    # --- GetModel / Identify / Status --------------------------------------------------------------------------
    async def _authorize(self, context: grpc.aio.ServicerContext, what: str,
                         peers_only: bool) -> CertIdentity | None:
        """Abort the call unless the caller is a fleet device (or, unless ``peers_only``, an operator); returns
        its identity (None when insecure)."""
        try:
            return self._authenticate(context, peers_only)
        except _Refuse as refusal:
            self._count_refused(refusal.reason, f"{what}: {refusal.message}")
            await context.abort(grpc.StatusCode.PERMISSION_DENIED if refusal.reason == "not_a_peer" else
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
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"fingerprint mismatch: theirs={request.fingerprint!r} ours={me.fingerprint!r}")
        if not self._get_model_bucket.allow():
            self._count_refused("get_model_rate", f"refused GetModel from {context.peer()}: more than "
                                                  f"{self.config.get_model_burst} calls at "
                                                  f"{self.config.get_model_rate_per_s:g}/s")
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "GetModel rate limit; retry later")
        data = self.gate.model_bytes()
        self.links.received(who, request.ByteSize())
        step = self.config.model_chunk_bytes
        view = memoryview(data)
        for offset in range(0, max(len(data), 1), step):
            chunk = pb.ModelChunk(data=bytes(view[offset:offset + step]))
            if offset == 0:
                chunk.fingerprint, chunk.total_length = me.fingerprint, len(data)
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
