"""The ``lpdl-peer`` command group: one module per command, registered here."""

from __future__ import annotations

import logging

import click

from peer import __version__
from peer.cli.energy import energy
from peer.cli.fleet import fleet
from peer.cli.simulate import simulate
from peer.cli.start import start
from peer.cli.status import status
from peer.cli.train import train


@click.group(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.version_option(__version__, prog_name="lpdl-peer")
@click.option("--log-level", default="INFO", type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"]),
              help="Logging level (logs go to stderr, journald friendly).")
def cli(log_level: str) -> None:
    """Decentralized low-precision learning on edge devices."""
    logging.basicConfig(level=getattr(logging, log_level), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


for command in (start, status, train, simulate, energy, fleet):
    cli.add_command(command)
