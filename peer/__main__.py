"""``python -m peer`` is ``lpdl-peer``."""

from peer.cli.main import main

if __name__ == "__main__":
    main()
