"""The daemon in-process (no neighbours): round loop, control socket, metrics, checkpoint/restore, config errors."""

from __future__ import annotations

import asyncio
import json
import re
import urllib.request
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from peer.cli.main import cli
from peer.cli.status import format_status
from peer.config import GossipSpec, ModelSpec, OptimSpec, RunSpec
from peer.daemon.config import DaemonConfig, NodeSpec
from peer.daemon.control import read_control_socket
from peer.daemon.node import Node
from peer.daemon.paths import CHECKPOINT_NAME, CONTROL_SOCKET_NAME
from peer.daemon.status import StatusDocument
from peer.data import load_dataset
from peer.runtime.schedule import lr_at
from peer.runtime.state import load
from peer.security import ca
from peer.security.credentials import TransportSecurity

RUN = RunSpec(model=ModelSpec(name="mnist-cnn", precision="fp32"), optim=OptimSpec(lr=0.05, epochs=1),
              gossip=GossipSpec(algorithm="choco", compression=0.9))


def small_splits():
    return load_dataset("synthetic", num_classes=10, n_train=200, n_test=50, image_size=28, in_channels=1)


def make_node(state_dir: Path, max_rounds: int, metrics_port: int = 0) -> Node:
    spec = NodeSpec(listen="127.0.0.1:0", neighbors=(), state_dir=str(state_dir), peer_id="solo",
                    max_rounds=max_rounds, eval_every=2, checkpoint_every=3, metrics_port=metrics_port, threads=1,
                    insecure=True)
    return Node(DaemonConfig(RUN, spec), splits=small_splits())


def test_node_runs_rounds_serves_status_and_checkpoints(tmp_path: Path) -> None:
    node = make_node(tmp_path, max_rounds=6)
    snapshots = []

    async def main() -> None:
        task = asyncio.create_task(node.run())
        sock = tmp_path / CONTROL_SOCKET_NAME
        for _ in range(200):
            if sock.exists() and node.progress.round >= 3:  # after the first evaluation (round 2)
                snapshots.append(await read_control_socket(sock))
                break
            await asyncio.sleep(0.05)
        assert await task == 0

    asyncio.run(main())
    assert snapshots, "control socket never answered"
    s = snapshots[0]
    assert s["peer_id"] == "solo" and s["round"] >= 2 and s["precision"]["backend"] == "fp32"
    assert s["gossip"]["gamma"] == pytest.approx(0.5 * 0.1 ** 0.5)  # default: min(1, 0.5 * sqrt(1 - 0.9))
    view = format_status(StatusDocument.from_json(s))  # the document round-trips its JSON
    assert StatusDocument.from_json(s).to_json().keys() == s.keys()
    assert "solo" in view and "no neighbours" in view
    memory = s["memory"]  # the start-up breakdown, in stage order, each stage's RSS above the previous one
    assert list(memory["after"]) == ["imports", "dataset", "model", "peer", "network", "training"]
    assert memory["after"]["imports"] > 0 and memory["peak_mib"] >= memory["rss_mib"] > 0
    assert sum(memory["added"].values()) == pytest.approx(memory["after"]["training"])
    text = view
    # a stage's RSS change is signed: in a pytest process that earlier tests left garbage in, the heap trimmed at the
    # end of start-up can make the training stage's change negative (-5 MiB in a fresh-clone CI run)
    assert "memory    RSS" in text and re.search(r"training [+-]\d", text) and max(map(len, text.splitlines())) <= 80
    state = load(tmp_path / CHECKPOINT_NAME, node.fingerprint)
    assert state["round"] == 6 and state["engine"]["w"] == pytest.approx(1.0)
    assert not (tmp_path / CONTROL_SOCKET_NAME).exists()  # removed on clean shutdown

    restarted = make_node(tmp_path, max_rounds=8)
    asyncio.run(restarted.run())
    assert restarted.progress.round == 8  # resumed at 6, not from scratch


def test_node_keeps_its_shard_not_the_whole_training_split(tmp_path: Path) -> None:
    """Memory: once the peer is built the daemon holds its own shard and the uint8 test split, not the dataset's
    whole training split (4x a peer's share in a 4-peer fleet)."""
    import gc
    import weakref

    splits = small_splits()
    full_train = weakref.ref(splits.train.images)
    spec = NodeSpec(listen="127.0.0.1:0", neighbors=(), state_dir=str(tmp_path), peer_id="solo", shard="0/4",
                    threads=1, insecure=True)
    node = Node(DaemonConfig(RUN, spec), splits=splits)
    del splits
    gc.collect()
    assert full_train() is None
    test_set = node.evaluator.test_set
    assert len(test_set) > 0 and test_set.batch_size == RUN.data.batch_size  # the training shapes


