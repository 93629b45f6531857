"""The peer's gRPC server: receiving end of every Gossip edge, plus GetModel, Identify, Status and health.

Gossip stream protocol (client = sender of mass; see proto/lpdl/v1/peer.proto):
    Hello -> HelloReply | Refusal        identity checks (protocol, fleet, fingerprint, algorithm, self, receiver)
    Update chunks -> cumulative Acks     strict reassembly (reassembly.py), seq strictly increasing per stream;
                                         acks paced by the gate (the receiver's round boundary)
Every Refusal is followed by the end of the stream (status OK); the sender reconnects and its handshake settles
any in-flight message, so a refusal never loses or duplicates mass. No exception escapes a handler, and a refused
frame changes no engine state. A newer stream from the same sender supersedes (cancels) the older one; the ledger
fence makes late updates of the old stream harmless anyway.
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
from peer.net import wire
from peer.net.accounting import UNKNOWN_PEER, LinkAccounting
from peer.net.api import GossipGate
from peer.net.config import NetConfig
from peer.net.proto.lpdl.v1 import peer_pb2 as pb
from peer.net.proto.lpdl.v1 import peer_pb2_grpc
from peer.net.reassembly import ChunkError, Reassembler

log = logging.getLogger(__name__)

SERVICE_NAME = "lpdl.v1.Peer"

_IDENTITY_CODES = {
    "protocol": pb.REFUSAL_PROTOCOL, "fleet": pb.REFUSAL_FLEET, "fingerprint": pb.REFUSAL_FINGERPRINT,
    "algorithm": pb.REFUSAL_ALGORITHM, "self": pb.REFUSAL_SELF,
}


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
    sender: str = ""                     # peer id, set by an accepted Hello
    expected_seq: int = 0                # first acceptable seq (from the handshake)
    last_seq: int = 0                    # last complete update's seq on this stream
    task: asyncio.Task | None = None
    superseded: bool = False
    ack_seq: int = 0                     # newest seq settled on this stream (applied or dropped as duplicate)
    acked_seq: int = 0                   # newest seq whose Ack was written
    acks: asyncio.Future | None = None   # the ack writer task
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
    """

    def __init__(self, gate: GossipGate, config: NetConfig | None = None, links: LinkAccounting | None = None) -> None:
        self.gate = gate
        self.config = config or NetConfig()
        self.links = links or LinkAccounting()
        self.counters = ServerCounters()
        self.health = health.aio.HealthServicer()
        self._streams: dict[str, _InStream] = {}
        self._server: grpc.aio.Server | None = None
        self.port: int = 0

    async def start(self, address: str = "127.0.0.1:0") -> int:
        """Bind ``address`` (host:port, port 0 = any) and start serving; returns the bound port."""
        server = grpc.aio.server(options=self.config.server_options())
        peer_pb2_grpc.add_PeerServicer_to_server(_Servicer(self), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        port = server.add_insecure_port(address)
        if port == 0:
            raise OSError(f"gRPC server could not bind {address}")
        await server.start()
        await self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        self._server, self.port = server, port
        log.info("peer %s serving gRPC on %s (port %d)", self.gate.identity().peer_id, address, port)
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

    def snapshot(self) -> dict[str, Any]:
        """Transport section of the status: links, counters, open inbound streams."""
        return {
            "links": self.links.snapshot(),
            "refused": dict(self.counters.refused),
            "dropped": dict(self.counters.dropped),
            "applied": self.counters.applied,
            "inbound_streams": sorted(self._streams),
        }

    # --- Gossip ------------------------------------------------------------------------------------------------
    async def gossip(self, requests: AsyncIterator[pb.GossipFrame], context: grpc.aio.ServicerContext) -> None:
        stream = _InStream(remote=context.peer(), task=asyncio.current_task(),
                           reassembler=Reassembler(self.config.max_chunk_bytes, self.config.max_payload_bytes))
        try:
            async for frame in requests:
                claimed = frame.hello.sender.peer_id if frame.WhichOneof("frame") == "hello" else ""
                self.links.received(stream.sender or claimed or UNKNOWN_PEER, frame.ByteSize())
                if stream.superseded:
                    return
                try:
                    reply = self._on_frame(stream, frame)
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
        except asyncio.CancelledError:
            if stream.superseded:
                log.info("gossip stream from %s superseded by a newer stream; closed", stream.who)
            raise
        except Exception as exc:  # noqa: BLE001 - a broken peer must never take the server down
            if stream.reassembler.partial is not None:
                self._count_refused("truncated", f"gossip stream from {stream.who} broke inside update seq "
                                                 f"{stream.reassembler.partial.seq}: {exc!r}; update dropped")
            else:
                log.info("gossip stream from %s ended: %r", stream.who, exc)
        finally:
            if stream.acks is not None:
                stream.acks.cancel()
            if stream.sender and self._streams.get(stream.sender) is stream:
                del self._streams[stream.sender]

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

    def _on_frame(self, stream: _InStream, frame: pb.GossipFrame) -> pb.GossipReply | None:
        kind = frame.WhichOneof("frame")
        if kind == "hello":
            if stream.sender:
                raise _Refuse(pb.REFUSAL_BAD_FRAME, "hello_twice", f"second Hello on the stream from {stream.who}")
            return self._on_hello(stream, frame.hello)
        if kind == "update":
            if not stream.sender:
                raise _Refuse(pb.REFUSAL_BAD_FRAME, "no_hello", f"Update before Hello from {stream.remote}",
                              frame.update.seq)
            return self._on_update(stream, frame.update)
        raise _Refuse(pb.REFUSAL_BAD_FRAME, "empty_frame", f"frame with neither Hello nor Update from {stream.who}")

    def _on_hello(self, stream: _InStream, hello: pb.Hello) -> pb.GossipReply:
        me = self.gate.identity()
        theirs = wire.identity_from_pb(hello.sender)
        if not theirs.peer_id:
            raise _Refuse(pb.REFUSAL_BAD_FRAME, "no_peer_id", f"Hello from {stream.remote} has an empty peer_id")
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
        if old is not None and old is not stream:
            old.superseded = True
            if old.task is not None:
                old.task.cancel()
        stream.sender = theirs.peer_id
        self._streams[stream.sender] = stream
        try:
            reply = self.gate.answer_hello(stream.sender, wire.hello_from_pb(hello))
        except GossipInputError as exc:
            code = pb.REFUSAL_BAD_FRAME if exc.reason == "bad_hello" else pb.REFUSAL_NOT_READY
            raise _Refuse(code, exc.reason, f"hello from {stream.who} refused: {exc}") from None
        stream.expected_seq = max(hello.next_seq, reply.fence + 1)
        log.debug("hello from %s: next_seq=%d first_in_flight=%d -> last_applied=%d fence=%d reset=%s",
                  stream.who, hello.next_seq, hello.first_in_flight, reply.last_applied, reply.fence, reply.reset)
        return wire.reply_to_pb(reply, me)

    def _on_update(self, stream: _InStream, chunk: pb.Update) -> pb.GossipReply | None:
        if chunk.chunk_index == 0 and stream.reassembler.partial is None:
            if chunk.seq < stream.expected_seq or chunk.seq <= stream.last_seq:
                raise _Refuse(pb.REFUSAL_BAD_SEQ, "seq_order",
                              f"update from {stream.who} has seq {chunk.seq}; this stream expects seq >= "
                              f"{max(stream.expected_seq, stream.last_seq + 1)} (replayed or out of order)",
                              chunk.seq)
            algorithm = self.gate.identity().algorithm
            if algorithm and chunk.algorithm != algorithm:
                raise _Refuse(pb.REFUSAL_ALGORITHM, "algorithm",
                              f"update seq {chunk.seq} from {stream.who} uses algorithm {chunk.algorithm!r}, "
                              f"this peer runs {algorithm!r}", chunk.seq)
        try:
            update = stream.reassembler.feed(chunk)
        except ChunkError as exc:
            raise _Refuse(pb.REFUSAL_BAD_CHUNK, exc.reason, f"update from {stream.who} refused: {exc}",
                          chunk.seq) from exc
        if update is None:
            return None
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
        return pb.GossipReply(ack=pb.Ack(seq=update.seq, applied=applied))

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
    async def get_model(self, request: pb.GetModelRequest,
                        context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ModelChunk]:
        me = self.gate.identity()
        if request.fingerprint and request.fingerprint != me.fingerprint:
            self._count_refused("fingerprint", f"refused GetModel from {request.requester_id or context.peer()}: "
                                               f"fingerprint mismatch (theirs={request.fingerprint!r}, "
                                               f"ours={me.fingerprint!r})")
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"fingerprint mismatch: theirs={request.fingerprint!r} ours={me.fingerprint!r}")
        data = self.gate.model_bytes()
        who = request.requester_id or UNKNOWN_PEER
        self.links.received(who, request.ByteSize())
        step = self.config.model_chunk_bytes
        view = memoryview(data)
        for offset in range(0, max(len(data), 1), step):
            chunk = pb.ModelChunk(data=bytes(view[offset:offset + step]))
            if offset == 0:
                chunk.fingerprint, chunk.total_length = me.fingerprint, len(data)
            self.links.sent(who, chunk.ByteSize())
            yield chunk
        log.info("served model (%d bytes) to %s", len(data), request.requester_id or context.peer())

    def identify(self) -> pb.PeerIdentity:
        return wire.identity_to_pb(self.gate.identity())

    def status_json(self) -> str:
        """The daemon's status document, the same one its control socket serves."""
        return json.dumps(self.gate.status(), default=str)


class _Servicer(peer_pb2_grpc.PeerServicer):
    """Thin adapter from generated method names to :class:`PeerServer`."""

    def __init__(self, server: PeerServer) -> None:
        self._server = server

    async def Gossip(self, request_iterator: AsyncIterator[pb.GossipFrame],  # noqa: N802 - generated name
                     context: grpc.aio.ServicerContext) -> None:
        await self._server.gossip(request_iterator, context)

    async def GetModel(self, request: pb.GetModelRequest,  # noqa: N802
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ModelChunk]:
        async for chunk in self._server.get_model(request, context):
            yield chunk

    async def Identify(self, request: pb.IdentifyRequest,  # noqa: N802
                       context: grpc.aio.ServicerContext) -> pb.PeerIdentity:
        return self._server.identify()

    async def Status(self, request: pb.StatusRequest,  # noqa: N802
                     context: grpc.aio.ServicerContext) -> pb.StatusReply:
        return pb.StatusReply(json=self._server.status_json())
