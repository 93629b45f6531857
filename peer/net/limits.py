"""Shared budgets of the gRPC server (pure bookkeeping, no I/O): bytes buffered by partial updates across all
streams, token buckets for expensive calls (GetModel, per caller) and for each sender's updates. One place so each
limit has one definition."""

from __future__ import annotations

import time
from collections import OrderedDict
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


class CallerBuckets:
    """One :class:`TokenBucket` per caller (a sender's updates, a caller's GetModel calls), so one greedy or
    hostile caller spends only its own budget. At most ``max_callers`` buckets are kept; the least recently used
    is dropped first (a dropped caller starts again with a full bucket: the bound on memory wins over the bound on a
    caller that cycles through more identities than that - each needs a fleet certificate).

    Args:
        rate_per_s: sustained calls per second per caller.
        burst: calls per caller allowed back to back.
        max_callers: most callers tracked at once.
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(self, rate_per_s: float, burst: int, max_callers: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.rate_per_s = rate_per_s
        self.burst = burst
        self.max_callers = max_callers
        self._clock = clock
        self._buckets: OrderedDict[str, TokenBucket] = OrderedDict()

    def allow(self, caller: str) -> bool:
        """Take one token from ``caller``'s bucket if there is one."""
        bucket = self._buckets.get(caller)
        if bucket is None:
            bucket = self._buckets[caller] = TokenBucket(self.rate_per_s, self.burst, self._clock)
            while len(self._buckets) > self.max_callers:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(caller)
        return bucket.allow()

    def __len__(self) -> int:
        return len(self._buckets)
