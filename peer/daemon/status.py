"""The daemon's status document: one :class:`StatusDocument`, served as JSON (:meth:`StatusDocument.to_json`)
identically by the control socket (``lpdl-peer status``) and the Status RPC (``lpdl-peer status --peer host:port``),
and as gauges and counters by Prometheus; its readers (daemon/metrics.py, fleet/observe.py, fleet/watch.py,
cli/status.py) take the typed form, parsed once by :meth:`StatusDocument.from_json`.

    peer_id, fleet, phase, uptime_s, round, epoch, lr (in use: halved by each divergence of the training step),
    loss, eval {round, epoch, test_loss, test_acc}, w,
    precision {requested, backend, reason}, model {name, fingerprint, source, source_kind, layers, layers_summary},
    gossip {algorithm, compression, bits, gamma (in use: halved by each recovery gossip explains), configured_gamma,
    topology, window}, last_round_s, pace_wait_s (the rounds' waits for lagging neighbours, in all), not_waited_for,
    divergences (recoveries: model rolled back, gamma or the lr halved), gamma_halvings, lr_halvings,
    neighbours {peer_id: {address, live, state, in_flight, bytes_sent, bytes_received, rtt_s, last_seen,
                          delivered, settled, last_error}},
    refused {reason: count}, dropped {reason: count}, applied,
    memory {rss_mib, peak_mib, after {stage: MiB}, added {stage: MiB}, seconds {stage: s}, gossip_state_mib,
            allocator},
    storage {state, gossip_paused, errors, last_error, failing_since, reserve, paused_state_written},
    consensus {phase (training, consensus or converged), rounds, bytes_sent, tolerance}; each neighbour also has
    consensus_distance (its model's relative distance from this peer's, by its last message;
    docs/method.md#the-consensus-phase)

Built from plain inputs (no daemon object), so this module imports neither the node nor torch-heavy rooms (its
readers, ``lpdl-peer status`` among them, start without torch or grpc).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from peer.daemon.kinds import Phase
from peer.errors import PeerError

if TYPE_CHECKING:  # annotations only: the readers (cli/status.py) load this module without torch or grpc
    from peer.config import RunSpec
    from peer.net.snapshots import EdgeSnapshot, ServerSnapshot
    from peer.runtime.peer import Peer, PeerStatus


@dataclass
class Progress:
    """The round loop's own figures (written by the loop, read by status)."""

    phase: Phase = Phase.STARTING
    round: int = 0
    last_round_s: float = 0.0
    last_eval: EvalResult | None = None
    started: float = field(default_factory=time.time)
    #: Seconds this peer's rounds waited for neighbours it ran too far ahead of, in all (peer/daemon/pace.py).
    pace_wait_s: float = 0.0
    #: Lagging neighbours not waited for (they acknowledged nothing within node.pace_wait_s) until they do.
    not_waited_for: list[str] = field(default_factory=list)


class StatusFormatError(PeerError, ValueError):
    """A JSON document that is not a status document; the message names the field."""

    default_reason = "status_format"


def _field(data: Mapping[str, Any], key: str, kind: type, where: str) -> Any:
    """``data[key]`` checked to be a ``kind`` (ints pass as floats; JSON has one number type)."""
    if key not in data:
        raise StatusFormatError(f"status document: {where}{key} is missing")
    value = data[key]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, kind):
        raise StatusFormatError(f"status document: {where}{key} is {type(value).__name__}, not {kind.__name__}")
    return value


def _optional_float(data: Mapping[str, Any], key: str, where: str) -> float | None:
    return None if data.get(key) is None else float(_field(data, key, float, where))


def _counts(data: Mapping[str, Any], key: str, where: str = "") -> dict[str, int]:
    return {str(k): int(v) for k, v in _field(data, key, dict, where).items()}


