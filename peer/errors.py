"""The root of the project's own errors.

Every error class of lpdl-peer derives from :class:`PeerError`, so a caller (the CLI, the daemon's loop, a library
user) can catch one type and read :attr:`PeerError.reason`, a short machine-readable code (snake_case: the same
keys the daemon's refusal and drop counters use where there is one), beside the one-line message for people.
Each class keeps its own name and its standard-library base (``ValueError`` for bad input, ``RuntimeError`` for a
state the program cannot go on from), so existing ``except ValueError`` handlers still catch it.
"""

from __future__ import annotations

from typing import ClassVar


class PeerError(Exception):
    """An error of lpdl-peer: ``str(error)`` is one line naming the cause, ``reason`` its code.

    Args:
        message: the one line for people.
        reason: the code of this instance; default the class's :attr:`default_reason`.
    """

    #: The code an instance carries unless one is given (each subclass names its own).
    default_reason: ClassVar[str] = "error"

    def __init__(self, message: str = "", *, reason: str | None = None) -> None:
        super().__init__(message)
        self.reason: str = self.default_reason if reason is None else reason
