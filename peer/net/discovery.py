"""Finding neighbours: mDNS/DNS-SD via python-zeroconf (``_lpdl._tcp.local.``) plus static ``host:port`` peers.

Each peer registers ``<peer_id>._lpdl._tcp.local.`` with TXT ``id``, ``proto``, ``fp``, ``fleet``, ``alg`` on the
chosen interface addresses, browses the same type, and keeps ``{peer_id: PeerAddr}``. Peers of another fleet,
protocol, fingerprint or algorithm are ignored with one log line per peer saying which field and both values.

mDNS is only a hint about addresses (docs/design.md#trust): anyone on the LAN can publish a record. A record becomes a
live peer only after an Identify call to its address answers as the peer the record names - with TLS, the server
must hold that peer's certificate (peer/security), so a fake record, even one naming a real peer, never becomes a
neighbour. A peer already live at a verified address keeps it while that address still answers; a record only
removes the entry it created itself (a goodbye of a fake record leaves the real peer alone); the service name must
be ``<peer id>._lpdl._tcp.local.``; and at most ``max_peers`` records are kept or checked at once.

Liveness: every ``net.liveness_interval_s`` a background task asks every known neighbour who it is (Identify, the
same check that admitted it; a gossip frame from it counts too). A neighbour that has not answered for ``expiry_s``
seconds leaves the live set - a peer killed without a goodbye would otherwise stay a neighbour until zeroconf's
cache expires its record (75 min), leaving a hole in a ring. An mDNS peer stays a candidate and comes back at the
first check it answers (a healed link cut, a restart at the same address); it is forgotten on a goodbye or when its
record expires. Static peers, whose ids are unknown until asked, are resolved with the Identify RPC
(peer/net/client.py) by :meth:`refresh_static` and forgotten ``expiry_s`` after their last answer (the next answer
brings them back).
"""

from __future__ import annotations

import asyncio
import logging
import random
import socket
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from zeroconf import IPVersion, ServiceStateChange, Zeroconf
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

