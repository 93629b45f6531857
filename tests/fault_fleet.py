"""A fleet of real daemons in network namespaces under a scripted fault schedule (issue 11), shared by
tests/test_netns_faults.py and bench/netns_fleet.py.

Host i of a :class:`~tests.netns.NetnsTestbed` runs ``lpdl-peer start --neighbors auto`` as peer ``h<i>`` (real
zeroconf mDNS on its own eth0, real gRPC, mutual TLS with a fleet CA, like deploy/netns-testbed.sh). Hosts
0..n_start-1 start together; the last host joins late. The schedule (:func:`run_schedule`):

    cut     h1 <-> h2 (nft drop rules inside h1), healed after ``hold_s``
    isolate h3 off the LAN (every eth0 packet dropped), back after ``hold_s``
    crash   h4 SIGKILLed and restarted from its checkpoint. ``quiescent``: taken off the LAN first and killed once
            its edges are down and it has checkpointed since (its checkpoint then is its state at the crash - what
            an exactly-once restart can promise); otherwise killed while gossiping (a realistic crash: mass moved
            after the last checkpoint is lost or counted twice, docs/design.md#exactly-once-mass-transfer)
    leave   h5 SIGTERMed for good (settles, says goodbye, keeps its final checkpoint)
    cap     h6's egress capped by tc tbf (1 Mbit/s) for the whole schedule
    join    the last host starts after the others have gossiped

It measures what the issue asks (seconds, monotonic clock of this process): discovery of the full neighbour set,
recovery of the cut edge after the heal (first Ack on it), the crashed peer from its restart to serving, to its
first round and to its first applied update, and the round times / RSS the daemons report.
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Self

from peer.config import RunSpec, load_run_spec, toml_text
from peer.daemon.control import read_control_socket
from peer.gossip.topology import Topology
from tests.daemon_helpers import Daemon, fleet_ca, start_daemon
from tests.netns import NetnsTestbed

PORT = 7070
FLEET = "faults"
UP = ("active", "busy")
#: Hosts of the schedule (see the module docstring).
CUT, ISOLATED, CRASHED, LEAVER, CAPPED = (1, 2), 3, 4, 5, 6


def peer_id(i: int) -> str:
    return f"h{i}"


def run_spec(**sections: dict[str, Any]) -> RunSpec:
    """A RunSpec from sections of settings (``model={"precision": "fp32"}``), ignoring LPDL_* variables."""
    return load_run_spec(None, flags=sections, environ={})


async def _read_all(paths: Sequence[Path], timeout_s: float) -> list[dict[str, Any] | None]:
    async def one(path: Path) -> dict[str, Any] | None:
        try:
            return await read_control_socket(path, timeout_s)
        except (OSError, asyncio.TimeoutError, ValueError):
            return None

    return await asyncio.gather(*(one(p) for p in paths))


def out_neighbours(spec: RunSpec, me: str, live: set[str]) -> set[str]:
    """Every peer ``me`` sends to over one period of the topology schedule, for the live set ``live``."""
    g = spec.gossip
    topology = Topology(g.topology, g.rotating, g.k, spec.data.seed)
    ids = sorted(live | {me})
    return {p for t in range(topology.period(len(ids))) for p in topology.out_neighbours(ids, me, t)}


def live_neighbours(doc: dict[str, Any] | None) -> set[str]:
    return set() if doc is None else {p for p, n in doc["neighbours"].items() if n["live"]}


def edge_state(doc: dict[str, Any] | None, to: str) -> str:
    return "" if doc is None else doc["neighbours"].get(to, {}).get("state", "")


def acked(doc: dict[str, Any] | None, to: str) -> int:
    """Updates on the edge to ``to`` settled by an Ack (applied by the receiver)."""
    return 0 if doc is None else int(doc["neighbours"].get(to, {}).get("delivered", 0))


@dataclass
class Measured:
    """What a run measured (seconds unless named otherwise; None where it did not happen)."""

    discovery_after_last_serving_s: float | None = None
    discovery_after_last_start_s: float | None = None
    cut_noticed_s: float | None = None          # cut -> the cut edge leaves the active state
    cut_recovery_s: float | None = None         # heal -> first Ack on the cut edge
    crash_restart_to_serving_s: float | None = None
    crash_restart_to_round_s: float | None = None
    crash_restart_to_applied_s: float | None = None
    crash_restart_to_acked_s: float | None = None
    crash_restored_round: int | None = None
    crash_round_at_kill: int | None = None
    join_start_to_serving_s: float | None = None
    join_start_to_seen_by_all_s: float | None = None
    rss_peak_mib: dict[str, float] = field(default_factory=dict)
    round_ms: dict[str, float] = field(default_factory=dict)  # bench: round times free / capped (ms)
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class FaultFleet:
    """Daemons ``h0..h<n-1>`` on a testbed; ``daemons[i]`` runs inside host i (started on demand).

    Args:
        tb: the testbed (one host per peer).
        root: state directories (``root/h<i>``), the CA and logs.
        spec: what every peer runs (its flags are passed to every daemon).
        env: extra daemon environment (``LPDL_NET_*`` timeouts).
        node_args: daemon flags besides the spec (``--checkpoint-every``...), the same for every peer.
        shards: shard ``(rank, n)`` of each host (default: host i of n hosts).
        join_wait_s: per host, seconds a first start waits for a neighbour to pull the model from (None = default).
    """

    def __init__(self, tb: NetnsTestbed, root: Path, spec: RunSpec, env: dict[str, str] | None = None,
                 node_args: Sequence[str] = (), shards: dict[int, tuple[int, int]] | None = None,
                 join_wait_s: dict[int, float] | None = None) -> None:
        self.tb = tb
        self.spec = spec
        self.ca = fleet_ca(root, FLEET)
        n = tb.n_hosts
        self.shards = {i: (shards or {}).get(i, (i, n)) for i in range(n)}  # host -> (rank, n) of its data
        join_wait_s = join_wait_s or {}
        run_config = root / "run.toml"  # every daemon runs exactly this spec, as `lpdl-peer fleet` passes it
        run_config.write_text(toml_text(spec.sections()), encoding="utf-8")
        self.daemons: list[Daemon] = [
            start_daemon(root / peer_id(i), peer_id(i), PORT, host=tb.ip(i), neighbors="auto", mdns_ip=tb.ip(i),
                         run_flags=["--config", str(run_config)], launch=False, tls_ca=self.ca,
                         join_wait_s=join_wait_s.get(i), env=env, wrap=lambda argv, i=i: tb.argv(i, argv),
                         extra=["--shard", "{}/{}".format(*self.shards[i]), *node_args])
            for i in range(n)]
        self.started_at: dict[int, float] = {}
        self.left: set[int] = set()  # hosts stopped for good

    # --- processes ---------------------------------------------------------------------------------------------
    def start(self, hosts: Sequence[int]) -> float:
        """Start the daemons of ``hosts``; returns the monotonic time the last one was started."""
        for i in hosts:
            self.daemons[i].start()
            self.started_at[i] = time.monotonic()
        return time.monotonic()

    def running(self) -> list[int]:
        return [i for i, d in enumerate(self.daemons) if d.running]

    def close(self) -> None:
        for d in self.daemons:
            d.kill()

    # --- status ------------------------------------------------------------------------------------------------
    def statuses(self, hosts: Sequence[int], timeout_s: float = 3.0) -> dict[int, dict[str, Any] | None]:
        """Every host's status document at once (None where its control socket does not answer)."""
        docs = asyncio.run(_read_all([self.daemons[i].control_socket for i in hosts], timeout_s))
        return dict(zip(hosts, docs))

    def wait(self, predicate: Callable[[dict[int, dict[str, Any] | None]], bool], hosts: Sequence[int],
             timeout_s: float, what: str, poll_s: float = 0.1) -> tuple[dict[int, dict[str, Any] | None], float]:
        """Poll ``hosts`` until ``predicate(statuses)`` holds; returns them and the monotonic time it held.

        Raises:
            DaemonError: (from the daemon) one of ``hosts`` exited, or the timeout passed.
        """
        deadline = time.monotonic() + timeout_s
        docs: dict[int, dict[str, Any] | None] = {}
        while time.monotonic() < deadline:
            for i in hosts:
                if not self.daemons[i].running:
                    raise self.daemons[i].fail(f"exited while waiting for {what}")
            docs = self.statuses(hosts)
            now = time.monotonic()
            if predicate(docs):
                return docs, now
            time.sleep(poll_s)
        summary = {peer_id(i): None if d is None else (d["round"], d["phase"], sorted(live_neighbours(d)))
                   for i, d in docs.items()}
        raise self.daemons[hosts[0]].fail(f"not {what} within {timeout_s:.0f} s; (round, phase, live) per host: "
                                          f"{summary}")

    def wait_full_mesh(self, hosts: Sequence[int], timeout_s: float, what: str = "a full mesh"
                       ) -> tuple[dict[int, dict[str, Any] | None], float]:
        """Until every host lists every other one as live, none that left, and has its edge to each one up."""
        ids = {i: {peer_id(j) for j in hosts if j != i} for i in hosts}

        def full(docs: dict[int, dict[str, Any] | None]) -> bool:
            return all(d is not None and d["phase"] == "training" and live_neighbours(d) >= ids[i]
                       and not live_neighbours(d) & {peer_id(j) for j in self.left}
                       and all(edge_state(d, p) in UP for p in ids[i])
                       for i, d in docs.items())

        return self.wait(full, hosts, timeout_s, what)

    def wait_discovery(self, hosts: Sequence[int], timeout_s: float, measured: Measured) -> None:
        """Until every host of ``hosts`` lists all the others as live; records when, from the last process start
        and from the moment the last daemon first answered its control socket (serving, registered on mDNS)."""
        first_answer: dict[int, float] = {}
        want = {i: {peer_id(j) for j in hosts if j != i} for i in hosts}

        def seen(docs: dict[int, dict[str, Any] | None]) -> bool:
            now = time.monotonic()
            for i, d in docs.items():
                if d is not None:
                    first_answer.setdefault(i, now)
            return all(d is not None and live_neighbours(d) >= want[i] for i, d in docs.items())

        _, done = self.wait(seen, hosts, timeout_s, "every peer seeing the full neighbour set", poll_s=0.02)
        measured.discovery_after_last_serving_s = done - max(first_answer.values())
        measured.discovery_after_last_start_s = done - max(self.started_at[i] for i in hosts)

    def sample_round_ms(self, hosts: Sequence[int], seconds: float) -> dict[int, float]:
        """Each host's median round time (ms) over ``seconds`` (every distinct round's ``last_round_s``)."""
        seen: dict[int, dict[int, float]] = {i: {} for i in hosts}
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for i, d in self.statuses(hosts).items():
                if d is not None and d["last_round_s"] > 0:
                    seen[i][d["round"]] = d["last_round_s"]
            time.sleep(0.2)
        return {i: statistics.median(r.values()) * 1000 for i, r in seen.items() if r}

    def record_rss(self, measured: Measured) -> None:
        for i, d in self.statuses(self.running()).items():
            if d is not None and d.get("memory"):
                measured.rss_peak_mib[peer_id(i)] = max(measured.rss_peak_mib.get(peer_id(i), 0.0),
                                                        float(d["memory"]["peak_mib"]))


