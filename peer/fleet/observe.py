"""What the fleet learned about one daemon from its status snapshots (no I/O: the watcher feeds it)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from peer.daemon.kinds import Phase
from peer.daemon.status import StatusDocument


@dataclass
class Observation:
    """Everything the fleet keeps from one daemon's status snapshots.

    Attributes:
        status: the last snapshot (None before the first one).
        loss: last finite training loss reported (None before the first local step).
        round_samples: ``last_round_s`` of every distinct round seen (seconds).
        first_seen: (monotonic seconds, round) of the first snapshot in the training phase.
        last_seen: (monotonic seconds, round) of the latest snapshot in the training phase.
        evals: every distinct evaluation the daemon reported, with the fleet's elapsed seconds.
        sent_samples: (round, bytes sent over all links) of every training snapshot.
        w_samples: the push-sum weight of every training snapshot (1 on average over a fleet: how far it strays
            says how far the daemons drift apart; peer/daemon/pace.py).
        peak_rss_kb: highest VmHWM read from /proc (kB; 0 where /proc is unavailable).
        link_bytes: per counter (bytes_sent, bytes_received), the last value seen of every link, kept when the
            daemon forgets a departed neighbour (its status then drops the link's counters).
        carried_bytes: per counter, what links counted before their counters started again from zero (a peer
            that left and came back).
    """

    status: StatusDocument | None = None
    loss: float | None = None
    round_samples: dict[int, float] = field(default_factory=dict)
    first_seen: tuple[float, int] | None = None
    last_seen: tuple[float, int] | None = None
    evals: list[dict[str, float]] = field(default_factory=list)
    sent_samples: list[tuple[int, int]] = field(default_factory=list)
    w_samples: list[float] = field(default_factory=list)
    peak_rss_kb: int = 0
    link_bytes: dict[str, dict[str, int]] = field(default_factory=lambda: {"bytes_sent": {}, "bytes_received": {}})
    carried_bytes: dict[str, int] = field(default_factory=lambda: {"bytes_sent": 0, "bytes_received": 0})

    def observe(self, snapshot: StatusDocument, now: float, elapsed_s: float) -> None:
        """Record a snapshot taken at monotonic time ``now`` (seconds), ``elapsed_s`` after the fleet started."""
        self.status = snapshot
        for peer_id, link in snapshot.neighbours.items():
            for key, value in (("bytes_sent", link.bytes_sent), ("bytes_received", link.bytes_received)):
                last = self.link_bytes[key]
                if value < last.get(peer_id, 0):
                    self.carried_bytes[key] += last[peer_id]
                last[peer_id] = value
        rnd = snapshot.round
        if math.isfinite(snapshot.loss):
            self.loss = snapshot.loss
        if snapshot.phase is Phase.TRAINING:
            if self.first_seen is None:
                self.first_seen = (now, rnd)
            self.last_seen = (now, rnd)
            self.sent_samples.append((rnd, self.bytes_total("bytes_sent")))
            self.w_samples.append(snapshot.w)
        if rnd > 0 and snapshot.last_round_s > 0:
            self.round_samples[rnd] = snapshot.last_round_s
        ev = snapshot.eval
        if ev is not None and (not self.evals or self.evals[-1]["round"] != ev.round):
            self.evals.append({**asdict(ev), "elapsed_s": elapsed_s})

    def bytes_total(self, key: str) -> int:
        """Bytes over every link this daemon has had so far, those of neighbours it has since forgotten included
        (its status lists only current ones); ``key`` is bytes_sent or bytes_received."""
        return self.carried_bytes[key] + sum(self.link_bytes[key].values())

    def low_w(self, quantile: float = 0.05) -> float:
        """The push-sum weight this daemon's training snapshots were at or above in all but ``quantile`` of them
        (NaN before a training snapshot): a weight near 0 means its own gradient steps were being washed out."""
        if not self.w_samples:
            return math.nan
        ordered = sorted(self.w_samples)
        return ordered[min(len(ordered) - 1, int(quantile * len(ordered)))]

    def steady_sent_per_round(self) -> float:
        """Bytes sent per round over the second half of training (leaves out the one-off model pull of a joiner).

        NaN if fewer than two rounds apart were sampled in that half.
        """
        if not self.sent_samples:
            return math.nan
        last_round, last_sent = self.sent_samples[-1]
        first_round, first_sent = next((r, b) for r, b in self.sent_samples if r >= last_round / 2)
        if last_round - first_round < 2:
            return math.nan
        return (last_sent - first_sent) / (last_round - first_round)

    def mean_round_s(self) -> float:
        """Wall seconds per round between the first and the last training snapshot (NaN if under one round)."""
        if self.first_seen is None or self.last_seen is None or self.last_seen[1] <= self.first_seen[1]:
            return math.nan
        return (self.last_seen[0] - self.first_seen[0]) / (self.last_seen[1] - self.first_seen[1])
