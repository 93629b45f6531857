"""Revocation reaches calls that are already open: the revocation list is re-read on a timer, and every open call of
a holder it now names is ended (docs/design.md#trust).

A call is checked against the list when it opens (``TransportSecurity.caller``). A Gossip stream lives for hours,
so without this a device revoked after opening its stream kept delivering updates until it reconnected (measured
on main: 59 more updates sent, 178 more applied on the target after ``ca revoke`` and the list copied). The server
registers each authenticated long-lived call with :class:`RevocationWatch`; every ``interval_s`` seconds the watch
stats the list (a re-read only when it changed) and cuts the calls of every revoked holder, so an open stream ends
within ``interval_s`` of the new list landing on the device.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from peer.aio import cancel_and_wait
from peer.security.identity import CertIdentity, Revocations

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Tracked:
    """One open call: whose certificate it runs under, and how to end it."""

    identity: CertIdentity
    what: str
    cut: Callable[[], None]


class RevocationWatch:
    """Ends open calls whose certificate (or device) the revocation list names.

    Args:
        revocations: the TLS directory's list (re-read when its file changes).
        interval_s: seconds between two looks at the list (the longest a revoked holder's open call survives
            the list's arrival, plus the time to cut it).
        on_cut: called with the identity of each cut call (the server counts it as a refusal).
    """

    def __init__(self, revocations: Revocations, interval_s: float,
                 on_cut: Callable[[CertIdentity], None] | None = None) -> None:
        self.revocations = revocations
        self.interval_s = interval_s
        self.on_cut = on_cut
        self.cut_calls = 0
        self._open: dict[int, _Tracked] = {}
        self._cut: set[int] = set()  # keys of open calls already cut (cut again until they end)
        self._next = 0
        self._task: asyncio.Task[None] | None = None

    def track(self, identity: CertIdentity, what: str, cut: Callable[[], None]) -> Callable[[], None]:
        """Watch one open call (``what`` names it in the log); returns the function that stops watching it (call
        it when the call ends)."""
        key = self._next
        self._next += 1
        self._open[key] = _Tracked(identity, what, cut)

        def untrack() -> None:
            self._open.pop(key, None)
            self._cut.discard(key)

        return untrack

    def __len__(self) -> int:
        return len(self._open)

    def start(self) -> None:
        """Start the timer (in the running event loop; idempotent)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="revocation-watch")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task])
            self._task = None

    def sweep(self) -> int:
        """Cut every open call of a revoked holder now; returns how many were newly cut. A call stays watched until
        it ends (its untrack), and one already cut is cut again at each sweep: a cut is a task cancellation, which
        Python 3.11 can drop (peer/aio.py), and a revoked holder's stream must not go on because one was lost. Each
        call is logged and counted once."""
        revoked = [(key, t) for key, t in self._open.items() if self.revocations.revoked(t.identity)]
        newly = 0
        for key, tracked in revoked:
            if key not in self._cut:
                self._cut.add(key)
                newly += 1
                log.warning("%s of %s cut: its certificate (serial %x) is now revoked [refused: revoked]",
                            tracked.what, tracked.identity.uri, tracked.identity.serial)
                self.cut_calls += 1
                if self.on_cut is not None:
                    self.on_cut(tracked.identity)
            tracked.cut()
        return newly

    def track_task(self, identity: CertIdentity | None, what: str) -> Callable[[], None]:
        """Watch the call the current task serves (cancelled when revoked); a no-op for an unauthenticated
        (insecure) caller."""
        task = asyncio.current_task()
        if identity is None or task is None:
            return lambda: None

        def cut() -> None:
            task.cancel()

        return self.track(identity, what, cut)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                self.sweep()
            except Exception:  # noqa: BLE001 - the watch must outlive one bad sweep; the per-call check stays
                log.exception("revocation sweep failed; retrying in %.1f s", self.interval_s)
