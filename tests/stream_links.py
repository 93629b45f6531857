"""The two transports behind one test interface, for the stream contract suite (tests/test_stream_contract.py):
a receiver ``peer-b`` served by the in-memory transport (peer/sim/transport.py) or by a real gRPC server on
127.0.0.1 (insecure, or mutual TLS), and, towards it, raw streams (serialized frames in, replies out) and edges
(the transport's own sender). No test of its own.

The in-memory link is authenticated like TLS: a raw stream opened for sender X carries X as its certificate name.
Time: the in-memory link has a virtual clock (``wait`` advances it); the gRPC link sleeps.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import deque
from pathlib import Path
from typing import Protocol

import grpc

from peer.gossip.engine import OutMessage
from peer.net.api import Identity
from peer.net.client import GOSSIP_METHOD, EdgeSender
from peer.net.config import NetConfig
from peer.net.inbound import InboundStream, InboundStreams, ServerCounters, ack_reply
from peer.net.limits import ByteBudget
from peer.net.proto.lpdl.v1 import peer_pb2 as pb
from peer.net.server import PeerServer
from peer.security import ca
from peer.security.credentials import TransportSecurity
from peer.sim.transport import InMemoryTransport
from tests.test_net_support import FINGERPRINT, FLEET, RecordingGate, make_gate

TRANSPORTS = ("memory", "grpc", "grpc-tls")
PEERS = ("peer-a", "peer-b", "peer-c")
REPLY_TIMEOUT_S = 10.0


class RawStream(Protocol):
    async def write(self, frame: bytes) -> None: ...
    async def read(self) -> pb.GossipReply | None:
        """The next reply; None once the receiver ended the stream."""
    async def finish(self) -> list[pb.GossipReply]:
        """Half-close, then every reply until the receiver ends the stream."""
    async def cut(self) -> None:
        """Break the stream (the sender vanishes)."""


class Edge(Protocol):
    stream_delivered: int
    def submit(self, messages: list[OutMessage]) -> None: ...
    async def drain(self) -> None:
        """Until everything submitted is acknowledged."""
    async def cut(self) -> None: ...
    async def close(self) -> None:
        """Settle everything in flight (the sender's closing handshake)."""


class Link(Protocol):
    """Receiver ``peer-b`` behind one transport."""

    name: str
    authenticated: bool
    receiver: RecordingGate
    counters: ServerCounters
    buffered: ByteBudget

    def identity(self, peer_id: str) -> Identity:
        """The identity ``peer_id`` must show the receiver (fleet, fingerprint, algorithm of this link)."""
    async def open(self, sender: str = "peer-a") -> RawStream: ...
    async def edge(self, sender: RecordingGate) -> Edge: ...
    async def wait(self, seconds: float) -> None: ...
    async def gone(self, sender: str) -> None:
        """Until the receiver has dropped every stream of ``sender`` (a cut is noticed asynchronously)."""
    async def arrived(self, sender: str, frames: int) -> None:
        """Until the receiver has read ``frames`` frames from ``sender`` after its Hellos (written is not yet
        received: a cut drops what is still in the socket)."""
    async def close(self) -> None: ...


# --- in memory -----------------------------------------------------------------------------------------------------
class _MemoryRaw:
    def __init__(self, link: MemoryLink, stream: InboundStream) -> None:
        self.link, self.stream = link, stream
        self.replies: deque[pb.GossipReply] = deque()
        self.ended = False

    async def write(self, frame: bytes) -> None:
        if self.ended:
            return
        received = self.stream.on_frame(frame, self.link.clock)
        if received.superseded is not None:
            self.link.raw[received.superseded].tell(received.superseded.superseded_reply())
        if received.reply is not None:
            self.replies.append(received.reply)
        if received.refusal is not None:
            self.tell(received.refusal.reply())
        elif received.ack is not None:
            self.replies.append(ack_reply(received.ack))

    def tell(self, reply: pb.GossipReply) -> None:
        """A last reply, then the receiver ends the stream."""
        self.replies.append(reply)
        self.end()

    def end(self, error: str | None = None) -> None:
        if not self.ended:
            self.ended = True
            self.stream.close(error)

    async def read(self) -> pb.GossipReply | None:
        if self.replies:
            return self.replies.popleft()
        assert self.ended, "no reply waiting on an open in-memory stream (a gRPC read would block here)"
        return None

    async def finish(self) -> list[pb.GossipReply]:
        self.end()
        replies, self.replies = list(self.replies), deque()
        return replies

    async def cut(self) -> None:
        self.end("cut")

    def expire(self) -> None:
        deadline = self.stream.deadline
        if not self.ended and deadline is not None and self.link.clock >= deadline:
            self.tell(self.stream.expire().reply())


class _MemoryEdge:
    def __init__(self, link: MemoryLink, sender: RecordingGate) -> None:
        self.link, self.sender = link, sender
        self.id = sender.identity().peer_id
        self.transport = link.transport
        assert self.transport.ready(self.id, ["peer-b"]) == {"peer-b"}

    @property
    def stream_delivered(self) -> int:
        return self.transport.edges[self.id, "peer-b"].sender.delivered

    def submit(self, messages: list[OutMessage]) -> None:
        self.transport.submit(messages)

    async def drain(self) -> None:
        for _ in range(3):  # a cut stream reconnects at one delivery; what it carried is settled then
            self.transport.deliver(self.transport.round)
            if self.transport.edges[self.id, "peer-b"].sender.idle:
                return
        raise AssertionError("in-memory edge not idle after three deliveries")

    async def cut(self) -> None:
        self.transport.cut(self.id, "peer-b")

    async def close(self) -> None:
        self.transport.flush()


class MemoryLink:
    name = "memory"
    authenticated = True

    def __init__(self, config: NetConfig, receiver: RecordingGate, senders: dict[str, RecordingGate]) -> None:
        self.receiver = receiver
        self.transport = InMemoryTransport({"peer-b": receiver, **senders}, config=config)
        self.table: InboundStreams = self.transport.inbound["peer-b"]
        self.counters, self.buffered = self.table.counters, self.table.buffered
        self.clock = 0.0
        self.raw: dict[InboundStream, _MemoryRaw] = {}

    def identity(self, peer_id: str) -> Identity:
        return dataclasses.replace(self.transport.gates["peer-b"].identity(), peer_id=peer_id)

    async def open(self, sender: str = "peer-a") -> RawStream:
        stream = self.table.open(remote=f"memory:{sender}", caller=sender)
        raw = self.raw[stream] = _MemoryRaw(self, stream)
        return raw

    async def edge(self, sender: RecordingGate) -> Edge:
        return _MemoryEdge(self, sender)

    async def wait(self, seconds: float) -> None:
        self.clock += seconds
        for raw in list(self.raw.values()):
            raw.expire()

    async def gone(self, sender: str) -> None:
        assert self.table.get(sender) is None

    async def arrived(self, sender: str, frames: int) -> None:
        return None  # frames are taken as they are written

    async def close(self) -> None:
        return None


# --- gRPC ----------------------------------------------------------------------------------------------------------
class _GrpcRaw:
    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.channel = channel
        self.call = channel.stream_stream(GOSSIP_METHOD, request_serializer=None,
                                          response_deserializer=pb.GossipReply.FromString)()

    async def write(self, frame: bytes) -> None:
        try:
            await self.call.write(frame)
        except (asyncio.InvalidStateError, grpc.aio.AioRpcError):  # the server already ended the stream
            pass

    async def read(self) -> pb.GossipReply | None:
        try:
            reply = await asyncio.wait_for(self.call.read(), REPLY_TIMEOUT_S)
        except grpc.aio.AioRpcError:
            return None
        return None if reply is grpc.aio.EOF else reply

    async def finish(self) -> list[pb.GossipReply]:
        try:
            await self.call.done_writing()
        except (asyncio.InvalidStateError, grpc.aio.AioRpcError):
            pass
        replies = []
        while (reply := await self.read()) is not None:
            replies.append(reply)
        await self.channel.close()
        return replies

    async def cut(self) -> None:
        self.call.cancel()
        await self.channel.close()


class _GrpcEdge:
    def __init__(self, link: GrpcLink, sender: RecordingGate) -> None:
        peer_id = sender.identity().peer_id
        self.sender = EdgeSender(sender, "peer-b", f"127.0.0.1:{link.port}", link.config, link.server.links,
                                 security=link.security(peer_id))

    @property
    def stream_delivered(self) -> int:
        return self.sender.delivered

    def submit(self, messages: list[OutMessage]) -> None:
        for msg in messages:
            self.sender.submit(msg)

    async def ready(self) -> None:
        self.sender.start()
        await _until(lambda: self.sender.ready)

    async def drain(self) -> None:
        assert await self.sender.wait_idle(REPLY_TIMEOUT_S), "gRPC edge not idle in time"
        await _until(lambda: not self.sender.gate.in_flight_count("peer-b"))

    async def cut(self) -> None:
        await _until(lambda: self.sender._call is not None)
        self.sender._call.cancel()

    async def close(self) -> None:
        await self.sender.close()


class GrpcLink:
    def __init__(self, config: NetConfig, receiver: RecordingGate, pki: Path | None) -> None:
        self.name = "grpc-tls" if pki is not None else "grpc"
        self.authenticated = pki is not None
        self.config, self.receiver, self.pki = config, receiver, pki
        self.server = PeerServer(receiver, config, security=self.security("peer-b"))
        self.counters, self.buffered = self.server.counters, self.server.buffered
        self.port = 0
        self.channels: list[grpc.aio.Channel] = []

    def security(self, peer_id: str) -> TransportSecurity:
        if self.pki is None:
            return TransportSecurity.insecure(FLEET)
        return TransportSecurity.from_dir(self.pki / peer_id, FLEET)

    def identity(self, peer_id: str) -> Identity:
        return dataclasses.replace(self.receiver.identity(), peer_id=peer_id)

    async def start(self) -> GrpcLink:
        self.port = await self.server.start("127.0.0.1:0")
        return self

    async def open(self, sender: str = "peer-a") -> RawStream:
        channel = self.security(sender).channel(f"127.0.0.1:{self.port}", self.config.channel_options(),
                                                 peer_id="peer-b")
        self.channels.append(channel)
        return _GrpcRaw(channel)

    async def edge(self, sender: RecordingGate) -> Edge:
        edge = _GrpcEdge(self, sender)
        await edge.ready()
        return edge

    async def wait(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    async def gone(self, sender: str) -> None:
        await _until(lambda: not self.server.streaming_from(sender))

    async def arrived(self, sender: str, frames: int) -> None:
        await _until(lambda: self.server.links.get(sender).frames_received >= frames)

    async def close(self) -> None:
        for channel in self.channels:
            await channel.close()
        await self.server.stop(0)


async def _until(predicate, timeout_s: float = REPLY_TIMEOUT_S) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.005)


def make_pki(root: Path) -> Path:
    """A fleet CA and device certificates for every peer of the suite."""
    ca.init_ca(root / "ca", FLEET)
    for name in PEERS:
        ca.issue(root / "ca", name, root / name)
    return root


async def make_link(kind: str, config: NetConfig, pki: Path | None, window: int = 1) -> tuple[Link, dict]:
    """Receiver ``peer-b`` behind transport ``kind``, and the gates of every peer (senders ``peer-a``, ``peer-c``;
    choco, the layout of tests/test_net_support.py)."""
    gates = {name: make_gate(name, seed=i, window=window, fingerprint=FINGERPRINT) for i, name in enumerate(PEERS)}
    if kind == "memory":
        link: Link = MemoryLink(config, gates["peer-b"], {p: g for p, g in gates.items() if p != "peer-b"})
    else:
        link = await GrpcLink(config, gates["peer-b"], pki if kind == "grpc-tls" else None).start()
    return link, gates