@dataclass(frozen=True)
class EvalResult:
    """The daemon's last own evaluation of its de-biased model on the test set."""

    round: int
    epoch: float
    test_loss: float
    test_acc: float  # in [0, 1]

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> EvalResult:
        return cls(int(_field(data, "round", int, "eval.")), _field(data, "epoch", float, "eval."),
                   _field(data, "test_loss", float, "eval."), _field(data, "test_acc", float, "eval."))


@dataclass(frozen=True)
class PrecisionStatus:
    """The precision asked for and the backend in use, with the one-line why."""

    requested: str
    backend: str
    reason: str

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PrecisionStatus:
        return cls(*(_field(data, key, str, "precision.") for key in ("requested", "backend", "reason")))


@dataclass(frozen=True)
class ModelStatus:
    """The model trained: registry name, fingerprint, and where it came from; for a converted model its layer table
    (text) and one-line summary (empty otherwise)."""

    name: str
    fingerprint: str
    source: str = ""
    source_kind: str = ""
    layers: str = ""
    layers_summary: str = ""

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ModelStatus:
        return cls(_field(data, "name", str, "model."), _field(data, "fingerprint", str, "model."),
                   **{key: str(data[key]) for key in ("source", "source_kind", "layers", "layers_summary")
                      if data.get(key) is not None})


@dataclass(frozen=True)
class GossipStatus:
    """The gossip settings in use; ``gamma`` is the consensus step in use (halved by each recovery),
    ``configured_gamma`` the one the configuration gives."""

    algorithm: str
    compression: float
    bits: int
    gamma: float
    configured_gamma: float
    topology: str  # with " rotating" appended for a rotating graph
    window: int
    #: The robust receive rule is on (gossip.robust; None: a daemon of a version before this field).
    robust: bool | None = None
    #: Distinct peers the schedule has send to this peer within one period of the graph, quarantined ones not
    #: counted (None: no peer scheduled to send here yet, or an older daemon).
    senders: int | None = None
    #: The most insiders within the honest spread those senders let any local rule bound
    #: (peer/gossip/reach.py; None where ``senders`` is, or with the rule off).
    max_insiders: int | None = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> GossipStatus:
        w = "gossip."
        gamma = _field(data, "gamma", float, w)
        return cls(_field(data, "algorithm", str, w), _field(data, "compression", float, w),
                   _field(data, "bits", int, w), gamma,
                   gamma if data.get("configured_gamma") is None else _field(data, "configured_gamma", float, w),
                   _field(data, "topology", str, w), int(data.get("window", 1)),
                   None if data.get("robust") is None else _field(data, "robust", bool, w),
                   None if data.get("senders") is None else _field(data, "senders", int, w),
                   None if data.get("max_insiders") is None else _field(data, "max_insiders", int, w))


@dataclass(frozen=True)
class NeighbourStatus:
    """One neighbour as this daemon sees it: the outbound edge (state, delivered, settled, rtt) and the link
    counters of both directions. ``last_seen``: wall clock (seconds since the epoch; 0: never)."""

    address: str
    live: bool
    state: str
    in_flight: int
    bytes_sent: int
    bytes_received: int
    rtt_s: float | None
    last_seen: float
    delivered: int
    settled: dict[str, int]
    last_error: str
    #: The robust receive rule's record (peer/gossip/robust.py): score, clipped_fraction, accepted, refused,
    #: quarantined_since (round or None), reason, strikes (rounds of the divergences charged to it), sink,
    #: silent_rounds, routed_around_since (round or None: in the
    #: schedule), next_probe (round or None; peer/gossip/sinks.py), implied_distance, outlier_factor and
    #: outlier_since (an outlier's cut radius and share), heading and heading_factor (the cosine of its Choco
    #: replica's travel with this peer's own, None: not judged, and the fraction of the radius that leaves it),
    #: named_by and left_out_on_notice_since (the peers whose quarantine notices name, this peer's own included;
    #: the round the schedule excludes it from on them - every peer with those notices excludes it -
    #: peer/gossip/notices.py).
    #: Empty: nothing received from it or settled to it yet.
    robust: dict[str, Any] = field(default_factory=dict)
    consensus_distance: float | None = None  # its model's relative distance from this peer's, by its last message
    #: Serial (hex) of the certificate its latest inbound Gossip stream authenticated with (what ``lpdl-peer ca
    #: revoke --serial`` takes); None: no stream from it yet, no TLS, or a daemon of an older version.
    certificate_serial: str | None = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> NeighbourStatus:
        w = "neighbour."
        return cls(str(data.get("address") or ""), bool(data.get("live", False)), _field(data, "state", str, w),
                   int(data.get("in_flight", 0)), int(_field(data, "bytes_sent", int, w)),
                   int(_field(data, "bytes_received", int, w)), _optional_float(data, "rtt_s", w),
                   float(data.get("last_seen", 0.0)), int(data.get("delivered", 0)),
                   {str(k): int(v) for k, v in (data.get("settled") or {}).items()}, str(data.get("last_error", "")),
                   dict(data.get("robust") or {}), _optional_float(data, "consensus_distance", w),
                   None if data.get("certificate_serial") is None else _field(data, "certificate_serial", str, w))