class Monitor:
    """Reads every host's status in a background thread (every ``poll_s`` seconds) and records the first moment
    each watched condition held, so that recovery times do not depend on what the schedule's thread was busy with.

    A condition gets the statuses of all hosts (``{host: document or None}``); one that raises counts as false.
    """

    def __init__(self, fleet: FaultFleet, poll_s: float = 0.1) -> None:
        self.fleet = fleet
        self.poll_s = poll_s
        self._watches: dict[str, Callable[[dict[int, dict[str, Any] | None]], bool]] = {}
        self._fired: dict[str, float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fleet-monitor", daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def watch(self, name: str, condition: Callable[[dict[int, dict[str, Any] | None]], bool]) -> None:
        with self._lock:
            self._watches[name] = condition

    def when(self, name: str, timeout_s: float) -> float | None:
        """Monotonic time ``name`` first held, waiting up to ``timeout_s``; None if it did not."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                if name in self._fired:
                    return self._fired[name]
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def _run(self) -> None:
        hosts = list(range(self.fleet.tb.n_hosts))
        while not self._stop.is_set():
            docs = self.fleet.statuses(hosts, timeout_s=2.0)
            now = time.monotonic()
            with self._lock:
                pending = {n: c for n, c in self._watches.items() if n not in self._fired}
            for name, condition in pending.items():
                try:
                    held = condition(docs)
                except (KeyError, TypeError):
                    held = False
                if held:
                    with self._lock:
                        self._fired[name] = now
            self._stop.wait(self.poll_s)


def _still(fleet: FaultFleet, host: int) -> Callable[[dict[int, dict[str, Any] | None]], bool]:
    """Whether no edge ``host`` sends on can take another update: down, or its window full of updates no Ack can
    settle (what an isolated peer reaches within an Ack timeout)."""
    me, window = peer_id(host), fleet.spec.gossip.window

    def still(docs: dict[int, dict[str, Any] | None]) -> bool:
        doc = docs[host]
        return doc is not None and all(doc["neighbours"][p]["state"] not in UP
                                       or doc["neighbours"][p]["in_flight"] >= window
                                       for p in out_neighbours(fleet.spec, me, live_neighbours(doc)))
    return still


def run_schedule(fleet: FaultFleet, measured: Measured, *, quiescent_crash: bool, hold_s: float = 10.0,
                 cap: str = "1mbit", late: int | None = None, on_phase: Callable[[str], None] = print) -> None:
    """The fault schedule of the module docstring; returns once every fault is undone, every running peer sees
    every other one (and none that left) with its edges up, the crashed peer trains again, and the late joiner
    is in. The caller decides how long the fleet runs afterwards."""
    late = fleet.tb.n_hosts - 1 if late is None else late
    originals = [i for i in fleet.running() if i != late]
    a, b = CUT
    on_phase(f"faults: cap h{CAPPED} {cap}, cut h{a}<->h{b}, isolate h{ISOLATED}, crash h{CRASHED} "
             f"({'quiescent' if quiescent_crash else 'while gossiping'}), for {hold_s:g} s")
    with Monitor(fleet) as monitor:
        fleet.tb.cap(CAPPED, cap)
        t_cut = time.monotonic()
        fleet.tb.cut(a, b)
        monitor.watch("cut noticed", lambda ds: edge_state(ds[a], peer_id(b)) not in UP)
        fleet.tb.isolate(ISOLATED)
        crashed = fleet.daemons[CRASHED]
        if quiescent_crash:
            fleet.tb.isolate(CRASHED)
            docs, _ = fleet.wait(_still(fleet, CRASHED), [CRASHED], 60 + hold_s,
                                 f"h{CRASHED}'s edges down or full while it is off the LAN")
            settled = docs[CRASHED]["round"]  # type: ignore[index]
            # two more rounds: the checkpoint written after the last one holds all it did before going still
            fleet.wait(lambda ds: ds[CRASHED]["round"] >= settled + 2, [CRASHED], 60, f"h{CRASHED} 2 rounds on")
        doc = fleet.statuses([CRASHED])[CRASHED]
        measured.crash_round_at_kill = None if doc is None else doc["round"]
        crashed.kill()
        killed_at = time.monotonic()
        time.sleep(max(0.0, t_cut + hold_s - time.monotonic()))

        acked_at_heal = acked(fleet.statuses([a])[a], peer_id(b))
        monitor.watch("cut acked", lambda ds: acked(ds[a], peer_id(b)) > acked_at_heal)
        t_heal = time.monotonic()
        fleet.tb.heal(a, b)
        fleet.tb.rejoin(ISOLATED)
        fleet.tb.rejoin(CRASHED)
        time.sleep(max(0.0, killed_at + 2.0 - time.monotonic()))  # a crashed device takes a moment to come back
        restored: list[int] = []

        def crash_serving(ds: dict[int, dict[str, Any] | None]) -> bool:
            if ds[CRASHED] is not None and ds[CRASHED]["phase"] == "training":
                if not restored:
                    restored.append(ds[CRASHED]["round"])
                return True
            return False

        monitor.watch("crash serving", crash_serving)
        monitor.watch("crash round", lambda ds: crash_serving(ds) and ds[CRASHED]["round"] > restored[0])
        monitor.watch("crash applied", lambda ds: crash_serving(ds) and ds[CRASHED]["applied"] > 0)
        monitor.watch("crash acked", lambda ds: crash_serving(ds) and any(
            n["delivered"] > 0 for n in ds[CRASHED]["neighbours"].values()))
        t_restart = fleet.start([CRASHED])
        on_phase(f"healed and rejoined; h{CRASHED} restarted; h{LEAVER} leaves for good; h{late} joins")
        fleet.daemons[LEAVER].proc.terminate()  # type: ignore[union-attr]  # SIGTERM: settle, goodbye, checkpoint
        fleet.left.add(LEAVER)
        others = [i for i in originals if i != LEAVER]
        monitor.watch("join serving", lambda ds: ds[late]["phase"] == "training")
        monitor.watch("join seen", lambda ds: all(peer_id(late) in live_neighbours(ds[i]) for i in others))
        t_join = fleet.start([late])

        def since(name: str, t0: float, timeout_s: float = 180.0) -> float | None:
            t = monitor.when(name, timeout_s)
            if t is None and timeout_s:
                measured.notes.append(f"{name}: not within {timeout_s:.0f} s")
            return None if t is None else t - t0

        measured.cut_noticed_s = since("cut noticed", t_cut, 0.0)
        if measured.cut_noticed_s is None:
            measured.notes.append(f"no status read saw the cut edge h{a}->h{b} out of the active state during the "
                                  f"cut (its stream was not found broken before the heal)")
        measured.cut_recovery_s = since("cut acked", t_heal)
        measured.crash_restart_to_serving_s = since("crash serving", t_restart)
        measured.crash_restored_round = restored[0] if restored else None
        measured.crash_restart_to_round_s = since("crash round", t_restart)
        measured.crash_restart_to_applied_s = since("crash applied", t_restart)
        measured.crash_restart_to_acked_s = since("crash acked", t_restart)
        measured.join_start_to_serving_s = since("join serving", t_join)
        measured.join_start_to_seen_by_all_s = since("join seen", t_join)
    assert fleet.daemons[LEAVER].wait_exit(60) == 0, fleet.daemons[LEAVER].fail("a clean leave exits 0")
    assert "restored checkpoint" in crashed.log_text().split("===== start #")[-1], crashed.fail("no restore")
    fleet.tb.uncap(CAPPED)
    on_phase("faults over: waiting for a full mesh with every edge up")
    fleet.wait_full_mesh(fleet.running(), 180, "a full mesh after the faults")
    fleet.record_rss(measured)


def write_distinct_baselines(fleet: FaultFleet, seed_base: int = 1000) -> list[dict[str, Any]]:
    """Give every host a first checkpoint (round 0, w = 1) holding its OWN initial model - the fleet's common start
    moved 40% of the way to the model the spec builds with seed ``seed_base + i`` (peers about 0.57 of the norm
    apart) - so that consensus is not trivially reached (all peers built from one seed start equal) and the fleet's
    initial mass is known exactly: the daemons restore these and never pull a model. Not independent random models:
    those are sqrt(2) of the norm apart, a disagreement the robust receive rule holds as implausible (more than the
    model's norm; a sign flip is 2). Written by the runtime's own assembly and checkpoint code (runtime.build,
    runtime.state); returns the states."""
    import torch

    from peer.runtime import state
    from peer.runtime.build import build_peer, build_peer_model, load_splits
    from peer.runtime.flat import FlatModel

    spec, cpu = fleet.spec, torch.device("cpu")
    splits = load_splits(spec.data)
    built = build_peer_model(spec.model, splits, cpu, seed=spec.data.seed)
    states = []
    for i, d in enumerate(fleet.daemons):
        peer = build_peer(spec, d.peer_id, fleet.shards[i], splits, cpu, built)
        other = FlatModel(build_peer_model(spec.model, splits, cpu, seed=seed_base + i).model).z
        with peer.lock:
            common = peer.engine.state.x.clone()
            peer.engine.state.x.copy_(common + 0.4 * (other - common))
            peer.engine.state.debias_into(peer.flat.z)
        state.save(peer, d.checkpoint_path, 0, asdict(spec), built.fingerprint)
        states.append(d.checkpoint())
    return states


def run_until(fleet: FaultFleet, hosts: Sequence[int], target: float, timeout_s: float) -> None:
    """Until the median round of ``hosts`` reaches ``target`` (peers run at their own pace)."""
    fleet.wait(lambda ds: statistics.median(d["round"] if d else 0 for d in ds.values()) >= target,
               list(hosts), timeout_s, f"median round >= {target:g}", poll_s=0.5)