def test_each_evaluation_hands_freed_memory_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """tcmalloc keeps every transient's pages: the daemon releases them after each evaluation (every 2 rounds
    here), not only after its start-up stages."""
    import peer.daemon.node as node_module

    trims: list[int] = []
    node = make_node(tmp_path, max_rounds=6)
    monkeypatch.setattr(node_module, "trim_heap", lambda: trims.append(node.progress.round) or True)
    asyncio.run(node.run())
    assert trims[:3] == [2, 4, 6], trims


def test_metrics_exporter_serves_round_and_loss(tmp_path: Path) -> None:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    node = make_node(tmp_path, max_rounds=40, metrics_port=port)
    body = []

    async def main() -> None:
        task = asyncio.create_task(node.run())
        for _ in range(400):
            await asyncio.sleep(0.05)
            if node.progress.round >= 2:
                text = await asyncio.to_thread(
                    lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode())
                body.append(text)
                break
        node.request_stop("test")
        await task

    asyncio.run(main())
    assert body and "lpdl_round" in body[0] and "lpdl_train_loss" in body[0]
    value = [line for line in body[0].splitlines() if line.startswith("lpdl_round ")][0]
    assert float(value.split()[1]) >= 1
    assert "lpdl_gossip_paused 0.0" in body[0] and "lpdl_checkpoint_failures 0.0" in body[0]


@pytest.mark.parametrize("args,needle", [
    (["--shard", "5/4"], "node.shard"),
    (["--listen", "nohost"], "node.listen"),
    (["--neighbors", "auto,host-without-port"], "node.neighbors"),
    (["--compression", "1.5"], "gossip.compression"),
    (["--dataset", "cifar10", "--data-root", "/nonexistent/cifar", "--insecure"], "/nonexistent/cifar"),
    (["--secure"], "TLS directory"),  # secure by default: no certificate, no start
])
def test_start_refuses_bad_config_naming_the_cause(tmp_path: Path, args: list[str], needle: str) -> None:
    result = CliRunner().invoke(cli, ["start", "--state-dir", str(tmp_path), "--listen", "127.0.0.1:0", *args])
    assert result.exit_code != 0
    assert needle in result.output


def test_config_file_unknown_key_is_named(tmp_path: Path) -> None:
    cfg = tmp_path / "peer.toml"
    cfg.write_text("[node]\nlisten = '127.0.0.1:0'\nneighbours = 'auto'\n")
    result = CliRunner().invoke(cli, ["start", "--config", str(cfg)])
    assert result.exit_code != 0 and "neighbours" in result.output and "node" in result.output


def test_status_without_daemon_is_a_clear_error(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["status", "--state-dir", str(tmp_path)])
    assert result.exit_code != 0 and "control.sock" in result.output


def test_status_json_is_machine_readable(tmp_path: Path) -> None:
    node = make_node(tmp_path, max_rounds=200)
    out = []

    async def main() -> None:
        task = asyncio.create_task(node.run())
        for _ in range(400):
            await asyncio.sleep(0.05)
            if node.progress.round >= 1 and (tmp_path / CONTROL_SOCKET_NAME).exists():
                result = await asyncio.to_thread(CliRunner().invoke, cli, ["status", "--state-dir", str(tmp_path),
                                                                           "--json"])
                out.append(result)
                break
        node.request_stop("test")
        await task

    asyncio.run(main())
    assert out and out[0].exit_code == 0, out[0].output if out else "no status"
    assert json.loads(out[0].output)["peer_id"] == "solo"


def _pair_spec(state_dir: Path, peer_id: str, fleet: str, max_rounds: int = 0) -> NodeSpec:
    """A secured daemon: its certificate from the fleet CA beside the state directories, in STATE_DIR/tls."""
    ca_dir = state_dir.parent / "ca"
    if not ca_dir.exists():
        ca.init_ca(ca_dir, fleet)
    ca.issue(ca_dir, peer_id, state_dir / "tls")
    return NodeSpec(listen="127.0.0.1:0", neighbors=("auto",), mdns_ip=("127.0.0.1",), fleet=fleet,
                    state_dir=str(state_dir), peer_id=peer_id, max_rounds=max_rounds, eval_every=1000,
                    checkpoint_every=1000, join_wait_s=0.0, round_interval_s=0.05, threads=1)


