"""The gRPC Transport: one :class:`~peer.net.client.EdgeSender` per out-neighbour, kept in step with the live set.

It implements :class:`peer.runtime.round.Transport` for the daemon. :meth:`GrpcTransport.ready` and
:meth:`GrpcTransport.submit` are called from the round's worker thread; submit hands the messages to the event loop,
which owns the edges. Edges are created when a peer enters the live set and closed once it has left and nothing is
in flight to it (an edge still carrying mass keeps reconnecting, so a handshake can settle it if the peer returns).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from peer.gossip.engine import OutMessage
from peer.net.accounting import LinkAccounting
from peer.net.api import GossipGate
from peer.net.client import EdgeSender, EdgeState
from peer.net.config import NetConfig
from peer.runtime.round import SettleReport
from peer.security.credentials import TransportSecurity

log = logging.getLogger(__name__)


class GrpcTransport:
    """The daemon's edge table.

    Args:
        gate: the peer's gate (the edges settle through it).
        config: transport timeouts and sizes.
        links: per-link byte accounting, shared with the server.
        loop: the event loop that owns the edges (submit is marshalled onto it).
        security: mutual TLS for every edge (None: insecure).
    """

    def __init__(self, gate: GossipGate, config: NetConfig, links: LinkAccounting,
                 loop: asyncio.AbstractEventLoop, security: TransportSecurity | None = None) -> None:
        self.gate = gate
        self.security = security
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

    async def settle(self, timeout_s: float) -> SettleReport:
        """Close every edge: outstanding Acks, then one handshake per edge that still has messages in flight.
        Each edge is bounded by about 2 * close_timeout_s; they close concurrently, within ``timeout_s`` overall."""
        report = SettleReport()
        edges = list(self.edges.values())
        self.edges.clear()
        try:
            settlements = await asyncio.wait_for(asyncio.gather(*(e.close() for e in edges),
                                                                return_exceptions=True), timeout_s)
        except asyncio.TimeoutError:
            settlements = []
        for edge, settlement in zip(edges, settlements):
            if isinstance(settlement, BaseException):
                log.warning("edge %s: close failed: %r", edge.receiver_id, settlement)
                continue
            report.delivered += edge.delivered + len(settlement.delivered)
            report.retracted += len(settlement.retracted)
        for edge in edges:
            left = self.gate.in_flight_count(edge.receiver_id)
            if left:
                report.pending[edge.receiver_id] = left
        return report

    # --- the edge table ----------------------------------------------------------------------------------------
    def sync(self, live: Mapping[str, str]) -> None:
        """Open an edge to every live peer (``peer_id -> host:port``); replace an edge whose peer moved address
        while the edge was down."""
        for peer_id, address in live.items():
            edge = self.edges.get(peer_id)
            if edge is not None and (edge.address == address or edge.state is not EdgeState.DOWN):
                continue
            if edge is not None:
                self.loop.create_task(edge.close())
            self.edges[peer_id] = edge = EdgeSender(self.gate, peer_id, address, self.config, self.links,
                                                    security=self.security)
            edge.start()

    async def close_departed(self, live: Mapping[str, str]) -> list[str]:
        """Close the edges of peers that left the live set once nothing is in flight to them; returns their ids."""
        gone = [p for p in self.edges if p not in live and not self.gate.in_flight_count(p)]
        for peer_id in gone:
            await self.edges.pop(peer_id).close()
            log.info("peer %s left the live set: edge closed", peer_id)
        return gone

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """Per-edge status (see :meth:`EdgeSender.snapshot`)."""
        return {peer_id: edge.snapshot() for peer_id, edge in self.edges.items()}

    def _submit(self, messages: list[OutMessage]) -> None:
        for msg in messages:
            edge = self.edges.get(msg.receiver)
            if edge is None:
                # the edge closed under a committed message: it stays in flight in the peer and the next
                # handshake with that receiver (or the next start's) settles it
                log.info("update seq %d to %s not sent: its edge is closed", msg.seq, msg.receiver)
                continue
            edge.submit(msg)
