"""Topologies as out-neighbour schedules over a set of peer ids (docs/design.md#discovery, docs/method.md#push-sum).

A schedule maps (sorted live peer ids, this peer, round) to this peer's out-neighbours for that round. Peers compute
it independently from the live set they see, so joins and leaves change the graph without coordination. Each sender
keeps share 1/(|out|+1) and gives the same share to each out-neighbour: the mixing matrix is column-stochastic.

Tuning guide: a directed ring is the cheapest (1 message per peer per round) but mixes slowest (spectral gap ~
1/n^2); the rotating exponential graph also sends 1 message per round and mixes in ~log2(n) rounds; undirected ring
and torus send 2 and 4 messages. :func:`spectral_gap` quantifies it, which is how the paper explains its results.
"""

from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from peer.gossip.kinds import TOPOLOGIES


@dataclass(frozen=True)
class Topology:
    """An out-neighbour schedule.

    Attributes:
        kind: one of TOPOLOGIES.
        rotating: vary the graph per round (ring: hop 1, 2, ...; exponential: one 2^k hop per round; random: new
            draw per round). Static graphs use the same edges every round.
        k: out-degree of the "random" topology.
        seed: seeds the random topology (all peers must agree).
    """

    kind: str = "ring"
    rotating: bool = False
    k: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in TOPOLOGIES:
            raise ValueError(f"topology: unknown {self.kind!r}; choose one of {', '.join(TOPOLOGIES)}")
        if self.k < 1:
            raise ValueError(f"topology k: out-degree must be >= 1, got {self.k}")

    @property
    def rewires_locally(self) -> bool:
        """Whether leaving one peer out of the ids moves only the edges of the peers next to it: a static ring or
        undirected ring, where its ring neighbours close the ring around it and every other edge stays. Any other
        schedule (rotating rings, the exponential graph, the torus, random) re-indexes the peers after a left-out
        one, so two peers that leave out different peers compute different edges for everyone else."""
        return not self.rotating and self.kind in ("ring", "undirected-ring")

    def out_neighbours(self, peers: Sequence[str], me: str, round_index: int) -> list[str]:
        """This peer's out-neighbours in ``round_index`` over the live set ``peers`` (must contain ``me``)."""
        ids = sorted(set(peers))
        n = len(ids)
        if n < 2 or me not in ids:
            return []
        i = ids.index(me)
        offsets = self._offsets(n, i, round_index)
        out = []
        for off in offsets:
            j = (i + off) % n
            if j != i and ids[j] not in out:
                out.append(ids[j])
        return out

    def reaches(self, peers: Sequence[str], me: str, round_index: int) -> set[str]:
        """Every peer ``me`` sends to in one period of the schedule from ``round_index`` on (:meth:`period`
        rounds), over the live set ``peers`` (the ids sorted once: a rotating ring of 256 has a period of 255)."""
        ids = sorted(set(peers))
        n = len(ids)
        if n < 2 or me not in ids:
            return set()
        i = ids.index(me)
        return {ids[(i + off) % n] for t in range(round_index, round_index + self.period(n))
                for off in self._offsets(n, i, t) if (i + off) % n != i}

    def _offsets(self, n: int, i: int, t: int) -> list[int]:
        if self.kind == "ring":
            return [1 + (t % (n - 1))] if self.rotating else [1]
        if self.kind == "undirected-ring":
            hop = 1 + (t % max(1, n // 2)) if self.rotating else 1
            return [hop, -hop]
        if self.kind == "torus":
            rows, cols = _grid(n)
            r, c = divmod(i, cols)
            neighbours = {((r + dr) % rows) * cols + (c + dc) % cols for dr, dc in ((0, 1), (0, -1), (1, 0), (-1, 0))}
            return [j - i for j in sorted(neighbours)]
        if self.kind == "exponential":
            hops = [2 ** k for k in range(max(1, math.ceil(math.log2(n))))]
            return [hops[t % len(hops)]] if self.rotating else hops
        # random k-out: deterministic given (seed, peer index, round) so every peer can recompute it
        rng = random.Random(f"{self.seed}/{i}/{t if self.rotating else 0}/{n}")
        return rng.sample(range(1, n), min(self.k, n - 1))

    def period(self, n: int) -> int:
        """Rounds after which a rotating deterministic schedule repeats (1 for static)."""
        if not self.rotating:
            return 1
        if self.kind == "ring":
            return max(1, n - 1)
        if self.kind == "undirected-ring":
            return max(1, n // 2)
        if self.kind == "exponential":
            return max(1, math.ceil(math.log2(max(n, 2))))
        return 32  # random: average over a window of draws

    def senders_within_period(self, peers: Sequence[str], me: str, round_index: int) -> frozenset[str]:
        """The peers that send to ``me`` within one period of the schedule from ``round_index`` on, over the live
        set ``peers``. Cached: every training round asks, and at n = 256 the walk took 34-91 ms a round (rotating
        exponential graph, random draws); a deterministic schedule's period holds the same senders from any round,
        and random draws are taken over the window of :meth:`period` rounds ``round_index`` falls in."""
        ids = tuple(sorted(set(peers)))
        window = self.period(len(ids))
        return _senders_within_period(self, ids, me, round_index // window * window if self.kind == "random" else 0)

    @functools.lru_cache(maxsize=64)  # noqa: B019 - frozen and small: kept alive by the cache is fine
    def horizon(self, n: int, limit: int = 1024) -> int:
        """Rounds from round 0 until every one of ``n`` peers has heard, directly or through others, from every
        other along this schedule (``limit`` if it never does): before that a peer's neighbours may agree with it
        while peers it has not heard from yet do not. The rotating exponential graph: ceil(log2 n); a static ring:
        n - 1."""
        heard = [1 << i for i in range(n)]  # bit j of heard[i]: peer i's model carries peer j's
        everyone = (1 << n) - 1
        for t in range(limit):
            if all(h == everyone for h in heard):
                return t
            after = list(heard)
            for i in range(n):
                for off in self._offsets(n, i, t):
                    after[(i + off) % n] |= heard[i]
            heard = after
        return limit

    def mixing_matrix(self, n: int, round_index: int) -> np.ndarray:
        """Column-stochastic W (W[j, i] = share peer i gives to j) for ``n`` peers named 0..n-1 in one round."""
        ids = [f"{k:06d}" for k in range(n)]
        w = np.zeros((n, n))
        for i, me in enumerate(ids):
            out = self.out_neighbours(ids, me, round_index)
            share = 1.0 / (len(out) + 1)
            w[i, i] = share
            for peer in out:
                w[ids.index(peer), i] = share
        return w


@functools.lru_cache(maxsize=256)
def _senders_within_period(topology: Topology, ids: tuple[str, ...], me: str, round_key: int) -> frozenset[str]:
    return frozenset(p for p in ids if p != me and me in topology.reaches(ids, p, round_key))


def _grid(n: int) -> tuple[int, int]:
    """The most square rows x cols = n factorisation (a prime n gives a 1 x n ring)."""
    rows = int(math.isqrt(n))
    while n % rows:
        rows -= 1
    return rows, n // rows


def spectral_gap(topology: Topology, n: int) -> float:
    """1 - |lambda_2| of the expected mixing matrix over one period of the schedule.

    Larger is better: consensus error shrinks roughly like (1 - gap)^t. For a rotating schedule the product over a
    period is what actually mixes; we report the gap of the average matrix, which is what the paper tabulates.
    """
    if n < 2:
        return 1.0
    period = topology.period(n)
    expected = sum(topology.mixing_matrix(n, t) for t in range(period)) / period
    moduli = np.sort(np.abs(np.linalg.eigvals(expected)))[::-1]
    return float(1.0 - moduli[1])