from peer.aio import cancel_and_wait
from peer.net.api import Identity
from peer.net.client import backoff_delay, identify
from peer.net.config import NetConfig
from peer.security.credentials import TransportSecurity, required_security

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
        expiry_s: a neighbour that did not answer Identify for this many seconds leaves the live set (default
            ``config.peer_expiry_s``).
        config: transport config (Identify timeouts, max_peers, liveness_interval_s).
        security: credentials for the Identify calls that verify records and static neighbours; required, with
            ``TransportSecurity.insecure()`` chosen explicitly for a lab (which still requires a record's address
            to answer as the peer it names). None raises TypeError.
        heard: ``peer_id -> wall-clock seconds`` of the last gossip frame from that peer (its updates or Acks,
            0 = never): counts as an answer, so a peer busy gossiping is not evicted because Identify calls timed
            out on a loaded machine.
    """

    def __init__(self, identity: Identity, port: int, addresses: list[str] | None = None,
                 static: list[str] | None = None, mdns: bool = True, expiry_s: float | None = None,
                 config: NetConfig | None = None, *, security: TransportSecurity,
                 heard: Callable[[str], float] | None = None) -> None:
        self.identity = identity
        self.heard = heard or (lambda peer_id: 0.0)
        self.port = port
        self.addresses = addresses
        self.static = list(static or [])
        self.mdns = mdns
        self.config = config or NetConfig()
        self.expiry_s = self.config.peer_expiry_s if expiry_s is None else expiry_s
        self.security = required_security(security, "Discovery")
        self._mdns_peers: dict[str, PeerAddr] = {}
        self._mdns_names: dict[str, str] = {}  # service name -> peer id of the entry that record created
        self.rejected: dict[str, int] = {}     # records not admitted, by reason (status and tests)
        self._static_peers: dict[str, PeerAddr] = {}
        self._ignored: set[tuple[str, str]] = set()  # (peer id or address, reason) already logged
        self._silent: set[str] = set()  # mDNS peers out of the live set for not answering (candidates still)
        self.evictions = 0  # times a neighbour left the live set for not answering (status and tests)
        self._zc: AsyncZeroconf | None = None
        self._browser: AsyncServiceBrowser | None = None
        self._info: AsyncServiceInfo | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        #: Records whose address did not prove to be the peer they name: service name -> re-checks so far. Each is
        #: re-checked with backoff (a peer that restarted while its neighbour was flooded must not stay excluded).
        self._unverified: dict[str, int] = {}
        self._rng = random.Random()
        self.registered = False  # this peer's own record announced on mDNS
        self.registration_error: str | None = None  # why it could not be (tests)

    @property
    def service_name(self) -> str:
        return f"{self.identity.peer_id}.{SERVICE_TYPE}"

    async def start(self) -> None:
        """Start browsing, start registering this peer (in the background: mDNS probing and announcing take about
        1.6 s, which the peer spends training, and the neighbours hear the announcement whenever it comes), and
        resolve static neighbours once."""
        if self.mdns:
            interfaces = self.addresses if self.addresses else None
            self._zc = AsyncZeroconf(interfaces=interfaces, ip_version=IPVersion.V4Only) if interfaces else \
                AsyncZeroconf(ip_version=IPVersion.V4Only)
            advertised = self.addresses or [_primary_ipv4()]
            self._info = AsyncServiceInfo(
                SERVICE_TYPE, self.service_name, port=self.port, properties=_txt(self.identity),
                addresses=[socket.inet_aton(a) for a in advertised], server=f"{self.identity.peer_id}.local.")
            self._browser = AsyncServiceBrowser(self._zc.zeroconf, SERVICE_TYPE, handlers=[self._on_change])
            self._spawn(self._register(self._zc, self._info, advertised), "register")
        await self.refresh_static()
        self._spawn(self._liveness_loop(), "liveness")

    async def _register(self, zc: AsyncZeroconf, info: AsyncServiceInfo, advertised: list[str]) -> None:
        """Probe for this peer's name and announce it; a failure (another host holds the name: peer ids must be
        unique) leaves the peer serving, reachable by static address only, and is logged."""
        try:
            await (await zc.async_register_service(info))  # probing, then a task: wait for the announcements
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # NonUniqueNameException, a socket error
            self.registration_error = f"{type(exc).__name__}: {exc}"
            log.error("discovery: %s not registered on mDNS (%s): neighbours reach this peer by static address "
                      "only", self.service_name, self.registration_error)
            return
        self.registered = True
        log.info("discovery: registered %s on %s port %d", self.service_name, ", ".join(advertised), self.port)

    async def close(self) -> None:
        """Say goodbye (unregister) and stop browsing."""
        await cancel_and_wait(self._tasks)
        if self._zc is not None:
            if self._browser is not None:
                await self._browser.async_cancel()
            if self._info is not None and self.registered:
                await (await self._zc.async_unregister_service(self._info))  # goodbye actually sent
            await self._zc.async_close()
            self._zc = None

    def peers(self) -> dict[str, PeerAddr]:
        """The live, compatible peers (this peer excluded): every entry that answered within ``expiry_s``."""
        now = time.time()
        for peer_id in [p for p, a in self._static_peers.items() if now - a.last_seen > self.expiry_s]:
            log.warning("discovery: static peer %s at %s has not answered for %.0f s; it leaves the live set",
                        peer_id, self._static_peers[peer_id].address, now - self._static_peers[peer_id].last_seen)
            del self._static_peers[peer_id]
            self.evictions += 1
        merged = {}
        for peer_id, addr in self._mdns_peers.items():
            if now - max(addr.last_seen, self.heard(peer_id)) <= self.expiry_s:
                merged[peer_id] = addr
                if peer_id in self._silent:
                    self._silent.discard(peer_id)
                    log.info("discovery: peer %s at %s answers again; back in the live set", peer_id, addr.address)
            elif peer_id not in self._silent:
                self._silent.add(peer_id)
                self.evictions += 1
                log.warning("discovery: peer %s at %s has not answered for %.0f s (its mDNS record may outlive it); "
                            "it leaves the live set until it answers again", peer_id, addr.address,
                            now - max(addr.last_seen, self.heard(peer_id)))
        merged.update(self._static_peers)
        return merged

    async def check_liveness(self) -> None:
        """Ask every static neighbour, and every mDNS peer (live or silent) not heard from over gossip within
        the last interval, who it is; answers renew their entries."""
        await self.refresh_static()
        recent = time.time() - self.config.liveness_interval_s
        known = [(p, a) for p, a in self._mdns_peers.items() if self.heard(p) < recent]
        answers = await asyncio.gather(*(self._answers(a.address, p) for p, a in known))
        for (peer_id, addr), answered in zip(known, answers):
            if not answered or self._mdns_peers.get(peer_id) is not addr:  # no answer, or replaced meanwhile
                continue
            self._mdns_peers[peer_id] = PeerAddr(addr.host, addr.port, time.time())

    async def _liveness_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.liveness_interval_s)
            try:
                await self.check_liveness()
            except Exception:  # noqa: BLE001 - a failed round of checks must not end the checks
                log.exception("discovery: liveness check failed")

    async def refresh_static(self) -> None:
        """Ask every static neighbour who it is (Identify); call periodically to keep them alive."""
        results = await asyncio.gather(*(identify(a, self.config, security=self.security) for a in self.static),
                                       return_exceptions=True)
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
            self._unverified.pop(name, None)
            peer_id = self._mdns_names.pop(name, None)  # only the entry this very record created
            if peer_id is not None and self._mdns_peers.pop(peer_id, None) is not None:
                self._silent.discard(peer_id)
                log.info("discovery: peer %s left (%s)", peer_id, name)
            return
        if len(self._tasks) > self.config.max_peers:  # the liveness task is one of them
            self._reject("busy", name, f"{len(self._tasks)} records already being checked")
            return
        self._spawn(self._resolve(name), f"resolve {name}")

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
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
        if name != f"{identity.peer_id}.{SERVICE_TYPE}":
            self._reject("name_mismatch", name, f"record names peer {identity.peer_id!r}")
            return
        known = self._mdns_peers.get(identity.peer_id)
        if known is not None and known.address == address:
            self._mdns_peers[identity.peer_id] = PeerAddr(hosts[0], info.port, time.time())
            self._mdns_names[name] = identity.peer_id
            return
        if known is None and len(self._mdns_peers) >= self.config.max_peers:
            self._reject("peer_limit", name, f"{len(self._mdns_peers)} mDNS peers kept (net.max_peers)")
            return
        if known is not None and await self._answers(known.address, identity.peer_id):
            self._reject("address_kept", name, f"peer {identity.peer_id} still answers at its verified address "
                                               f"{known.address}; record's {address} ignored")
            return
        if not await self._answers(address, identity.peer_id):
            self._reject("unverified", name, f"{address} did not prove to be peer {identity.peer_id}; re-checked "
                                             f"with backoff")
            self._recheck_later(name)
            return
        if self._unverified.pop(name, None):
            log.info("discovery: record %s verified at a re-check", name)
        self._mdns_names[name] = identity.peer_id
        self._mdns_peers[identity.peer_id] = PeerAddr(hosts[0], info.port, time.time())
        log.info("discovery: found peer %s at %s (verified%s)", identity.peer_id, address,
                 " by its certificate" if self.security.secure else " by Identify, NOT authenticated: insecure mode")

    def _recheck_later(self, name: str) -> None:
        """Resolve and verify record ``name`` again after a jittered backoff (net.liveness_interval_s doubling up to
        net.peer_expiry_s), until it verifies or its goodbye arrives; at most net.max_peers records at once."""
        attempt = self._unverified.get(name)
        if attempt is None and len(self._unverified) >= self.config.max_peers:
            return
        self._unverified[name] = (attempt or 0) + 1
        delay = backoff_delay(attempt or 0, self.config.liveness_interval_s, self.config.peer_expiry_s, self._rng)

        async def recheck() -> None:
            await asyncio.sleep(delay)
            if name in self._unverified:
                await self._resolve(name)

        self._spawn(recheck(), f"recheck {name}")

    async def _answers(self, address: str, peer_id: str) -> bool:
        """Whether ``address`` answers Identify as ``peer_id`` (with TLS: holds its certificate)."""
        try:
            answer = await identify(address, self.config, security=self.security, peer_id=peer_id)
        except Exception as exc:  # noqa: BLE001 - unreachable, TLS refused, revoked: all mean "not this peer"
            log.debug("discovery: %s did not answer as %s: %r", address, peer_id, exc)
            return False
        return answer.peer_id == peer_id and self.identity.mismatch(answer) is None

    def _reject(self, reason: str, name: str, why: str) -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1
        key = (name, reason)
        if key not in self._ignored and len(self._ignored) < 4 * self.config.max_peers:
            self._ignored.add(key)
            log.warning("discovery: record %s not admitted (%s): %s", name, reason, why)

    def _compatible(self, other: Identity, where: str) -> bool:
        if other.peer_id == self.identity.peer_id:
            return False
        mismatch = self.identity.mismatch(other)
        if mismatch is None and other.peer_id:
            return True
        reason, ours, theirs = mismatch or ("peer_id", self.identity.peer_id, "")
        key = (other.peer_id or where, reason)
        self.rejected[reason] = self.rejected.get(reason, 0) + 1
        if key not in self._ignored and len(self._ignored) < 4 * self.config.max_peers:
            self._ignored.add(key)
            log.warning("discovery: ignoring peer %r at %s: %s mismatch (theirs=%r, ours=%r)",
                        other.peer_id, where, reason, theirs, ours)
        return False


def _primary_ipv4() -> str:
    """The address of the interface that routes outward (no packet is sent), or loopback if none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            address: str = s.getsockname()[0]  # (host, port) of an AF_INET socket
            return address
        except OSError:
            return "127.0.0.1"
