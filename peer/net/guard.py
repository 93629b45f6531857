"""What happens before authentication, made visible: connections that never authenticate (failed, abandoned or idle
TLS handshakes - someone probing the port) are counted and logged, so probing shows in status and metrics.

gRPC's Python API reports no handshake outcome. Two things are observable: the server's certificate fetcher runs
once per new connection, before its TLS handshake (:meth:`ConnectionCensus.opened`), and every authenticated call
names its connection (``context.peer()``, :meth:`ConnectionCensus.authenticated`). A connection that never makes an
authenticated call - its handshake failed, was abandoned, or timed out at ``net.handshake_timeout_s`` - is the
difference. Connections whose handshake is still under way count too until they make a call (at most the
handshake deadline's worth).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

log = logging.getLogger(__name__)

#: Authenticated connections remembered (their addresses), so one that makes many calls counts once.
MAX_REMEMBERED = 4096
#: Seconds between two log lines about unauthenticated connections.
LOG_EVERY_S = 60.0


class ConnectionCensus:
    """Counts new connections and the authenticated ones among them (thread-safe: the fetcher runs in a gRPC
    thread).

    Args:
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._lock = threading.Lock()
        self._clock = clock
        self.connections = 0
        self.authenticated_connections = 0
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._logged = (0, 0)           # (connections, authenticated) at the last log line
        self._logged_at = clock()

    def opened(self) -> None:
        """A new connection starts its TLS handshake."""
        with self._lock:
            self.connections += 1

    def authenticated(self, connection: str) -> None:
        """A call on ``connection`` (its ``context.peer()``) passed authentication."""
        with self._lock:
            if connection in self._seen:
                self._seen.move_to_end(connection)
                return
            self._seen[connection] = None
            self.authenticated_connections += 1
            while len(self._seen) > MAX_REMEMBERED:
                self._seen.popitem(last=False)

    @property
    def unauthenticated(self) -> int:
        """Connections that have made no authenticated call (failed, abandoned or pending handshakes)."""
        with self._lock:
            return max(0, self.connections - self.authenticated_connections)

    def refused(self) -> dict[str, int]:
        """The unauthenticated connections as a refusal counter of the status (``tls_handshake``; empty before any
        connection); logs on the way (:meth:`maybe_log`)."""
        self.maybe_log()
        return {"tls_handshake": self.unauthenticated} if self.connections else {}

    def maybe_log(self) -> None:
        """One line per ``LOG_EVERY_S`` when connections failed to authenticate since the last one."""
        now = self._clock()
        if now - self._logged_at < LOG_EVERY_S:
            return
        with self._lock:
            opened = self.connections - self._logged[0]
            authenticated = self.authenticated_connections - self._logged[1]
            self._logged, self._logged_at = (self.connections, self.authenticated_connections), now
        failed = opened - authenticated
        if failed > 0:
            log.warning("%d of %d new connection(s) in the last %.0f s never authenticated (failed, abandoned or idle "
                        "TLS handshakes: someone may be probing this port) [refused: tls_handshake]", failed, opened,
                        LOG_EVERY_S)
