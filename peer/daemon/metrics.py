"""Prometheus metrics of one peer (prometheus_client), refreshed from the status document after every round."""

from __future__ import annotations

import logging
import math
import threading
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from peer.daemon.status import StatusDocument
from peer.gossip.kinds import PhaseName

log = logging.getLogger(__name__)

#: The values of the status document's consensus.phase (peer.gossip.consensus.PhaseName).
PHASES = tuple(p.value for p in PhaseName)


class Metrics:
    """Prometheus metrics of one peer, on a private registry (so several peers can live in one test process)."""

    def __init__(self, peer_id: str) -> None:
        self.registry = registry = CollectorRegistry()
        self.round = Gauge("lpdl_round", "Gossip rounds completed", registry=registry)
        self.epoch = Gauge("lpdl_epoch", "Epochs of the local shard trained", registry=registry)
        self.loss = Gauge("lpdl_train_loss", "Mean training loss of the last round", registry=registry)
        self.accuracy = Gauge("lpdl_test_accuracy", "Last test accuracy of the local de-biased model (0..1)",
                              registry=registry)
        self.weight = Gauge("lpdl_pushsum_weight", "Push-sum weight w", registry=registry)
        self.round_seconds = Gauge("lpdl_round_seconds", "Wall time of the last round (s)", registry=registry)
        self.pace_wait = Gauge("lpdl_pace_wait_seconds", "Seconds the rounds waited, in all, for neighbours this "
                               "peer ran node.max_unacked messages ahead of (peer/daemon/pace.py)", registry=registry)
        self.bytes_sent = Counter("lpdl_link_sent_bytes", "Bytes sent per neighbour", ["neighbour"], registry=registry)
        self.bytes_received = Counter("lpdl_link_received_bytes", "Bytes received per neighbour", ["neighbour"],
                                      registry=registry)
        self.refused = Counter("lpdl_refused_inputs", "Refused inputs by reason", ["reason"], registry=registry)
        self.divergences = Counter("lpdl_divergence_recoveries", "Times the model diverged and was rolled back "
                                   "with gamma or the learning rate halved", registry=registry)
        self.gamma = Gauge("lpdl_gossip_gamma", "Consensus step size in use (halved by each recovery that gossip "
                           "explains)", registry=registry)
        self.lr = Gauge("lpdl_learning_rate", "Learning rate in use (the schedule's, halved by each divergence of "
                        "the training step itself)", registry=registry)
        self.checkpoint_failures = Gauge("lpdl_checkpoint_failures", "Checkpoint writes that failed (disk full, I/O "
                                         "errors)", registry=registry)
        self.gossip_paused = Gauge("lpdl_gossip_paused", "1 while gossip is paused because the state directory "
                                   "cannot take a checkpoint", registry=registry)
        self.max_insiders = Gauge("lpdl_max_insiders", "The most insiders within the honest spread this peer's "
                                  "senders let any local rule bound: 2f + 1 senders a period of the graph and "
                                  "3f + 1 peers needed for f (peer/gossip/reach.py; 0 on a static ring; NaN: not "
                                  "known yet or the rule off)", registry=registry)
        self.max_insiders.set(math.nan)
        self.anomaly = Gauge("lpdl_neighbour_anomaly_score", "Robust receive rule's anomaly score per neighbour "
                             "(quarantine at its threshold)", ["neighbour"], registry=registry)
        self.clipped = Gauge("lpdl_neighbour_clipped_fraction", "Fraction of a neighbour's messages the robust rule "
                             "refused (0..1)", ["neighbour"], registry=registry)
        self.quarantined = Gauge("lpdl_neighbour_quarantined", "1 while a neighbour is quarantined", ["neighbour"],
                                 registry=registry)
        self.outlier = Gauge("lpdl_neighbour_outlier_factor", "Fraction of the robust rule's radius and of this "
                             "peer's share a neighbour far outside the others' spread gets (1: not an outlier)",
                             ["neighbour"], registry=registry)
        self.heading = Gauge("lpdl_neighbour_heading_factor", "Fraction of the robust rule's radius a Choco "
                             "neighbour whose replica travels against this peer's own gets (1: not cut)",
                             ["neighbour"], registry=registry)
        self.sink = Gauge("lpdl_neighbour_sink", "1 while a neighbour is flagged a mass sink: it took this peer's "
                          "messages and returned none in its scheduled rounds (peer/gossip/sinks.py)", ["neighbour"],
                          registry=registry)
        self.routed_around = Gauge("lpdl_neighbour_routed_around", "1 while a flagged sink, or a neighbour other "
                                   "peers report quarantined (peer/gossip/notices.py), is left out of this peer's "
                                   "send schedule (0 while it is probed or sent to)", ["neighbour"],
                                   registry=registry)
        self.consensus_phase = Gauge("lpdl_consensus_phase", "1 for the phase this peer is in (training, consensus, "
                                     "converged), 0 for the others", ["phase"], registry=registry)
        self.consensus_rounds = Gauge("lpdl_consensus_rounds", "Consensus rounds run, all phases", registry=registry)
        self.consensus_bytes = Gauge("lpdl_consensus_sent_bytes", "Update payload bytes of this peer's consensus "
                                     "phases' own messages",
                                     registry=registry)
        self.consensus_distance = Gauge("lpdl_consensus_distance", "Relative distance of a neighbour's model from "
                                        "this peer's, by its last message", ["neighbour"], registry=registry)
        self._seen: dict[tuple[str, str], float] = {}
        self._http: tuple[WSGIServer, threading.Thread] | None = None

    def serve(self, port: int, host: str = "127.0.0.1") -> None:
        """Start the HTTP exporter (prometheus_client's own server thread)."""
        self._http = start_http_server(port, addr=host, registry=self.registry)
        log.info("metrics on http://%s:%d/metrics", host, port)

    def update(self, status: StatusDocument) -> None:
        """Refresh from a status snapshot (counters advance by the difference since the last update)."""
        self.round.set(status.round)
        self.epoch.set(status.epoch)
        self.loss.set(status.loss)
        self.weight.set(status.w)
        self.round_seconds.set(status.last_round_s)
        self.pace_wait.set(status.pace_wait_s)
        if status.eval is not None:
            self.accuracy.set(status.eval.test_acc)
        self.gamma.set(status.gossip.gamma)
        self.lr.set(status.lr)
        bounded = status.gossip.max_insiders  # None: no sender scheduled yet, or the rule off
        self.max_insiders.set(math.nan if bounded is None else bounded)
        delta = status.divergences - self._seen.get(("divergences", ""), 0.0)
        if delta > 0:
            self.divergences.inc(delta)
            self._seen[("divergences", "")] = status.divergences
        consensus = status.consensus
        if consensus is not None:
            for phase in PHASES:
                self.consensus_phase.labels(phase).set(1.0 if consensus.phase == phase else 0.0)
            self.consensus_rounds.set(consensus.rounds)
            self.consensus_bytes.set(consensus.bytes_sent)
        for peer_id, n in status.neighbours.items():
            if n.consensus_distance is not None:
                self.consensus_distance.labels(peer_id).set(n.consensus_distance)
            self._advance(self.bytes_sent, ("sent", peer_id), n.bytes_sent, peer_id)
            self._advance(self.bytes_received, ("received", peer_id), n.bytes_received, peer_id)
        for peer_id, n in status.neighbours.items():
            if n.robust:  # the robust receive rule's view (peer/gossip/robust.py)
                self.anomaly.labels(peer_id).set(n.robust["score"])
                self.clipped.labels(peer_id).set(n.robust["clipped_fraction"])
                self.quarantined.labels(peer_id).set(0 if n.robust["quarantined_since"] is None else 1)
                self.outlier.labels(peer_id).set(n.robust.get("outlier_factor", 1.0))
                self.heading.labels(peer_id).set(n.robust.get("heading_factor", 1.0))  # absent from older ones
                self.sink.labels(peer_id).set(1 if n.robust.get("sink") else 0)  # absent from older documents
                self.routed_around.labels(peer_id).set(0 if n.robust.get("routed_around_since") is None
                                                       and n.robust.get("left_out_on_notice_since") is None else 1)
        for reason, count in status.refused.items():
            self._advance(self.refused, ("refused", reason), count, reason)
        if status.storage is not None:  # the daemon's (peer/daemon/durability.py)
            self.checkpoint_failures.set(status.storage.errors)
            self.gossip_paused.set(status.storage.gossip_paused is not None)

    def _advance(self, counter: Counter, key: tuple[str, str], total: float, label: str) -> None:
        delta = total - self._seen.get(key, 0.0)
        if delta > 0:
            counter.labels(label).inc(delta)
            self._seen[key] = total

    def forget(self, peer_id: str) -> None:
        """Drop a departed neighbour's series: its labels stop being exported, and if it returns its link counters
        (restarting at 0) count from there instead of waiting to pass the old total."""
        for counter, kind in ((self.bytes_sent, "sent"), (self.bytes_received, "received")):
            if self._seen.pop((kind, peer_id), None) is not None:
                counter.remove(peer_id)
        for gauge in (self.consensus_distance, self.anomaly, self.clipped, self.quarantined, self.sink,
                      self.routed_around):
            try:
                gauge.remove(peer_id)
            except KeyError:  # never observed
                pass

    def close(self) -> None:
        if self._http is not None:
            server, thread = self._http
            server.shutdown()
            thread.join(timeout=2.0)
            self._http = None
