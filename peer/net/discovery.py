"""Finding neighbours: mDNS/DNS-SD via python-zeroconf (``_lpdl._tcp.local.``) plus static ``host:port`` peers.

Each peer registers ``<peer_id>._lpdl._tcp.local.`` with TXT ``id``, ``proto``, ``fp``, ``fleet``, ``alg`` on the
chosen interface addresses, browses the same type, and keeps ``{peer_id: PeerAddr}``. Peers of another fleet,
protocol, fingerprint or algorithm are ignored with one log line per peer saying which field and both values.

mDNS peers leave the set on a goodbye or when zeroconf's cache expires their records (TTL); static peers, whose ids
are unknown until asked, are resolved with the Identify RPC (peer/net/client.py) by :meth:`refresh_static`, and
expire ``expiry_s`` seconds after their last successful answer.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from dataclasses import dataclass

from zeroconf import IPVersion, ServiceStateChange, Zeroconf
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

from peer.net.api import Identity
from peer.net.client import identify
from peer.net.config import NetConfig

log = logging.getLogger(__name__)

SERVICE_TYPE = "_lpdl._tcp.local."


@dataclass(frozen=True)
class PeerAddr:
    """Where a live peer listens; ``last_seen`` is wall-clock seconds (time.time())."""

    host: str
    port: int
    last_seen: float

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


def _txt(identity: Identity) -> dict[str, str]:
    return {"id": identity.peer_id, "proto": str(identity.protocol_version), "fp": identity.fingerprint,
            "fleet": identity.fleet, "alg": identity.algorithm}


def _identity_from_txt(props: dict[bytes, bytes | None], listen_addr: str) -> Identity:
    def get(key: str) -> str:
        value = props.get(key.encode())
        return value.decode("utf-8", "replace") if value else ""

    proto = get("proto")
    return Identity(peer_id=get("id"), protocol_version=int(proto) if proto.isdigit() else -1,
                    fingerprint=get("fp"), fleet=get("fleet"), listen_addr=listen_addr, algorithm=get("alg"))


class Discovery:
    """Live peer set from mDNS and static neighbours.

    Args:
        identity: this peer (its TXT record; the reference for compatibility checks).
        port: TCP port of this peer's gRPC server.
        addresses: IPv4 addresses to advertise and to run mDNS on (restricts interfaces); None = all interfaces.
        static: ``host:port`` neighbours to resolve with Identify.
        mdns: False disables zeroconf entirely (static neighbours only).
        expiry_s: a static peer that did not answer for this many seconds leaves the set.
        config: transport config (Identify timeouts).
    """

    def __init__(self, identity: Identity, port: int, addresses: list[str] | None = None,
                 static: list[str] | None = None, mdns: bool = True, expiry_s: float = 60.0,
                 config: NetConfig | None = None) -> None:
        self.identity = identity
        self.port = port
        self.addresses = addresses
        self.static = list(static or [])
        self.mdns = mdns
        self.expiry_s = expiry_s
        self.config = config or NetConfig()
        self._mdns_peers: dict[str, PeerAddr] = {}
        self._mdns_names: dict[str, str] = {}  # service name -> peer id
        self._static_peers: dict[str, PeerAddr] = {}
        self._ignored: set[tuple[str, str]] = set()  # (peer id or address, reason) already logged
        self._zc: AsyncZeroconf | None = None
        self._browser: AsyncServiceBrowser | None = None
        self._info = None
        self._tasks: set[asyncio.Task] = set()

    @property
    def service_name(self) -> str:
        return f"{self.identity.peer_id}.{SERVICE_TYPE}"

    async def start(self) -> None:
        """Register this peer, start browsing, and resolve static neighbours once."""
        if self.mdns:
            interfaces = self.addresses if self.addresses else None
            self._zc = AsyncZeroconf(interfaces=interfaces, ip_version=IPVersion.V4Only) if interfaces else \
                AsyncZeroconf(ip_version=IPVersion.V4Only)
            advertised = self.addresses or [_primary_ipv4()]
            self._info = AsyncServiceInfo(
                SERVICE_TYPE, self.service_name, port=self.port, properties=_txt(self.identity),
                addresses=[socket.inet_aton(a) for a in advertised], server=f"{self.identity.peer_id}.local.")
            await (await self._zc.async_register_service(self._info))  # returns a task: wait for the announce
            self._browser = AsyncServiceBrowser(self._zc.zeroconf, SERVICE_TYPE, handlers=[self._on_change])
            log.info("discovery: registered %s on %s port %d", self.service_name, ", ".join(advertised), self.port)
        await self.refresh_static()

    async def close(self) -> None:
        """Say goodbye (unregister) and stop browsing."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._zc is not None:
            if self._browser is not None:
                await self._browser.async_cancel()
            if self._info is not None:
                await (await self._zc.async_unregister_service(self._info))  # goodbye actually sent
            await self._zc.async_close()
            self._zc = None

    def peers(self) -> dict[str, PeerAddr]:
        """The live, compatible peers (this peer excluded); static entries past ``expiry_s`` are dropped."""
        now = time.time()
        for peer_id in [p for p, a in self._static_peers.items() if now - a.last_seen > self.expiry_s]:
            log.info("discovery: static peer %s at %s expired", peer_id, self._static_peers[peer_id].address)
            del self._static_peers[peer_id]
        merged = dict(self._mdns_peers)
        merged.update(self._static_peers)
        return merged

    async def refresh_static(self) -> None:
        """Ask every static neighbour who it is (Identify); call periodically to keep them alive."""
        results = await asyncio.gather(*(identify(a, self.config) for a in self.static), return_exceptions=True)
        for address, result in zip(self.static, results):
            if isinstance(result, BaseException):
                log.debug("discovery: static neighbour %s did not answer: %r", address, result)
                continue
            if self._compatible(result, address):
                host, _, port = address.rpartition(":")
                self._static_peers[result.peer_id] = PeerAddr(host, int(port), time.time())

    # --- mDNS --------------------------------------------------------------------------------------------------
    def _on_change(self, zeroconf: Zeroconf, service_type: str, name: str,
                   state_change: ServiceStateChange) -> None:
        if state_change is ServiceStateChange.Removed:
            peer_id = self._mdns_names.pop(name, None)
            if peer_id is not None and self._mdns_peers.pop(peer_id, None) is not None:
                log.info("discovery: peer %s left (%s)", peer_id, name)
            return
        task = asyncio.get_running_loop().create_task(self._resolve(name))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _resolve(self, name: str) -> None:
        if self._zc is None or name == self.service_name:
            return
        info = AsyncServiceInfo(SERVICE_TYPE, name)
        if not await info.async_request(self._zc.zeroconf, int(self.config.connect_timeout_s * 1000)):
            log.debug("discovery: could not resolve %s", name)
            return
        hosts = info.parsed_addresses(IPVersion.V4Only)
        if not hosts or info.port is None:
            return
        address = f"{hosts[0]}:{info.port}"
        identity = _identity_from_txt(info.properties, address)
        if not self._compatible(identity, address):
            return
        known = self._mdns_peers.get(identity.peer_id)
        self._mdns_names[name] = identity.peer_id
        self._mdns_peers[identity.peer_id] = PeerAddr(hosts[0], info.port, time.time())
        if known is None or known.address != address:
            log.info("discovery: found peer %s at %s", identity.peer_id, address)

    def _compatible(self, other: Identity, where: str) -> bool:
        if other.peer_id == self.identity.peer_id:
            return False
        mismatch = self.identity.mismatch(other)
        if mismatch is None and other.peer_id:
            return True
        reason, ours, theirs = mismatch or ("peer_id", self.identity.peer_id, "")
        key = (other.peer_id or where, reason)
        if key not in self._ignored:
            self._ignored.add(key)
            log.warning("discovery: ignoring peer %r at %s: %s mismatch (theirs=%r, ours=%r)",
                        other.peer_id, where, reason, theirs, ours)
        return False


def _primary_ipv4() -> str:
    """The address of the interface that routes outward (no packet is sent), or loopback if none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"
