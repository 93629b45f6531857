"""The transport's sections of the status document: one outbound edge (:class:`EdgeSnapshot`, written by
``EdgeSender.snapshot``) and the gRPC server (:class:`ServerSnapshot`). Plain data, JSON through one
``to_json`` / ``from_json`` each, so the daemon's status (peer/daemon/status.py) reads named fields."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from peer.net.accounting import LinkCounters


@dataclass(frozen=True)
class EdgeSnapshot:
    """One outbound edge ``self -> receiver``: its state, round trips (seconds; None before the first), the
    wall-clock time the receiver was last heard from (0: never), byte counters of the link, and what it carried:
    updates delivered, updates that went in a shared batch frame, settlements by outcome, handshakes made."""

    receiver: str
    address: str
    state: str  # client.EdgeState value
    hello_rtt_s: float | None
    ack_rtt_s: float | None
    last_seen: float
    bytes_sent: int
    bytes_received: int
    delivered: int
    batched: int
    settled: dict[str, int]
    handshakes: int
    last_error: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> EdgeSnapshot:
        return cls(**{**data, "settled": dict(data["settled"])})


@dataclass(frozen=True)
class ServerSnapshot:
    """The gRPC server's side: link counters by remote peer, refused and dropped inputs by reason, updates
    applied, the senders with an open inbound stream, reassembly bytes buffered, whether TLS is on, and the serial
    (hex) of the certificate each recent sender authenticated with (empty without TLS)."""

    links: dict[str, LinkCounters] = field(default_factory=dict)
    refused: dict[str, int] = field(default_factory=dict)
    dropped: dict[str, int] = field(default_factory=dict)
    applied: int = 0
    inbound_streams: list[str] = field(default_factory=list)
    buffered_bytes: int = 0
    tls: bool = False
    certificate_serials: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ServerSnapshot:
        return cls(**{**data, "links": {p: LinkCounters(**link) for p, link in data["links"].items()}})
