"""Every knob of the transport in one typed place (timeouts in seconds, sizes in bytes)."""

from __future__ import annotations

from dataclasses import dataclass

from peer.config import check
from peer.gossip.ledger import DEFAULT_MAX_PEERS

KIB = 1024
MIB = 1024 * KIB


@dataclass(frozen=True)
class NetConfig:
    """Transport settings shared by the server, the edge senders and discovery.

    Attributes:
        connect_timeout_s: seconds to get a TCP/HTTP2 connection up and, separately, the Hello answered.
        ack_timeout_s: seconds from the last chunk of an update to its Ack; past it the stream counts as broken
            (the reconnect handshake then settles the message). Must cover a full payload on the slowest link.
        keepalive_time_s: seconds between HTTP/2 pings on an idle connection (detects dead peers and NATs).
        keepalive_timeout_s: seconds to wait for a ping answer before the connection is dropped.
        backoff_base_s: first reconnect delay; doubles per failed attempt, full jitter in [delay/2, delay].
        backoff_max_s: cap of the reconnect delay.
        close_timeout_s: on close(), seconds to wait for an outstanding Ack and then for the settling handshake.
        drain_timeout_s: on a clean stop with mDNS, seconds the peer keeps serving after its goodbye so that its
            neighbours settle their last updates (refused by a stopping peer, then retracted by the handshake), not
            left in flight to a peer that is gone (they stop sending and close their edges within a round or two;
            the stop waits at most this long).
        chunk_bytes: payload bytes per Update chunk the sender cuts (default 1 MiB: one stream message per update
            up to that size; grpc.aio's cost per message, not per byte, bounds a stream of smaller messages).
        batch_bytes: most payload bytes of the whole updates (each at most chunk_bytes) the sender packs into one
            UpdateBatch frame when several are queued on an edge (wire.update_frames); with the default window of
            32, 64 KiB updates go 16 to a frame, two frames in flight. A sender's frame being written holds at most
            this much (plus a few dozen bytes per update), on top of the window's unsettled payloads.
        max_chunk_bytes: largest chunk the server accepts; a larger one is refused.
        max_payload_bytes: largest complete update (sum of chunks) the server accepts.
        max_message_bytes: gRPC message size limit (both directions); must exceed max_chunk_bytes plus headers.
        model_chunk_bytes: bytes per GetModel chunk.
        max_model_bytes: largest model a joiner accepts from GetModel.
        max_peers: most peers this peer keeps per-peer state for (replicas, ledgers, streams, links); a new peer
            beyond it is refused. Also bounds the push-sum weight a sender may claim (a fleet's weights sum to its
            number of peers).
        max_connections: most TCP connections the server keeps (more are closed by gRPC at accept).
        max_concurrent_rpcs: most calls the server runs at once (more get RESOURCE_EXHAUSTED).
        max_streams_per_connection: HTTP/2 streams one connection may open at once.
        handshake_timeout_s: seconds a new connection may take to complete its TLS and HTTP/2 handshakes before the
            server closes it (gRPC's own default is 120 s: 255 idle TCP connections from a host without a
            certificate then held every slot of ``max_connections``). A handshake on the slowest link of a fleet
            takes tens of milliseconds; keep it above ``connect_timeout_s`` of a peer on a congested link.
        reassembly_timeout_s: seconds an update may take from its first to its last chunk; a sender that stalls
            longer is refused and its partial bytes freed. Must cover the largest update on the slowest link.
        max_buffered_bytes: most bytes all partially received updates together may hold; a chunk that would
            pass it is refused (the sender reconnects and retries; nothing is lost).
        get_model_rate_per_s: sustained GetModel calls per second the server serves to each caller (joiners are
            rare; per caller, so one device that drains its budget leaves a joiner's untouched).
        get_model_burst: GetModel calls served back to back to one caller before the rate applies.
        max_updates_per_s: sustained updates per second one sender may have applied (an honest peer sends one per
            round per edge; a round takes well over 20 ms); more are refused (REFUSAL_LIMIT, counter
            ``update_rate``) and the sender's stream ends, its messages stay in flight for the next handshake.
        update_burst: updates of one sender applied back to back before the rate applies (a reconnect resends up to
            a whole window, at most 64).
        liveness_interval_s: seconds between Identify checks of every known neighbour (mDNS and static). A peer
            killed without a goodbye (power cut, SIGKILL) keeps its mDNS record in the others' caches for up to
            the record's TTL (75 min for zeroconf's service records); these checks are what notice it.
        peer_expiry_s: a neighbour that has not answered Identify for this many seconds leaves the live set, so
            the topology closes the gap it left (on a ring: its successor gets a new predecessor). An mDNS peer is
            kept as a candidate and comes back at the first check it answers (a healed link cut); a goodbye or
            the record's expiry forgets it. Lower it for faster repair, keep it well above
            ``liveness_interval_s + connect_timeout_s`` so that one lost check does not evict a live peer.
        revocation_check_s: seconds between two looks at the TLS directory's revocation list for calls already
            open (a new call is checked when it opens); a revoked device's open stream ends within about this.
    """

    connect_timeout_s: float = 5.0
    ack_timeout_s: float = 30.0
    keepalive_time_s: float = 20.0
    keepalive_timeout_s: float = 10.0
    backoff_base_s: float = 0.5
    backoff_max_s: float = 30.0
    close_timeout_s: float = 5.0
    drain_timeout_s: float = 3.0
    chunk_bytes: int = 1 * MIB
    batch_bytes: int = 1 * MIB
    max_chunk_bytes: int = 1 * MIB
    max_payload_bytes: int = 256 * MIB
    max_message_bytes: int = 4 * MIB
    model_chunk_bytes: int = 256 * KIB
    max_model_bytes: int = 1024 * MIB
    max_peers: int = DEFAULT_MAX_PEERS
    max_connections: int = 256
    max_concurrent_rpcs: int = 256
    max_streams_per_connection: int = 32
    handshake_timeout_s: float = 2.0
    revocation_check_s: float = 1.0
    max_updates_per_s: float = 50.0
    update_burst: int = 128
    reassembly_timeout_s: float = 60.0
    max_buffered_bytes: int = 256 * MIB
    get_model_rate_per_s: float = 0.1
    get_model_burst: int = 4
    liveness_interval_s: float = 10.0
    peer_expiry_s: float = 60.0

    def __post_init__(self) -> None:
        for name in ("connect_timeout_s", "ack_timeout_s", "keepalive_time_s", "keepalive_timeout_s",
                     "backoff_base_s", "backoff_max_s", "close_timeout_s", "drain_timeout_s", "reassembly_timeout_s",
                     "get_model_rate_per_s", "liveness_interval_s", "peer_expiry_s", "handshake_timeout_s",
                     "revocation_check_s", "max_updates_per_s"):
            check(getattr(self, name) > 0, f"net.{name}", getattr(self, name), "expected > 0 seconds")
        check(self.backoff_max_s >= self.backoff_base_s, "net.backoff_max_s", self.backoff_max_s,
              f"expected >= net.backoff_base_s ({self.backoff_base_s})")
        check(0 < self.chunk_bytes <= self.max_chunk_bytes, "net.chunk_bytes", self.chunk_bytes,
              f"expected 1..net.max_chunk_bytes ({self.max_chunk_bytes})")
        check(self.peer_expiry_s > self.liveness_interval_s, "net.peer_expiry_s", self.peer_expiry_s,
              f"expected > net.liveness_interval_s ({self.liveness_interval_s}): a live peer would be evicted "
              "between two checks")
        check(self.batch_bytes > 0, "net.batch_bytes", self.batch_bytes, "expected > 0")
        for name in ("max_peers", "max_connections", "max_concurrent_rpcs", "max_streams_per_connection",
                     "get_model_burst", "update_burst"):
            check(getattr(self, name) >= 1, f"net.{name}", getattr(self, name), "expected >= 1")
        check(self.max_buffered_bytes >= self.max_chunk_bytes, "net.max_buffered_bytes", self.max_buffered_bytes,
              f"expected >= net.max_chunk_bytes ({self.max_chunk_bytes})")
        headroom = 64 * KIB  # Update fields and protobuf framing around the chunk bytes
        for name in ("max_chunk_bytes", "model_chunk_bytes", "batch_bytes"):
            check(getattr(self, name) + headroom <= self.max_message_bytes, f"net.{name}", getattr(self, name),
                  f"expected <= net.max_message_bytes ({self.max_message_bytes}) - {headroom} header bytes")

    def channel_options(self) -> list[tuple[str, int]]:
        """gRPC channel/server options derived from this config (keepalive, message size)."""
        return [
            ("grpc.keepalive_time_ms", int(self.keepalive_time_s * 1000)),
            ("grpc.keepalive_timeout_ms", int(self.keepalive_timeout_s * 1000)),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_receive_message_length", self.max_message_bytes),
        ]

    def server_options(self) -> list[tuple[str, int]]:
        """Server side: the channel options plus tolerance for our clients' keepalive pings."""
        return self.channel_options() + [
            ("grpc.http2.min_recv_ping_interval_without_data_ms", int(self.keepalive_time_s * 1000 / 2)),
            ("grpc.http2.max_ping_strikes", 0),
            ("grpc.max_allowed_incoming_connections", self.max_connections),
            ("grpc.max_concurrent_streams", self.max_streams_per_connection),
            ("grpc.server_handshake_timeout_ms", int(self.handshake_timeout_s * 1000)),
        ]
