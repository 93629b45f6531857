"""gRPC transport security built from a TLS directory (peer/security/ca.py): mutual TLS for every call, with the
caller's identity taken from its certificate, or an explicit insecure mode for a lab.

    security = TransportSecurity.from_dir(Path("/var/lib/lpdl-peer/tls"), fleet="lab")
    server.add_secure_port(addr, security.server_credentials())       # re-reads rotated files per handshake
    async with security.channel("10.0.0.2:7070", peer_id="dev-b") as ch:  # TLS verifies it IS dev-b
        ...
    caller = security.caller(context)   # in a handler: CertIdentity from the TLS peer, or Unauthenticated

Rotation: the files are re-read when they change (mtime/size), on the next handshake (server) or the next channel
(client); a key and certificate that do not match (a copy half done) keep the previous pair in use. Revocation: the
``revoked`` file of the TLS directory (identity.Revocations), checked on every call.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from peer.errors import PeerError
from peer.security.ca import CA_CERT, CERT, KEY, REVOKED
from peer.security.identity import (
    CertIdentity,
    IdentityError,
    Revocations,
    fleet_server_name,
    identity_from_pem,
    identity_of,
    peer_server_name,
)

log = logging.getLogger(__name__)


class Unauthenticated(PeerError):
    """The caller presented no usable fleet certificate; ``reason`` is a short counter key."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message, reason=reason)


class TlsConfigError(PeerError, ValueError):
    """The TLS directory is missing, unreadable or for another identity; the message names the file."""

    default_reason = "tls_config"


@dataclass(frozen=True)
class KeyPair:
    """One loaded (CA bundle, certificate, key) triple and the identity the certificate binds."""

    ca_pem: bytes
    cert_pem: bytes
    key_pem: bytes
    identity: CertIdentity


def load_pair(tls_dir: Path) -> KeyPair:
    """Read and check a TLS directory: readable files, a key matching the certificate, a fleet identity."""
    try:
        ca_pem, cert_pem, key_pem = ((tls_dir / name).read_bytes() for name in (CA_CERT, CERT, KEY))
    except OSError as exc:
        raise TlsConfigError(f"TLS directory {tls_dir}: cannot read {exc.filename} ({exc.strerror}); create it "
                             f"with `lpdl-peer ca issue`, or run with --insecure in a lab") from None
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
        key = serialization.load_pem_private_key(key_pem, password=None)
        x509.load_pem_x509_certificates(ca_pem)
    except ValueError as exc:
        raise TlsConfigError(f"TLS directory {tls_dir}: unreadable PEM ({exc})") from None
    if cert.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo) \
            != key.public_key().public_bytes(serialization.Encoding.DER,
                                             serialization.PublicFormat.SubjectPublicKeyInfo):
        raise TlsConfigError(f"TLS directory {tls_dir}: {KEY} does not match {CERT}")
    try:
        identity = identity_of(cert)
    except IdentityError as exc:
        raise TlsConfigError(f"TLS directory {tls_dir}: {CERT}: {exc}") from None
    return KeyPair(ca_pem, cert_pem, key_pem, identity)