@dataclass(frozen=True)
class ConsensusStatus:
    """The consensus phase (docs/method.md#the-consensus-phase): the phase the peer is in (training, consensus or
    converged), its consensus rounds and the bytes it sent in them (all phases), and the relative distance a phase
    ends at (None: no phase configured)."""

    phase: str
    rounds: int
    bytes_sent: int
    tolerance: float | None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ConsensusStatus:
        w = "consensus."
        return cls(_field(data, "phase", str, w), int(_field(data, "rounds", int, w)),
                   int(_field(data, "bytes_sent", int, w)), _optional_float(data, "tolerance", w))

    @classmethod
    def of(cls, peer: Peer, gossip: PeerStatus) -> ConsensusStatus:
        settings = peer.consensus_settings
        return cls(gossip.phase, gossip.consensus_rounds, gossip.consensus_bytes,
                   None if settings is None else settings.tolerance)


@dataclass(frozen=True)
class MemoryStatus:
    """Resident memory (MiB): now, the peak, after each start-up stage and what each stage added; the seconds
    each start-up stage took; the gossip state's share; the allocator in use (empty: glibc's malloc)."""

    rss_mib: float
    peak_mib: float
    after: dict[str, float]
    added: dict[str, float]
    gossip_state_mib: float
    allocator: str = ""
    seconds: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> MemoryStatus:
        w = "memory."
        stages = {key: {str(k): float(v) for k, v in (data.get(key) or {}).items()}
                  for key in ("after", "added", "seconds")}
        return cls(_field(data, "rss_mib", float, w), _field(data, "peak_mib", float, w), stages["after"],
                   stages["added"], float(data.get("gossip_state_mib", 0.0)), str(data.get("allocator") or ""),
                   stages["seconds"])


@dataclass(frozen=True)
class StorageStatus:
    """The state directory as the checkpoints see it (peer/daemon/durability.py). ``state``: ok, write_failing (the
    last write failed) or no_room (no room for the reserve and the next checkpoint); ``gossip_paused``: why no mass
    moves (None: gossip runs); ``failing_since``: wall clock of this spell's first failed write;
    ``paused_state_written``: whether the paused state reached the disk (None: no pause needed it yet)."""

    state: str = "ok"
    gossip_paused: str | None = None
    errors: int = 0
    last_error: str = ""
    failing_since: float | None = None
    reserve: bool = False
    paused_state_written: bool | None = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> StorageStatus:
        w = "storage."
        paused, written = data.get("gossip_paused"), data.get("paused_state_written")
        return cls(_field(data, "state", str, w), None if paused is None else str(paused), int(data.get("errors", 0)),
                   str(data.get("last_error", "")), _optional_float(data, "failing_since", w),
                   bool(data.get("reserve", False)), None if written is None else bool(written))


