"""Per-link byte and frame counters, in both directions, keyed by the remote peer id.

A frame's size is ``message.ByteSize() + GRPC_FRAME_OVERHEAD``: the serialized protobuf plus gRPC's 5-byte
length-prefixed-message header (1 byte compressed flag + 4 bytes length). HTTP/2 frame headers (9 bytes per DATA
frame of up to 16 KiB), HPACK headers of the call, TCP/IP headers and TLS are NOT counted: the numbers are what
the application put on the link, comparable across transports, and within ~0.1% of the HTTP/2 payload for
chunked updates.
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass, field, replace

GRPC_FRAME_OVERHEAD = 5
UNKNOWN_PEER = "?"  # frames before a peer identified itself (e.g. a refused or garbled Hello)


@dataclass
class LinkCounters:
    """Counters of one remote peer (bytes include GRPC_FRAME_OVERHEAD per frame)."""

    bytes_sent: int = 0
    bytes_received: int = 0
    frames_sent: int = 0
    frames_received: int = 0
    last_seen: float = field(default=0.0)  # wall clock (time.time()) of the last frame received, 0 = never


class LinkAccounting:
    """Thread-safe table of :class:`LinkCounters` (the status thread reads it while the loop writes)."""

    def __init__(self) -> None:
        self._links: dict[str, LinkCounters] = {}
        self._lock = threading.Lock()

    def sent(self, peer_id: str, message_bytes: int) -> None:
        """Count one frame sent to ``peer_id``; ``message_bytes`` is the serialized size (ByteSize())."""
        with self._lock:
            link = self._links.setdefault(peer_id, LinkCounters())
            link.bytes_sent += message_bytes + GRPC_FRAME_OVERHEAD
            link.frames_sent += 1

    def received(self, peer_id: str, message_bytes: int) -> None:
        """Count one frame received from ``peer_id``."""
        with self._lock:
            link = self._links.setdefault(peer_id, LinkCounters())
            link.bytes_received += message_bytes + GRPC_FRAME_OVERHEAD
            link.frames_received += 1
            link.last_seen = time.time()

    def forget(self, peer_id: str) -> None:
        """Drop a departed peer's counters (the table stays bounded under churn)."""
        with self._lock:
            self._links.pop(peer_id, None)

    def get(self, peer_id: str) -> LinkCounters:
        """A copy of one link's counters (zeros if never seen)."""
        with self._lock:
            return LinkCounters(**asdict(self._links.get(peer_id, LinkCounters())))

    def counters(self) -> dict[str, LinkCounters]:
        """A copy of every link's counters, taken at one instant."""
        with self._lock:
            return {peer: replace(link) for peer, link in self._links.items()}

    def snapshot(self) -> dict[str, dict[str, float]]:
        """All links as plain dicts (JSON-ready)."""
        return {peer: asdict(link) for peer, link in self.counters().items()}
