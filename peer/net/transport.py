"""The gRPC Transport: one :class:`~peer.net.client.EdgeSender` per out-neighbour, kept in step with the live set.

It implements :class:`peer.runtime.round.Transport` for the daemon. :meth:`GrpcTransport.ready` and
:meth:`GrpcTransport.submit` are called from the round's worker thread; submit hands the messages to the event loop,
which owns the edges. Edges are created when a peer enters the live set and closed once it has left and nothing is
in flight to it (an edge still carrying mass keeps reconnecting, so a handshake can settle it if the peer returns).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection, Mapping, Sequence

from peer.gossip.engine import OutMessage
from peer.net.accounting import LinkAccounting
from peer.net.api import GossipGate
from peer.net.client import EdgeSender, EdgeState
from peer.net.config import NetConfig
from peer.net.snapshots import EdgeSnapshot
from peer.runtime.round import SettleReport
from peer.security.credentials import TransportSecurity, required_security

log = logging.getLogger(__name__)


class GrpcTransport:
    """The daemon's edge table.

    Args:
        gate: the peer's gate (the edges settle through it).
        config: transport timeouts and sizes.
        links: per-link byte accounting, shared with the server.
        loop: the event loop that owns the edges (submit is marshalled onto it).
        security: mutual TLS for every edge, or ``TransportSecurity.insecure()`` chosen explicitly for a lab.
            Required: None raises TypeError.
    """

    def __init__(self, gate: GossipGate, config: NetConfig, links: LinkAccounting,
                 loop: asyncio.AbstractEventLoop, *, security: TransportSecurity) -> None:
        self.gate = gate
        self.security = required_security(security, "GrpcTransport")
        self.config = config
        self.links = links
        self.loop = loop
        self.edges: dict[str, EdgeSender] = {}

    # --- Transport ---------------------------------------------------------------------------------------------
    def ready(self, sender: str, receivers: Sequence[str]) -> set[str]:
        """Receivers whose stream is up and handshaken."""
        edges = dict(self.edges)
        return {r for r in receivers if r in edges and edges[r].ready}

    def submit(self, messages: Sequence[OutMessage]) -> None:
        """Hand messages to their edges (callable from any thread)."""
        if messages:
            self.loop.call_soon_threadsafe(self._submit, list(messages))

    def notify(self, sender: str, receivers: Collection[str], quarantined: Sequence[str]) -> None:
        """Send each receiver with an edge a QuarantineNotice naming ``quarantined`` (callable from any thread; a
        receiver whose stream is down gets it after its next handshake)."""
        if receivers:
            self.loop.call_soon_threadsafe(self._notify, sorted(receivers), list(quarantined))

    def probe(self, sender: str, receivers: Collection[str], sketch: bytes, round_index: int) -> None:
        """Send each receiver with an edge a ConsensusProbe carrying ``sketch`` (callable from any thread; a
        receiver whose stream is down gets it after its next handshake, unless a newer probe replaced it)."""
        if receivers:
            self.loop.call_soon_threadsafe(self._probe, sorted(receivers), sketch, round_index)

    async def settle(self, timeout_s: float) -> SettleReport:
        """Close every edge: outstanding Acks, then one handshake per edge that still has messages in flight.
        Edges close concurrently; what has not closed within ``timeout_s`` (seconds) stays in flight (checkpointed,
        settled by the next handshake). The report counts only what settled during this call."""
        report = SettleReport()
        edges = list(self.edges.values())
        self.edges.clear()
        acked_before = {edge.receiver_id: edge.delivered for edge in edges}
        closing = {asyncio.ensure_future(edge.close()): edge for edge in edges}
        if closing:
            await asyncio.wait(closing, timeout=timeout_s)
        for task, edge in closing.items():
            report.delivered += edge.delivered - acked_before[edge.receiver_id]  # Acks that arrived while closing
            if not task.done():
                task.cancel()
                continue
            if task.exception() is not None:
                log.warning("edge %s: close failed: %r", edge.receiver_id, task.exception())
                continue
            settlement = task.result()
            report.delivered += len(settlement.delivered)
            report.retracted += len(settlement.retracted)
        for edge in edges:
            left = self.gate.in_flight_count(edge.receiver_id)
            if left:
                report.pending[edge.receiver_id] = left
        return report

    # --- the edge table ----------------------------------------------------------------------------------------
    def sync(self, live: Mapping[str, str]) -> None:
        """Open an edge to every live peer (``peer_id -> host:port``). A peer that moved address while its edge was
        down is dialled at the new address by the same edge: one sender per edge, so one handshake at a time
        (a second sender's late reply could retract messages the first one's stream delivered)."""
        for peer_id, address in live.items():
            edge = self.edges.get(peer_id)
            if edge is None:
                self.edges[peer_id] = edge = EdgeSender(self.gate, peer_id, address, self.config, self.links,
                                                        security=self.security)
                edge.start()
            elif edge.address != address and edge.state is EdgeState.DOWN:
                edge.address = address  # read at the next reconnect

    async def close_departed(self, live: Mapping[str, str]) -> list[str]:
        """Close the edges of peers that left the live set once nothing is in flight to them; returns their ids."""
        gone = [p for p in self.edges if p not in live and not self.gate.in_flight_count(p)]
        for peer_id in gone:
            await self.edges.pop(peer_id).close()
            log.info("peer %s left the live set: edge closed", peer_id)
        return gone

    def snapshot(self) -> dict[str, EdgeSnapshot]:
        """Per-edge status (see :meth:`EdgeSender.snapshot`)."""
        return {peer_id: edge.snapshot() for peer_id, edge in self.edges.items()}

    def _notify(self, receivers: list[str], quarantined: list[str]) -> None:
        for receiver in receivers:
            edge = self.edges.get(receiver)
            if edge is not None:
                edge.queue_side_frame(lambda stream: stream.notify(quarantined))

    def _probe(self, receivers: list[str], sketch: bytes, round_index: int) -> None:
        for receiver in receivers:
            edge = self.edges.get(receiver)
            if edge is not None:
                edge.queue_side_frame(lambda stream: stream.probe(sketch, round_index))

    def _submit(self, messages: list[OutMessage]) -> None:
        for msg in messages:
            edge = self.edges.get(msg.receiver)
            if edge is None:
                # the edge closed under a committed message: it stays in flight in the peer and the next
                # handshake with that receiver (or the next start's) settles it
                log.info("update seq %d to %s not sent: its edge is closed", msg.seq, msg.receiver)
                continue
            edge.submit(msg)
