"""The fleet's certificate authority: create it, issue device and operator certificates, revoke them.

CA directory (``lpdl-peer ca init``; keep it off the devices)::

    ca.pem       the CA certificate (every device and operator trusts it)
    ca.key       its private key (mode 0600)
    fleet        the fleet name the CA signs for (one line)
    revoked      revocation list (peer/security/identity.py: Revocations), copied to devices

A TLS directory (``lpdl-peer ca issue``; one per device or operator, the daemon's ``--tls-dir``)::

    ca.pem       the trusted CA certificate(s): during a CA rotation, the old and the new one concatenated
    cert.pem     this holder's certificate (binds fleet, role and name: identity.py)
    key.pem      its private key (mode 0600)
    revoked      optional: the fleet's revocation list

Keys are ECDSA P-256 (fast handshakes on a Raspberry Pi); certificates are valid ``days`` days. Re-issuing into the
same TLS directory while the daemon runs is a rotation: new connections use the new files, nothing restarts.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from peer.errors import PeerError
from peer.security.identity import (
    ROLE_PEER,
    ROLES,
    CertIdentity,
    fleet_server_name,
    identity_of,
    identity_uri,
    parse_revocations,
    peer_server_name,
)

CA_CERT = "ca.pem"
CA_KEY = "ca.key"
FLEET_FILE = "fleet"
REVOKED = "revoked"
CERT = "cert.pem"
KEY = "key.pem"
#: Default validity of a CA certificate (days).
CA_DAYS = 3650
#: Default validity of a device or operator certificate (days); rotate before it ends.
CERT_DAYS = 365
#: Tolerated clock skew between devices: certificates are valid from this long before their issue time.
BACKDATE = datetime.timedelta(hours=1)


class CaError(PeerError, ValueError):
    """A CA operation failed; the message names the file or field and nothing was written."""

    default_reason = "ca"


@dataclass(frozen=True)
class Issued:
    """What :func:`issue` wrote: the identity and the TLS directory."""

    identity: CertIdentity
    directory: Path


def _write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` readable by the owner only (created 0600, never world-readable in between)."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    os.replace(tmp, path)


def _write_public(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def init_ca(ca_dir: Path, fleet: str, days: int = CA_DAYS) -> Path:
    """Create a fleet CA in ``ca_dir`` (refuses to overwrite one); returns the CA certificate's path."""
    if not fleet or len(fleet) > 63:
        raise CaError(f"fleet name {fleet!r}: expected 1-63 characters")
    ca_dir.mkdir(parents=True, exist_ok=True)
    if (ca_dir / CA_KEY).exists() or (ca_dir / CA_CERT).exists():
        raise CaError(f"{ca_dir} already holds a CA ({CA_CERT}/{CA_KEY}); use another directory")
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"lpdl fleet CA {fleet}"[:64]),
                      x509.NameAttribute(NameOID.ORGANIZATION_NAME, "lpdl-peer")])
    now = _now()
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - BACKDATE)
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False),
                           critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    _write_private(ca_dir / CA_KEY, _key_pem(key))
    _write_public(ca_dir / CA_CERT, cert.public_bytes(serialization.Encoding.PEM))
    _write_public(ca_dir / FLEET_FILE, (fleet + "\n").encode())
    (ca_dir / REVOKED).touch()
    return ca_dir / CA_CERT


def _load_ca(ca_dir: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey, str]:
    try:
        cert = x509.load_pem_x509_certificate((ca_dir / CA_CERT).read_bytes())
        key = serialization.load_pem_private_key((ca_dir / CA_KEY).read_bytes(), password=None)
        fleet = (ca_dir / FLEET_FILE).read_text().strip()
    except FileNotFoundError as exc:
        raise CaError(f"{ca_dir} is not a fleet CA (missing {Path(exc.filename).name}; run `lpdl-peer ca init`)") \
            from None
    except ValueError as exc:
        raise CaError(f"{ca_dir}: unreadable CA files ({exc})") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise CaError(f"{ca_dir / CA_KEY}: expected an EC private key")
    return cert, key, fleet


def ca_fleet(ca_dir: Path) -> str:
    """The fleet name a CA signs for."""
    return _load_ca(ca_dir)[2]


def issue(ca_dir: Path, name: str, out_dir: Path, role: str = ROLE_PEER, days: int = CERT_DAYS) -> Issued:
    """Issue a certificate for device ``name`` (its peer id) or operator ``name`` into the TLS directory
    ``out_dir`` (ca.pem, cert.pem, key.pem, revoked). Writing over an existing one is a rotation: the key and the
    certificate are replaced one after the other by rename, and a daemon reading them keeps its old pair until
    both parse and match."""
    if role not in ROLES:
        raise CaError(f"role {role!r}: expected one of {', '.join(ROLES)}")
    if not name or len(name) > 128 or any(c.isspace() or c in "/#" for c in name):
        raise CaError(f"name {name!r}: expected 1-128 characters without spaces, '/' or '#'")
    ca_cert, ca_key, fleet = _load_ca(ca_dir)
    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    sans: list[x509.GeneralName] = [x509.UniformResourceIdentifier(identity_uri(fleet, role, name))]
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH]
    if role == ROLE_PEER:
        sans += [x509.DNSName(peer_server_name(fleet, name)), x509.DNSName(fleet_server_name(fleet))]
        usages.append(ExtendedKeyUsageOID.SERVER_AUTH)
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{role} {name}"[:64]),
                                     x509.NameAttribute(NameOID.ORGANIZATION_NAME, f"lpdl {fleet}"[:64])]))
            .issuer_name(ca_cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - BACKDATE)
            .not_valid_after(min(now + datetime.timedelta(days=days), ca_cert.not_valid_after_utc))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    out_dir.mkdir(parents=True, exist_ok=True)
    trusted = out_dir / CA_CERT
    ca_pem = ca_cert.public_bytes(serialization.Encoding.PEM)
    if not trusted.exists() or ca_pem not in trusted.read_bytes():
        _write_public(trusted, ca_pem + (trusted.read_bytes() if trusted.exists() else b""))
    _write_private(out_dir / KEY, _key_pem(key))
    _write_public(out_dir / CERT, cert.public_bytes(serialization.Encoding.PEM))
    if (ca_dir / REVOKED).exists():
        _write_public(out_dir / REVOKED, (ca_dir / REVOKED).read_bytes())
    return Issued(identity_of(cert), out_dir)


def revoke(ca_dir: Path, serial: int | None = None, peer_id: str | None = None) -> str:
    """Add a certificate (by serial) or a whole device (by peer id) to the CA's revocation list; returns the line.
    Copy the list to each device's TLS directory (``revoked``): daemons re-read it without a restart."""
    _load_ca(ca_dir)
    if (serial is None) == (peer_id is None):
        raise CaError("revoke: give exactly one of a serial or a peer id")
    line = f"serial:{serial:x}" if serial is not None else f"peer:{peer_id}"
    parse_revocations(line)
    path = ca_dir / REVOKED
    existing = path.read_text() if path.exists() else ""
    if line not in existing.splitlines():
        _write_public(path, (existing + ("" if not existing or existing.endswith("\n") else "\n") + line + "\n")
                      .encode())
    return line
