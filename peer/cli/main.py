"""The ``lpdl-peer`` command group: one module per command, registered here and imported only when it runs."""

from __future__ import annotations

import click

from peer import __version__
from peer.cli.lazy import LazyCommand, LazyGroup
from peer.logs import setup_logging

#: Every command: its module, its click object and its line in ``lpdl-peer --help``.
COMMANDS: dict[str, LazyCommand] = {
    "start": LazyCommand("peer.cli.start", "start", "Run a peer daemon in the foreground."),
    "status": LazyCommand("peer.cli.status", "status", "Show what a local or remote peer is doing."),
    "train": LazyCommand("peer.cli.train", "train", "Train one model centrally (the baseline)."),
    "simulate": LazyCommand("peer.cli.simulate", "simulate", "Simulate a fleet of peers in one process."),
    "energy": LazyCommand("peer.cli.energy", "energy", "Count operations and energy of a model, fp32 vs 8-bit."),
    "fleet": LazyCommand("peer.cli.fleet", "fleet", "Run N daemons on loopback and summarise the fleet."),
    "prepare": LazyCommand("peer.cli.prepare", "prepare", "Compile a config's int8 pass graphs for this host, once."),
    "export": LazyCommand("peer.cli.export", "export", "Export a trained model: safetensors, TorchScript, ONNX."),
    "ca": LazyCommand("peer.cli.ca", "ca", "Fleet certificates: init a CA, issue, revoke."),
    "release": LazyCommand("peer.cli.release", "release", "Lift a neighbour's quarantine (robust receive rule)."),
}


@click.group(cls=LazyGroup, lazy=COMMANDS,
             context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.version_option(__version__, prog_name="lpdl-peer")
@click.option("--log-level", default="INFO", type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"]),
              help="Logging level (logs go to stderr, journald friendly; gRPC's own core logs only errors "
                   "below DEBUG).")
def cli(log_level: str) -> None:
    """Decentralized low-precision learning on edge devices."""
    setup_logging(log_level)


#: True once main() runs: this process IS the command (console script, python -m, a daemon the fleet launched), not
#: a program calling it in-process (tests through click's runner). Only then may `start` re-execute the process.
PROCESS_ENTRY = False


def main() -> None:
    """The process entry point: the console script, ``python -m peer`` / ``peer.cli.main``, fleet daemons."""
    global PROCESS_ENTRY
    PROCESS_ENTRY = True
    cli(prog_name="lpdl-peer")


if __name__ == "__main__":  # python -m peer.cli.main, as tests/daemon_helpers.py runs it without the console script
    main()