@dataclass(frozen=True)
class StatusDocument:
    """Everything a daemon reports about itself (see the module docstring for the JSON layout).

    ``loss`` is NaN before the first local step; ``eval`` None before the first evaluation; ``divergences`` counts
    recoveries (model rolled back, gamma halved); ``refused`` / ``dropped`` count inputs by reason.
    """

    peer_id: str
    fleet: str
    phase: Phase
    uptime_s: float
    round: int
    epoch: float
    lr: float
    loss: float
    eval: EvalResult | None
    w: float
    precision: PrecisionStatus
    model: ModelStatus
    gossip: GossipStatus
    last_round_s: float
    divergences: int
    gamma_halvings: int
    lr_halvings: int
    neighbours: dict[str, NeighbourStatus]
    refused: dict[str, int]
    dropped: dict[str, int]
    applied: int
    memory: MemoryStatus | None = None
    storage: StorageStatus | None = None
    #: Neighbours the robust receive rule quarantined (``lpdl-peer release`` lifts one).
    quarantined: list[str] = field(default_factory=list)
    consensus: ConsensusStatus | None = None  # None: a peer of a version before the consensus phase
    #: Seconds the rounds waited for neighbours this peer ran too far ahead of (node.max_unacked), in all.
    pace_wait_s: float = 0.0
    #: Lagging neighbours it does not wait for until they acknowledge (none answered within node.pace_wait_s).
    not_waited_for: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """The JSON-ready dict the control socket and the Status RPC send."""
        out = asdict(self)
        out["phase"] = self.phase.value
        out["eval"] = out["eval"] or {}
        for optional in ("memory", "storage", "consensus"):
            if getattr(self, optional) is None:
                del out[optional]
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> StatusDocument:
        """Parse a document :meth:`to_json` wrote (a daemon of this version or a slightly older one: fields added
        since take their defaults). Raises :class:`StatusFormatError` naming the first bad field."""
        if not isinstance(data, Mapping):
            raise StatusFormatError(f"status document: expected a JSON object, got {type(data).__name__}")
        phase_name = _field(data, "phase", str, "")
        try:
            phase = Phase(phase_name)
        except ValueError:
            raise StatusFormatError(f"status document: unknown phase {phase_name!r}") from None
        ev = data.get("eval")
        memory = data.get("memory")
        storage = data.get("storage")
        consensus = data.get("consensus")
        return cls(
            peer_id=_field(data, "peer_id", str, ""), fleet=_field(data, "fleet", str, ""), phase=phase,
            uptime_s=_field(data, "uptime_s", float, ""), round=_field(data, "round", int, ""),
            epoch=_field(data, "epoch", float, ""), lr=_field(data, "lr", float, ""),
            loss=math.nan if data.get("loss") is None else _field(data, "loss", float, ""),
            eval=EvalResult.from_json(ev) if ev else None, w=_field(data, "w", float, ""),
            precision=PrecisionStatus.from_json(_field(data, "precision", dict, "")),
            model=ModelStatus.from_json(_field(data, "model", dict, "")),
            gossip=GossipStatus.from_json(_field(data, "gossip", dict, "")),
            last_round_s=_field(data, "last_round_s", float, ""), divergences=int(data.get("divergences", 0)),
            gamma_halvings=int(data.get("gamma_halvings", 0)), lr_halvings=int(data.get("lr_halvings", 0)),
            neighbours={str(p): NeighbourStatus.from_json(n)
                        for p, n in _field(data, "neighbours", dict, "").items()},
            refused=_counts(data, "refused"), dropped=_counts(data, "dropped"),
            applied=_field(data, "applied", int, ""),
            memory=MemoryStatus.from_json(memory) if memory else None,
            storage=StorageStatus.from_json(storage) if storage else None,
            quarantined=[str(p) for p in data.get("quarantined") or []],
            consensus=ConsensusStatus.from_json(consensus) if consensus else None,
            pace_wait_s=float(data.get("pace_wait_s", 0.0)),
            not_waited_for=[str(p) for p in data.get("not_waited_for") or []],
        )


