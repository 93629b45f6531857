"""The daemon's enumerations: where a daemon is in its life, why it exits, which malloc it may run on.

Torch-free and importing nothing from peer: the status document, the CLI's choices and the daemon's own config
(peer/daemon/config.py) read them without loading the daemon.
"""

from __future__ import annotations

import enum


class Phase(enum.Enum):
    """Where a daemon is in its life (the status document's ``phase``)."""

    STARTING = "starting"  # restoring, binding, discovering, joining (pulling the model)
    TRAINING = "training"  # the round loop runs
    STOPPING = "stopping"  # settling in-flight messages, final checkpoint, deregistering
    STOPPED = "stopped"


class ExitCode(enum.IntEnum):
    """The daemon process's exit status (what systemd and the fleet read)."""

    CLEAN = 0  # stopped by SIGTERM / max_rounds / exit_when_done, state settled and checkpointed
    DIVERGED = 1  # training stopped because the model kept diverging (peer/runtime/recovery.py)


#: Values of ``node.allocator`` / ``--allocator``: ``auto`` = tcmalloc, else jemalloc, where installed, else glibc
#: (peer/daemon/allocator.py names each one's library, in the order ``auto`` tries them).
ALLOCATORS: tuple[str, ...] = ("auto", "glibc", "tcmalloc", "jemalloc")
