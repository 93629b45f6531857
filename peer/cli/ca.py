"""``lpdl-peer ca``: the fleet's certificate authority (init, issue, revoke). Torch- and grpc-free: it needs only
the ``cryptography`` library (peer/security/ca.py)."""

from __future__ import annotations

from pathlib import Path

import click

from peer.security import ca as fleet_ca
from peer.security.identity import ROLE_OPERATOR, ROLE_PEER


@click.group("ca")
def ca() -> None:
    """The fleet CA: every peer and operator holds a certificate from it; every gRPC call is mutual TLS."""


@ca.command("init")
@click.option("--ca-dir", type=click.Path(file_okay=False), required=True,
              help="Directory for the new CA (ca.pem, ca.key, fleet, revoked); keep it off the devices.")
@click.option("--fleet", required=True, help="Fleet name the CA signs for (the peers' --fleet).")
@click.option("--days", type=click.IntRange(1), default=fleet_ca.CA_DAYS, help="Validity of the CA certificate.")
def init(ca_dir: str, fleet: str, days: int) -> None:
    """Create a fleet CA."""
    try:
        path = fleet_ca.init_ca(Path(ca_dir), fleet, days)
    except fleet_ca.CaError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"fleet {fleet}: CA certificate {path}; keep {Path(ca_dir) / fleet_ca.CA_KEY} secret")


@ca.command("issue")
@click.option("--ca-dir", type=click.Path(file_okay=False), required=True, help="The fleet CA directory.")
@click.option("--name", required=True, help="The device's peer id (or the operator's name with --operator).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), required=True,
              help="TLS directory to write (a daemon's --tls-dir, default STATE_DIR/tls); an existing "
                   "certificate there is replaced (rotation: the running daemon picks it up, no restart).")
@click.option("--operator", is_flag=True, help="Issue an operator certificate (status --peer), not a device one.")
@click.option("--days", type=click.IntRange(1), default=fleet_ca.CERT_DAYS, help="Validity of the certificate.")
def issue(ca_dir: str, name: str, out_dir: str, operator: bool, days: int) -> None:
    """Issue a device (or operator) certificate binding the fleet and the peer id."""
    try:
        issued = fleet_ca.issue(Path(ca_dir), name, Path(out_dir), ROLE_OPERATOR if operator else ROLE_PEER, days)
    except fleet_ca.CaError as exc:
        raise click.ClickException(str(exc)) from None
    ident = issued.identity
    click.echo(f"{ident.role} {ident.name} of fleet {ident.fleet}: serial {ident.serial:x} in {issued.directory}")


@ca.command("revoke")
@click.option("--ca-dir", type=click.Path(file_okay=False), required=True, help="The fleet CA directory.")
@click.option("--serial", default=None, help="Revoke one certificate by its serial (hexadecimal).")
@click.option("--peer", "peer_id", default=None, help="Revoke every certificate of this device (peer id).")
def revoke(ca_dir: str, serial: str | None, peer_id: str | None) -> None:
    """Add a certificate or a device to the revocation list. Copy CA_DIR/revoked into each peer's TLS directory;
    running daemons re-read it and refuse the revoked party on its next call."""
    try:
        number = int(serial, 16) if serial is not None else None
    except ValueError:
        raise click.UsageError(f"--serial {serial!r} is not hexadecimal") from None
    try:
        line = fleet_ca.revoke(Path(ca_dir), number, peer_id)
    except fleet_ca.CaError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"revoked {line}; copy {Path(ca_dir) / fleet_ca.REVOKED} to every peer's TLS directory")