class TransportSecurity:
    """Credentials and caller checks for one peer or operator.

    Use :meth:`from_dir` (mutual TLS) or :meth:`insecure` (no TLS: anyone reaching the port is trusted by the
    identity it claims - a lab only).

    Args:
        tls_dir: the TLS directory, or None for insecure mode.
        fleet: the fleet the holder belongs to; certificates of another fleet are refused.
    """

    def __init__(self, tls_dir: Path | None, fleet: str) -> None:
        self.tls_dir = tls_dir
        self.fleet = fleet
        self._lock = threading.Lock()
        self._pair: KeyPair | None = None
        self._stamp: tuple[tuple[int, int, int] | None, ...] | None = None
        self.revocations = Revocations(tls_dir / REVOKED) if tls_dir is not None else None
        if tls_dir is not None:
            self._pair = load_pair(tls_dir)
            self._stamp = self._files_stamp()
            if self._pair.identity.fleet != fleet:
                raise TlsConfigError(f"TLS directory {tls_dir}: certificate is for fleet "
                                     f"{self._pair.identity.fleet!r}, this peer runs fleet {fleet!r}")

    @classmethod
    def from_dir(cls, tls_dir: Path, fleet: str) -> "TransportSecurity":
        return cls(tls_dir, fleet)

    @classmethod
    def for_holder(cls, tls_dir: Path) -> "TransportSecurity":
        """Credentials of whoever the certificate in ``tls_dir`` names, in its own fleet (operators' tools)."""
        return cls(tls_dir, load_pair(tls_dir).identity.fleet)

    @classmethod
    def insecure(cls, fleet: str = "") -> "TransportSecurity":
        """No TLS, callers trusted by the identity they claim: a lab only, chosen explicitly (the server and
        discovery log it as INSECURE when they start)."""
        return cls(None, fleet)

    @property
    def secure(self) -> bool:
        return self.tls_dir is not None

    @property
    def identity(self) -> CertIdentity | None:
        """Whom this holder's current certificate names (None when insecure)."""
        return self.current().identity if self.secure else None

    # --- files -------------------------------------------------------------------------------------------------
    def _files_stamp(self) -> tuple[tuple[int, int, int] | None, ...]:
        """(mtime ns, size, inode) of the CA, certificate and key files, None for one missing: a change means
        the files were rotated."""
        assert self.tls_dir is not None
        stamp: list[tuple[int, int, int] | None] = []
        for name in (CA_CERT, CERT, KEY):
            try:
                st = os.stat(self.tls_dir / name)
                stamp.append((st.st_mtime_ns, st.st_size, st.st_ino))
            except OSError:
                stamp.append(None)
        return tuple(stamp)

    def current(self) -> KeyPair:
        """The newest consistent key pair (re-read when the files changed; a half-copied rotation keeps the old
        pair and says why)."""
        assert self.tls_dir is not None and self._pair is not None
        stamp = self._files_stamp()
        with self._lock:
            if stamp != self._stamp:
                self._stamp = stamp
                try:
                    pair = load_pair(self.tls_dir)
                    if pair.identity.fleet != self.fleet or pair.identity.name != self._pair.identity.name:
                        raise TlsConfigError(f"new certificate names {pair.identity.uri}, expected "
                                             f"{self._pair.identity.uri}")
                except TlsConfigError as exc:
                    log.error("TLS files changed but were not loaded, the previous certificate stays in use: %s",
                              exc)
                else:
                    if pair.cert_pem != self._pair.cert_pem or pair.ca_pem != self._pair.ca_pem:
                        log.info("TLS: loaded rotated credentials from %s (certificate serial %x)", self.tls_dir,
                                 pair.identity.serial)
                    self._pair = pair
            return self._pair

    # --- server ------------------------------------------------------------------------------------------------
    def server_credentials(self, on_connection: Callable[[], None] | None = None) -> grpc.ServerCredentials | None:
        """Mutual-TLS server credentials that pick up rotated files at each new handshake (None: insecure);
        ``on_connection`` is called once per new connection, before its handshake (peer/net/guard.py counts them)."""
        if not self.secure:
            return None
        served: list[KeyPair] = []

        def config(pair: KeyPair) -> grpc.ServerCertificateConfiguration:
            served[:] = [pair]
            return grpc.ssl_server_certificate_configuration([(pair.key_pem, pair.cert_pem)], pair.ca_pem)

        def fetch() -> grpc.ServerCertificateConfiguration | None:
            if on_connection is not None:
                on_connection()
            try:
                pair = self.current()
            except Exception:  # noqa: BLE001 - runs inside gRPC's handshake: never raise there
                log.exception("TLS: reading credentials failed; the previous ones stay in use")
                return None
            return None if served and served[0] is pair else config(pair)

        return grpc.dynamic_ssl_server_credentials(config(self.current()), fetch,
                                                   require_client_authentication=True)

    def caller(self, context: grpc.aio.ServicerContext) -> CertIdentity | None:
        """The caller's identity from its TLS certificate (None in insecure mode).

        Raises:
            Unauthenticated: no certificate, another fleet's, an unusable one, or a revoked one.
        """
        if not self.secure:
            return None
        auth = context.auth_context() or {}
        pems = auth.get("x509_pem_cert") or []
        if not pems:
            raise Unauthenticated("no_certificate", f"{context.peer()} presented no client certificate")
        try:
            identity = identity_from_pem(pems[0])
        except IdentityError as exc:
            raise Unauthenticated("bad_certificate", f"{context.peer()}: {exc}") from None
        if identity.fleet != self.fleet:
            raise Unauthenticated("wrong_fleet", f"{context.peer()} holds a certificate of fleet "
                                                 f"{identity.fleet!r}, this is fleet {self.fleet!r}")
        assert self.revocations is not None
        if self.revocations.revoked(identity):
            raise Unauthenticated("revoked", f"{context.peer()} holds a revoked certificate ({identity.uri}, "
                                             f"serial {identity.serial:x})")
        return identity

    # --- client ------------------------------------------------------------------------------------------------
    def channel(self, address: str, options: Sequence[tuple[str, object]],
                peer_id: str | None = None) -> grpc.aio.Channel:
        """A channel to ``address``; with TLS the server must prove it is device ``peer_id`` of this fleet (any
        device of the fleet when ``peer_id`` is None). Raises :class:`Unauthenticated` for a revoked ``peer_id``."""
        if not self.secure:
            return grpc.aio.insecure_channel(address, options=options)
        if peer_id is not None and self.peer_revoked(peer_id):
            raise Unauthenticated("revoked", f"peer {peer_id} is revoked; not dialing {address}")
        pair = self.current()
        name = peer_server_name(self.fleet, peer_id) if peer_id is not None else fleet_server_name(self.fleet)
        credentials = grpc.ssl_channel_credentials(pair.ca_pem, pair.key_pem, pair.cert_pem)
        return grpc.aio.secure_channel(address, credentials,
                                       options=[*options, ("grpc.ssl_target_name_override", name)])

    def peer_revoked(self, peer_id: str) -> bool:
        """Whether the revocation list names device ``peer_id`` (always False when insecure)."""
        return self.revocations is not None and self.revocations.peer_revoked(peer_id)


def required_security(security: object, user: str) -> TransportSecurity:
    """``security`` if it is a :class:`TransportSecurity`; the servers, clients and discovery call this so that no
    missing argument silently turns into an unauthenticated fleet.

    Raises:
        TypeError: ``security`` is None or something else; the message names ``user`` and the explicit lab choice.
    """
    if not isinstance(security, TransportSecurity):
        raise TypeError(f"{user}: security must be a TransportSecurity, got {security!r}; pass "
                        f"TransportSecurity.from_dir(...) for mutual TLS, or TransportSecurity.insecure() "
                        f"explicitly for a lab")
    return security