async def _wait(predicate, timeout_s: float, what: str) -> None:
    for _ in range(int(timeout_s / 0.05)):
        if predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_departed_peer_is_forgotten_and_status_is_one_document(tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """Two daemons in one process find each other by mDNS on loopback and gossip; the Status RPC answers with the
    control socket's document. When one leaves for good (clean stop: mDNS goodbye), the other closes the edge and
    drops every state it kept for it - ledgers and both Choco replicas - so memory and checkpoints stay bounded."""
    import grpc

    from peer.net.proto.lpdl.v1 import peer_pb2 as pb
    from peer.net.proto.lpdl.v1 import peer_pb2_grpc

    fleet = f"forget-{tmp_path.name[-8:]}"
    splits = small_splits()
    a = Node(DaemonConfig(RUN, _pair_spec(tmp_path / "a", "peer-a", fleet)), splits=splits)
    b = Node(DaemonConfig(RUN, _pair_spec(tmp_path / "b", "peer-b", fleet)), splits=splits)

    async def main() -> None:
        ta, tb = asyncio.create_task(a.run()), asyncio.create_task(b.run())
        try:
            await _wait(lambda: "peer-b" in a.peer.engine.algorithm.peers() and a.server is not None
                        and a.server.counters.applied > 0, 60, "peer-a to gossip with peer-b")
            local = await read_control_socket(tmp_path / "a" / CONTROL_SOCKET_NAME)
            operator = TransportSecurity.for_holder(ca.issue(tmp_path / "ca", "ops", tmp_path / "ops",
                                                             role="operator").directory)
            async with operator.channel(f"127.0.0.1:{a.server.port}", []) as channel:
                remote = json.loads((await peer_pb2_grpc.PeerStub(channel).Status(pb.StatusRequest())).json)
            with pytest.raises(grpc.aio.AioRpcError):  # secured: no certificate, no status
                async with grpc.aio.insecure_channel(f"127.0.0.1:{a.server.port}") as channel:
                    await peer_pb2_grpc.PeerStub(channel).Status(pb.StatusRequest(), timeout=5)
            assert set(remote) == set(local) and remote["peer_id"] == local["peer_id"] == "peer-a"
            assert set(remote["neighbours"]) == set(local["neighbours"]) == {"peer-b"}
            assert (local["gossip"]["robust"], local["gossip"]["senders"], local["gossip"]["max_insiders"]) \
                == (True, 1, 0)
            b.request_stop("leaving for good")
            assert await tb == 0
            await _wait(lambda: "peer-b" not in a.peer.engine.known_peers(), 60, "peer-a to forget peer-b")
            assert "peer-b" not in a.status().neighbours
        finally:
            a.request_stop("test over")
            b.request_stop("test over")
            await asyncio.gather(ta, tb, return_exceptions=True)

    with caplog.at_level("INFO", logger="peer.daemon.node"):
        asyncio.run(main())
    reach = [r.getMessage() for r in caplog.records if "a period of the graph" in r.getMessage()]
    assert "peer peer-a hears 1 peer a period of the graph: no local rule can bound an insider that stays within " \
           "the honest spread (3 senders needed for one" in " ".join(reach)
    assert len([line for line in reach if line.startswith("peer peer-a ")]) == 1  # said once, not every round
    saved = load(tmp_path / "a" / CHECKPOINT_NAME, a.fingerprint)
    assert not saved["engine"]["algorithm_state"]["replicas_out"]
    assert not saved["engine"]["algorithm_state"]["replicas_in"]
    assert not saved["engine"]["in_edges"] and not saved["engine"]["out_edges"]


def _poison(node: Node, rounds: set[int] | None) -> None:
    """Make the daemon's model go NaN in the given rounds (every round when None)."""
    peer = node.peer
    real = peer.train_steps

    def train_steps(n: int) -> float:
        loss = real(n)
        if rounds is None or node.progress.round in rounds:
            with peer.lock:
                peer.engine.state.x.view(-1)[0] = float("nan")
        return loss

    peer.train_steps = train_steps


def test_daemon_recovers_from_a_diverged_round_through_the_runtime_round(tmp_path: Path) -> None:
    """The daemon has no recovery of its own: the round rolls back and halves what caused the divergence - here,
    a peer with no neighbour, its own training step: the learning rate, not gamma - status and metrics say so,
    training goes on, and the checkpoint keeps the halving."""
    node = make_node(tmp_path, max_rounds=8)
    _poison(node, {4})
    assert asyncio.run(node.run()) == 0
    assert node.progress.round == 8
    s = node.status()
    assert s.divergences == 1 and s.gamma_halvings == 0 and s.lr_halvings == 1
    gamma = 0.5 * 0.1 ** 0.5  # the default at 90%
    assert s.gossip.gamma == pytest.approx(gamma) and s.gossip.configured_gamma == pytest.approx(gamma)
    optim = node.run_spec.optim
    assert node.peer.lr() == pytest.approx(0.5 * lr_at(node.peer.epoch, optim.lr, optim.epochs, optim.warmup_epochs))
    assert "diverged  1 time(s)" in format_status(s) and "the learning rate 1 time(s)" in format_status(s)
    node.metrics.update(s)
    assert node.metrics.registry.get_sample_value("lpdl_divergence_recoveries_total") == 1
    assert node.metrics.registry.get_sample_value("lpdl_gossip_gamma") == pytest.approx(gamma)
    assert node.metrics.registry.get_sample_value("lpdl_learning_rate") == pytest.approx(s.lr)
    saved = load(tmp_path / CHECKPOINT_NAME, node.fingerprint)
    assert saved["recovery"] == {"halvings": 0, "lr_halvings": 1, "recoveries": 1}
    assert bool(torch.isfinite(saved["engine"]["x"]).all())


def test_daemon_that_keeps_diverging_stops_with_an_error_and_a_finite_checkpoint(tmp_path: Path,
                                                                               caplog) -> None:
    node = make_node(tmp_path, max_rounds=50)
    _poison(node, None)
    assert asyncio.run(node.run()) == 1
    assert node.progress.round == 4  # 4 recoveries (the default bound), the 5th divergence stops it
    assert "diverged in round 4" in caplog.text and "--lr" in caplog.text
    saved = load(tmp_path / CHECKPOINT_NAME, node.fingerprint)
    assert bool(torch.isfinite(saved["engine"]["x"]).all())


def test_a_stopping_peer_refuses_updates_and_their_sender_retracts_them(tmp_path: Path) -> None:
    """From its last round on a daemon takes in no mass, since it sends none back (a SIGTERM'd daemon on a fast CPU
    otherwise drew all of a 3-peer fleet's weight in its settling second): an update is refused as not_ready and
    changes nothing; the sender's next handshake retracts it, so the sender keeps its mass."""
    from peer.gossip.engine import GossipInputError

    receiver = make_node(tmp_path / "a", 1)
    spec = NodeSpec(listen="127.0.0.1:0", neighbors=(), state_dir=str(tmp_path / "b"), peer_id="sender",
                    max_rounds=1, threads=1, insecure=True)
    sender = Node(DaemonConfig(RUN, spec), splits=small_splits())
    message, = sender.peer.send(["solo"], ["solo"], 0)
    assert sender.peer.engine.w < 1.0
    receiver.gate.accepting = True
    receiver.gate.stopping = True
    x_before, w_before = receiver.peer.engine.x.clone(), receiver.peer.engine.w
    with pytest.raises(GossipInputError) as refused:
        receiver.gate.receive("sender", message.seq, message.weight, message.scale, message.payload)
    assert refused.value.reason == "not_ready"
    assert receiver.peer.engine.w == w_before and torch.equal(receiver.peer.engine.x, x_before)
    assert receiver.gate.refusals_unsettled() == 1, "the drain on shutdown waits for this sender's handshake"
    hello = sender.peer.hello_for("solo")
    settlement = sender.peer.on_hello_reply("solo", hello, receiver.gate.answer_hello("sender", hello))
    assert [seq for seq, _ in settlement.retracted] == [message.seq] and not settlement.delivered
    assert sender.peer.engine.w == 1.0 and receiver.gate.refusals_unsettled() == 0
