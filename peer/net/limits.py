"""Shared budgets of the gRPC server (pure bookkeeping, no I/O): bytes buffered by partial updates across all
streams, and a token bucket for expensive calls (GetModel). One place so each limit has one definition."""

from __future__ import annotations

import time
from collections.abc import Callable


class ByteBudget:
    """Bytes held by partially reassembled updates, summed over every stream of the server.

    Args:
        limit: most bytes all partial updates together may hold; a chunk that would pass it is refused.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def take(self, n: int) -> bool:
        """Reserve ``n`` bytes; False (nothing reserved) if that would exceed the limit."""
        if self.used + n > self.limit:
            return False
        self.used += n
        return True

    def give(self, n: int) -> None:
        """Return ``n`` previously reserved bytes."""
        self.used = max(0, self.used - n)


class TokenBucket:
    """At most ``burst`` calls at once, refilled at ``rate_per_s`` calls per second.

    Args:
        rate_per_s: sustained calls per second.
        burst: calls allowed back to back.
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(self, rate_per_s: float, burst: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate_per_s = rate_per_s
        self.burst = burst
        self._clock = clock
        self._tokens = float(burst)
        self._at = clock()

    def allow(self) -> bool:
        """Take one token if there is one."""
        now = self._clock()
        self._tokens = min(float(self.burst), self._tokens + (now - self._at) * self.rate_per_s)
        self._at = now
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True
