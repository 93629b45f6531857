"""``python -m peer`` is ``lpdl-peer``."""

from peer.cli.main import cli

if __name__ == "__main__":
    cli()
