"""peer/config.py and peer/net/config.py: enumerations from their domain modules, the exactly-once window, and
``section.field: expected ..., got ...`` errors that the CLI shows as usage errors."""

from __future__ import annotations

from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from peer.cli.main import cli
from peer.cli.options import RUN_FLAGS, pop_run_spec, run_spec_options
from peer.compress.kinds import ROUNDINGS
from peer.config import ConfigError, GossipSpec, ModelSpec, default_gamma, load_run_spec
from peer.gossip.kinds import ALGORITHMS, TOPOLOGIES
from peer.lowp.kinds import NORM_KINDS, PRECISION_MODES
from peer.models.kinds import KEEP_NORM
from peer.net.config import NetConfig

#: (spec class, field, domain enumeration, dotted name, flag)
ENUMS = [
    (ModelSpec, "norm", NORM_KINDS, "model.norm", "--norm"),
    (ModelSpec, "precision", PRECISION_MODES, "model.precision", "--precision"),
    (GossipSpec, "algorithm", ALGORITHMS, "gossip.algorithm", "--algorithm"),
    (GossipSpec, "rounding", ROUNDINGS, "gossip.rounding", "--rounding"),
    (GossipSpec, "topology", TOPOLOGIES, "gossip.topology", "--topology"),
]


def _valid(cls: type, field: str, value: str) -> object:
    extra = {"compression": 0.0} if (cls, field, value) == (GossipSpec, "algorithm", "sgp") else {}
    return cls(**{field: value}, **extra)


@pytest.mark.parametrize("cls,field,kinds,name,flag", ENUMS, ids=[e[3] for e in ENUMS])
def test_enumeration_comes_from_its_domain_module(cls: type, field: str, kinds: tuple[str, ...], name: str,
                                                  flag: str) -> None:
    for value in kinds:
        assert getattr(_valid(cls, field, value), field) == value
    with pytest.raises(ConfigError) as err:
        cls(**{field: "bogus"})
    listed = ", ".join(kinds[:-1]) + f" or {kinds[-1]}"
    assert str(err.value) == f"{name}: expected {listed}, got 'bogus'"
    choice = next(f.kind for f in RUN_FLAGS if f.flag == flag)
    extra = (KEEP_NORM,) if name == "model.norm" else ()  # a plug-in model may keep its own BatchNorm
    assert isinstance(choice, click.Choice) and tuple(choice.choices) == kinds + extra


def test_window_defaults_to_32_and_is_validated() -> None:
    assert GossipSpec().window == 32
    assert GossipSpec(window=1).window == 1 and GossipSpec(window=64).window == 64
    for bad in (0, 65):
        with pytest.raises(ConfigError, match=rf"^gossip\.window: expected 1\.\.64, got {bad}$"):
            GossipSpec(window=bad)


def test_window_from_flag_file_and_environment(tmp_path: Path) -> None:
    @click.command()
    @run_spec_options()
    def probe(**kwargs: object) -> None:
        click.echo(pop_run_spec(kwargs).gossip.window)

    assert CliRunner().invoke(probe, ["--window", "16"]).output.strip() == "16"
    result = CliRunner().invoke(probe, ["--window", "0"])
    assert result.exit_code == 2 and "--window" in result.output
    cfg = tmp_path / "peer.toml"
    cfg.write_text("[gossip]\nwindow = 8\n")
    assert load_run_spec(cfg, environ={}).gossip.window == 8
    assert load_run_spec(cfg, environ={"LPDL_GOSSIP_WINDOW": "2"}).gossip.window == 2
    with pytest.raises(ConfigError, match=r"^gossip\.window: expected 1\.\.64, got 99$"):
        load_run_spec(None, environ={"LPDL_GOSSIP_WINDOW": "99"})


