"""What a fleet certificate says about its holder, and the names TLS checks.

A certificate issued by the fleet CA (peer/security/ca.py) binds one identity in a URI subject alternative name::

    lpdl://<fleet>/peer/<peer_id>        a device (may gossip, pull the model, read status)
    lpdl://<fleet>/operator/<name>       an operator (may read status and identify peers, never gossip)

and, for devices, two DNS names the connecting side checks with gRPC's target-name override (the ids themselves may
hold characters a DNS name cannot, so the names are digests): :func:`peer_server_name` proves the server holds the
certificate of the peer the client meant; :func:`fleet_server_name` proves it is some device of the fleet (Identify
of a static neighbour, ``status --peer``). Nothing here trusts a Hello, an mDNS record or a status document.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit

from cryptography import x509

from peer.errors import PeerError

log = logging.getLogger(__name__)

URI_SCHEME = "lpdl"
ROLE_PEER = "peer"
ROLE_OPERATOR = "operator"
ROLES = (ROLE_PEER, ROLE_OPERATOR)


class IdentityError(PeerError, ValueError):
    """A certificate that binds no usable fleet identity (missing or malformed URI, another fleet, revoked)."""

    default_reason = "identity"


@dataclass(frozen=True)
class CertIdentity:
    """The identity one certificate binds.

    Attributes:
        fleet: fleet name.
        role: ``peer`` (a device) or ``operator``.
        name: the peer id (devices) or the operator's name.
        serial: the certificate's serial number (what revocation names).
    """

    fleet: str
    role: str
    name: str
    serial: int = 0

    @property
    def uri(self) -> str:
        return identity_uri(self.fleet, self.role, self.name)

    @property
    def is_peer(self) -> bool:
        return self.role == ROLE_PEER


def identity_uri(fleet: str, role: str, name: str) -> str:
    """The URI SAN a certificate for (fleet, role, name) carries."""
    return f"{URI_SCHEME}://{quote(fleet, safe='')}/{role}/{quote(name, safe='')}"


def _digest_name(prefix: str, text: str) -> str:
    return f"{prefix}{hashlib.sha256(text.encode()).hexdigest()[:40]}.lpdl"


def peer_server_name(fleet: str, peer_id: str) -> str:
    """DNS SAN naming one device of one fleet (the client's target-name override when it dials that peer)."""
    return _digest_name("p", f"{fleet}/{peer_id}")


def fleet_server_name(fleet: str) -> str:
    """DNS SAN every device certificate of ``fleet`` carries (dialing a peer whose id is not known yet)."""
    return _digest_name("f", fleet)


def identity_of(cert: x509.Certificate) -> CertIdentity:
    """The fleet identity in a certificate's URI SAN; raises :class:`IdentityError` if there is none or several."""
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        raise IdentityError("certificate has no subject alternative name (not issued by `lpdl-peer ca issue`)") \
            from None
    uris = [u for u in san.get_values_for_type(x509.UniformResourceIdentifier) if u.startswith(f"{URI_SCHEME}://")]
    if len(uris) != 1:
        raise IdentityError(f"certificate carries {len(uris)} {URI_SCHEME}:// identities, expected exactly 1")
    parts = urlsplit(uris[0])
    role, _, name = parts.path.lstrip("/").partition("/")
    if role not in ROLES or not name or not parts.netloc:
        raise IdentityError(f"certificate identity {uris[0]!r} is not lpdl://<fleet>/<peer|operator>/<name>")
    return CertIdentity(fleet=unquote(parts.netloc), role=role, name=unquote(name), serial=cert.serial_number)


def identity_from_pem(pem: bytes) -> CertIdentity:
    """:func:`identity_of` for a PEM certificate (the first one if a chain is given)."""
    try:
        cert = x509.load_pem_x509_certificate(pem)
    except ValueError as exc:
        raise IdentityError(f"unreadable certificate: {exc}") from None
    return identity_of(cert)


class Revocations:
    """The fleet's revocation list: one entry per line, ``serial:<hex>`` (one certificate) or ``peer:<peer_id>``
    (every certificate of that device); ``#`` starts a comment. Re-read whenever the file changes, so revoking needs
    no restart: copy the CA's list (``lpdl-peer ca revoke``) to every device's TLS directory.

    Args:
        path: the list's file; a missing file revokes nothing.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._stamp: tuple[int, int] | None = None
        self._serials: frozenset[int] = frozenset()
        self._peers: frozenset[str] = frozenset()
        self._lock = threading.Lock()

    def _refresh(self) -> None:
        try:
            st = os.stat(self.path)
            stamp = (st.st_mtime_ns, st.st_size)
        except FileNotFoundError:
            stamp = None
        with self._lock:
            if stamp == self._stamp:
                return
            try:
                serials, peers = parse_revocations(self.path.read_text() if stamp else "")
            except (OSError, ValueError) as exc:  # keep enforcing the last good list; say why once per change
                log.error("revocation list %s not reloaded, the previous one stays in force: %s", self.path, exc)
                self._stamp = stamp
                return
            self._stamp, self._serials, self._peers = stamp, serials, peers

    def revoked(self, identity: CertIdentity) -> bool:
        """Whether this certificate (by serial) or this device (by peer id) is revoked."""
        self._refresh()
        return identity.serial in self._serials or (identity.is_peer and identity.name in self._peers)

    def peer_revoked(self, peer_id: str) -> bool:
        """Whether every certificate of device ``peer_id`` is revoked (the client then never dials it)."""
        self._refresh()
        return peer_id in self._peers


def parse_revocations(text: str) -> tuple[frozenset[int], frozenset[str]]:
    """(serials, peer ids) of a revocation list; raises ValueError naming the bad line."""
    serials: set[int] = set()
    peers: set[str] = set()
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        kind, _, value = line.partition(":")
        if kind == "serial":
            try:
                serials.add(int(value, 16))
            except ValueError:
                raise ValueError(f"revocation list line {number}: serial {value!r} is not hexadecimal") from None
        elif kind == "peer" and value:
            peers.add(value)
        else:
            raise ValueError(f"revocation list line {number}: expected serial:<hex> or peer:<id>, got {line!r}")
    return frozenset(serials), frozenset(peers)
