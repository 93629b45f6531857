"""The daemon's own config and the one object ``lpdl-peer start`` loads: the run, the ``[node]`` and ``[net]`` tables.

Why here and not in peer/config.py: config is the floor every driver stands on (the simulator, ``train`` and the
daemon alike); the daemon's settings and enumerations belong to the daemon, which stands on config like
net/config.py's NetConfig does (tests/test_import_graph.py checks the floors). The file is read once
(:func:`load_daemon_config`), and the fleet writes what it resolved for each daemon back as TOML
(:meth:`DaemonConfig.toml`) for ``lpdl-peer start --config FILE``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from peer.config import RUN_SECTIONS, RunSpec, check, load_sections, one_of, toml_text
from peer.daemon.kinds import ALLOCATORS
from peer.net.config import NetConfig


@dataclass(frozen=True)
class NodeSpec:
    """The daemon's own settings (``[node]`` table, ``lpdl-peer start`` flags, ``LPDL_NODE_*`` variables).

    Attributes:
        listen: ``host:port`` of the gRPC server (port 0 = any free port).
        neighbors: "auto" (mDNS) and/or static ``host:port`` entries.
        mdns_ip: IPv4 address(es) to run and advertise mDNS on (comma separated); empty = primary interface.
        fleet: fleet name; peers of another fleet are ignored.
        state_dir: checkpoints, identity and the control socket; empty = $STATE_DIRECTORY or
            ~/.local/state/lpdl-peer.
        peer_id: stable peer id; empty = generated once and kept in the state directory.
        shard: ``R/N``: this peer trains on shard R of N of the dataset (demos on one shared dataset); 0/1 = all.
        device: torch device.
        threads: torch intra-op threads (0 = torch's default).
        allocator: malloc the daemon runs on (peer/daemon/allocator.py): ``auto`` = tcmalloc, else jemalloc, where
            installed, else glibc; or one named (an error if not installed).
        max_rounds: stop after this many rounds (0 = no limit).
        exit_when_done: exit after ``optim.epochs`` epochs instead of gossiping on at the final learning rate.
        eval_every: rounds between evaluations of the local de-biased model on the test split.
        checkpoint_every: rounds between checkpoints.
        round_interval_s: minimum seconds per round (slows gossip on metered links; 0 = as fast as training).
        max_unacked: messages unacknowledged on one edge before this peer's next round waits for that neighbour:
            as a receiver acknowledges at its round boundaries, at most this many rounds per round of each peer it
            sends to (peer/daemon/pace.py; 0 = no bound but the gossip window). Off for ``start`` until the mass-sink
            detector allows for a paced neighbour (one waiting up to ``pace_wait_s`` reads as silent to the peers
            it feeds: a CI run saw an honest daemon routed around); ``lpdl-peer fleet`` runs 1.
        pace_wait_s: longest one round waits for lagging neighbours (seconds); one still lagging then is not
            waited for again until it acknowledges.
        join_wait_s: at first start, seconds to wait for a neighbour to pull the current model from.
        metrics_port: Prometheus exporter port (0 = off).
        metrics_host: address the exporter binds.
        tls_dir: TLS directory (ca.pem, cert.pem, key.pem, revoked; ``lpdl-peer ca issue``); empty =
            ``<state_dir>/tls``. The certificate's peer id is this peer's id.
        insecure: no TLS at all: every caller is trusted by the identity it claims (a lab only; logged loudly).
    """

    listen: str = "0.0.0.0:7070"
    neighbors: tuple[str, ...] = ("auto",)
    mdns_ip: tuple[str, ...] = ()
    fleet: str = "default"
    state_dir: str = ""
    peer_id: str = ""
    shard: str = "0/1"
    device: str = "cpu"
    threads: int = 0
    allocator: str = "auto"
    max_rounds: int = 0
    exit_when_done: bool = False
    eval_every: int = 20
    checkpoint_every: int = 50
    round_interval_s: float = 0.0
    max_unacked: int = 0
    pace_wait_s: float = 1.0
    join_wait_s: float = 3.0
    metrics_port: int = 0
    metrics_host: str = "127.0.0.1"
    tls_dir: str = ""
    insecure: bool = False

    def __post_init__(self) -> None:
        host, _, port = self.listen.rpartition(":")
        check(bool(host) and port.isdigit() and 0 <= int(port) < 65536, "node.listen", self.listen,
              "expected host:port")
        for entry in self.neighbors:
            if entry != "auto":
                h, _, p = entry.rpartition(":")
                check(bool(h) and p.isdigit() and 0 < int(p) < 65536, "node.neighbors", entry,
                      "expected 'auto' or host:port entries")
        check(bool(self.fleet) and len(self.fleet) <= 63, "node.fleet", self.fleet, "expected 1-63 characters")
        rank, _, total = self.shard.partition("/")
        check(rank.isdigit() and total.isdigit() and int(rank) < int(total), "node.shard", self.shard,
              "expected R/N with 0 <= R < N")
        check(self.threads >= 0, "node.threads", self.threads, "expected >= 0")
        check(self.allocator in ALLOCATORS, "node.allocator", self.allocator, one_of(ALLOCATORS))
        check(self.max_rounds >= 0, "node.max_rounds", self.max_rounds, "expected >= 0")
        check(self.eval_every >= 1, "node.eval_every", self.eval_every, "expected >= 1")
        check(self.checkpoint_every >= 1, "node.checkpoint_every", self.checkpoint_every, "expected >= 1")
        check(self.round_interval_s >= 0, "node.round_interval_s", self.round_interval_s, "expected >= 0")
        check(self.max_unacked >= 0, "node.max_unacked", self.max_unacked, "expected >= 0 (0 = no bound)")
        check(self.pace_wait_s >= 0, "node.pace_wait_s", self.pace_wait_s, "expected >= 0 seconds")
        check(self.join_wait_s >= 0, "node.join_wait_s", self.join_wait_s, "expected >= 0")
        check(0 <= self.metrics_port < 65536, "node.metrics_port", self.metrics_port, "expected 0..65535")

    @property
    def shard_index(self) -> tuple[int, int]:
        rank, _, total = self.shard.partition("/")
        return int(rank), int(total)

    @property
    def auto_discovery(self) -> bool:
        return "auto" in self.neighbors

    @property
    def static_neighbors(self) -> list[str]:
        return [n for n in self.neighbors if n != "auto"]


#: The tables of a daemon's config, by name.
DAEMON_SECTIONS: dict[str, type] = {**RUN_SECTIONS, "node": NodeSpec, "net": NetConfig}


@dataclass(frozen=True)
class DaemonConfig:
    """Everything a daemon runs on, validated: what it trains (``run``), its own settings and its transport."""

    run: RunSpec = field(default_factory=RunSpec)
    node: NodeSpec = field(default_factory=NodeSpec)
    net: NetConfig = field(default_factory=NetConfig)

    def sections(self) -> dict[str, Any]:
        """Every section by its table name."""
        return {**self.run.sections(), "node": self.node, "net": self.net}

    def toml(self) -> str:
        """The whole config as a TOML file that :func:`load_daemon_config` reads back into an equal config."""
        return toml_text(self.sections())


def load_daemon_config(path: str | Path | None = None, flags: dict[str, dict[str, Any]] | None = None,
                       environ: dict[str, str] | None = None,
                       defaults: dict[str, dict[str, Any]] | None = None) -> DaemonConfig:
    """The fields' defaults, then a command's own ``defaults``, then the TOML file (read once), then
    ``LPDL_<SECTION>_<FIELD>`` variables, then ``flags`` (each ``{section: {field: value}}``)."""
    built = load_sections(DAEMON_SECTIONS, path, flags, environ, defaults)
    return DaemonConfig(RunSpec(**{name: built[name] for name in RUN_SECTIONS}), built["node"], built["net"])