def build_status(*, peer: Peer, spec: RunSpec, fleet: str, model: Mapping[str, str], precision: PrecisionStatus,
                 progress: Progress, live: Mapping[str, str], edges: Mapping[str, EdgeSnapshot],
                 server: ServerSnapshot, memory: Mapping[str, Any]) -> StatusDocument:
    """The status document (cheap: no tensor work). The engine's figures come from one locked
    :meth:`Peer.status_snapshot`.

    Args:
        model: fingerprint, source and source_kind, and for a converted model its layer table
            (``layers``, text) and one-line summary (``layers_summary``).
        live: live peer set, ``peer_id -> host:port``.
        edges: outbound edge snapshots by receiver (peer/net/client.py EdgeSender.snapshot).
        server: the gRPC server's snapshot (links, refused, dropped, applied).
        memory: peer/daemon/memory.py MemoryStages.snapshot().
    """
    links = server.links
    gossip = peer.status_snapshot()
    robust = peer.robust_snapshot()  # per neighbour: score, clipped fraction, quarantined since (gossip/robust.py)
    neighbours: dict[str, NeighbourStatus] = {}
    for peer_id in sorted(set(live) | set(edges) | (set(links) & gossip.known_peers) | set(robust)):
        link = links.get(peer_id)
        edge = edges.get(peer_id)
        neighbours[peer_id] = NeighbourStatus(
            address=live.get(peer_id) or (edge.address if edge is not None else ""),
            live=peer_id in live,
            state=edge.state if edge is not None else "inbound-only" if link is not None else "known",
            in_flight=gossip.in_flight.get(peer_id, 0),
            bytes_sent=link.bytes_sent if link is not None else 0,
            bytes_received=link.bytes_received if link is not None else 0,
            rtt_s=(edge.ack_rtt_s or edge.hello_rtt_s) if edge is not None else None,
            last_seen=max(link.last_seen if link is not None else 0.0, edge.last_seen if edge is not None else 0.0),
            delivered=edge.delivered if edge is not None else 0,
            settled=dict(edge.settled) if edge is not None else {},
            last_error=edge.last_error if edge is not None else "",
            robust=robust.get(peer_id, {}),
            consensus_distance=gossip.distances.get(peer_id),
            certificate_serial=server.certificate_serials.get(peer_id),
        )
    g = spec.gossip
    return StatusDocument(
        peer_id=peer.peer_id,
        fleet=fleet,
        phase=progress.phase,
        uptime_s=time.time() - progress.started,
        round=progress.round,
        epoch=peer.epoch,
        lr=peer.lr(),
        loss=peer.last_loss,
        eval=progress.last_eval,
        w=gossip.w,
        precision=precision,
        model=ModelStatus.from_json({"name": spec.model.name, **model}),
        gossip=GossipStatus(algorithm=g.algorithm, compression=g.compression, bits=g.bits, gamma=gossip.gamma,
                            configured_gamma=g.effective_gamma,
                            topology=g.topology + (" rotating" if g.rotating else ""), window=g.window,
                            robust=gossip.robust, senders=gossip.senders, max_insiders=gossip.max_insiders),
        last_round_s=progress.last_round_s,
        divergences=peer.recovery.recoveries,
        gamma_halvings=peer.recovery.halvings,
        lr_halvings=peer.recovery.lr_halvings,
        neighbours=neighbours,
        refused=server.refused,
        dropped=server.dropped,
        applied=server.applied,
        memory=MemoryStatus.from_json({**memory, "gossip_state_mib": gossip.gossip_state_bytes / 2**20}),
        quarantined=sorted(p for p, r in robust.items() if r["quarantined_since"] is not None),
        consensus=ConsensusStatus.of(peer, gossip),
        pace_wait_s=progress.pace_wait_s,
        not_waited_for=list(progress.not_waited_for),
    )