@pytest.mark.parametrize("kwargs,message", [
    ({"ack_timeout_s": 0.0}, "net.ack_timeout_s: expected > 0 seconds, got 0.0"),
    ({"backoff_base_s": 2.0, "backoff_max_s": 1.0}, "net.backoff_max_s: expected >= net.backoff_base_s (2.0), got 1.0"),
    ({"chunk_bytes": 0}, "net.chunk_bytes: expected 1..net.max_chunk_bytes (1048576), got 0"),
    ({"liveness_interval_s": 30.0, "peer_expiry_s": 20.0},
     "net.peer_expiry_s: expected > net.liveness_interval_s (30.0): a live peer would be evicted between two checks, "
     "got 20.0"),
    ({"max_message_bytes": 1024 * 1024},
     "net.max_chunk_bytes: expected <= net.max_message_bytes (1048576) - 65536 header bytes, got 1048576"),
])
def test_net_config_errors_name_the_field(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        NetConfig(**kwargs)
    assert str(err.value) == message


def test_start_shows_a_net_config_error_as_a_usage_error(tmp_path: Path) -> None:
    """Fails before anything heavy is built: exit 2, one line naming the field."""
    cfg = tmp_path / "peer.toml"
    cfg.write_text("[net]\nconnect_timeout_s = 0\n")
    result = CliRunner().invoke(cli, ["start", "--config", str(cfg), "--state-dir", str(tmp_path)])
    assert result.exit_code == 2, result.output
    assert "net.connect_timeout_s: expected > 0 seconds, got 0.0" in result.output
    assert "Traceback" not in result.output


def test_default_gamma_follows_the_kept_fraction() -> None:
    """1 dense; 0.5 * sqrt(1 - c) with top-k: inside the measured stability limits (99%: < 0.1, 90%: < 0.5)."""
    assert default_gamma(0.0) == 1.0
    assert default_gamma(0.99) == pytest.approx(0.05)
    assert default_gamma(0.9) == pytest.approx(0.158, abs=1e-3)
    assert GossipSpec().effective_gamma == pytest.approx(0.05)  # the product default: choco at 99%
    assert GossipSpec(gamma=0.3).effective_gamma == 0.3


def test_warm_up_flag_sets_the_warm_up() -> None:
    assert load_run_spec().optim.warmup_epochs == 1.0  # the paper's one epoch
    assert load_run_spec(flags={"optim": {"warmup_epochs": 2.0}}).optim.warmup_epochs == 2.0


def test_start_reads_its_config_file_once_into_one_object(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`start` builds the run, [node] and [net] from one read of the file; flags beat the file, the file the
    defaults."""
    import peer.config
    from peer.cli.options import pop_daemon_config
    from peer.cli.start import NODE_FLAGS, start

    reads: list[object] = []
    read_toml = peer.config.read_toml
    monkeypatch.setattr(peer.config, "read_toml", lambda path: reads.append(path) or read_toml(path))
    cfg = tmp_path / "peer.toml"
    cfg.write_text('[optim]\nlr = 0.2\n[gossip]\nwindow = 9\n[node]\nfleet = "lab"\nthreads = 3\n'
                   "[net]\nack_timeout_s = 12.0\n")
    params = dict(start.make_context("start", ["--config", str(cfg), "--window", "4", "--threads", "2"]).params)
    config = pop_daemon_config(params, RUN_FLAGS + NODE_FLAGS)
    assert reads == [str(cfg)]
    assert (config.run.optim.lr, config.run.gossip.window, config.node.fleet, config.node.threads,
            config.net.ack_timeout_s) == (0.2, 4, "lab", 2, 12.0)
    assert not params, "every config flag is consumed"


def test_the_daemon_config_survives_its_own_toml(tmp_path: Path) -> None:
    """What the fleet writes for a daemon (DaemonConfig.toml) loads back into an equal config, strings with quotes,
    backslashes, control characters and non-ASCII included; None fields stay None."""
    import tomllib

    from peer.config import DataSpec, OptimSpec, RunSpec
    from peer.daemon.config import DaemonConfig, NodeSpec, load_daemon_config

    odd = 'a "b" \\c\n\td\x7fé✓\U0001F600'
    config = DaemonConfig(
        RunSpec(ModelSpec(name="torchvision:mobilenet_v3_small", options=("width_mult=0.75",), norm="keep"),
                DataSpec(dataset="imagefolder", root=odd, image_size=96, augment=None),
                OptimSpec(lr=1e-05, epochs=0.3, weight_decay=0.0),
                GossipSpec(gamma=0.125, window_mib=0.5)),
        NodeSpec(neighbors=("auto", "10.0.0.2:7070"), mdns_ip=(), state_dir=odd, fleet="f" * 63),
        NetConfig(max_peers=3, liveness_interval_s=0.2, peer_expiry_s=1.5))
    text = config.toml()
    assert tomllib.loads(text)["data"]["root"] == odd and "gamma = 0.125" in text
    path = tmp_path / "peer.toml"
    path.write_text(text, encoding="utf-8")
    assert load_daemon_config(path, environ={}) == config
    assert "augment" not in tomllib.loads(text)["data"]  # None: left out, the default (None) again


def test_the_daemon_enumerations_are_validated_by_the_daemons_config() -> None:
    from peer.daemon.config import NodeSpec
    from peer.daemon.kinds import ALLOCATORS

    for value in ALLOCATORS:
        assert NodeSpec(allocator=value).allocator == value
    with pytest.raises(ConfigError) as err:
        NodeSpec(allocator="mimalloc")
    assert str(err.value) == "node.allocator: expected auto, glibc, tcmalloc or jemalloc, got 'mimalloc'"


def test_each_default_is_stated_once() -> None:
    """The window and the peer bound have one default each, which the config, the transport and the engine share."""
    import inspect

    from peer.gossip.engine import GossipEngine
    from peer.gossip.ledger import DEFAULT_MAX_PEERS, DEFAULT_WINDOW

    engine = inspect.signature(GossipEngine).parameters
    assert GossipSpec().window == engine["window"].default == DEFAULT_WINDOW
    assert NetConfig().max_peers == engine["max_peers"].default == DEFAULT_MAX_PEERS
