"""Push-sum mass conservation and convergence under faults, for all three algorithms (hypothesis properties).

With lr = 0 the only thing that moves mass is gossip, so sum x + in-flight and sum w + in-flight must stay constant
whatever the drops, delays, churn and topology, and every z_i must converge to sum x / sum w.
"""

import math
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from peer.gossip.engine import GossipInputError
from peer.gossip.ledger import SEQ_WINDOW, Hello, HelloReply
from peer.gossip.topology import Topology
from peer.net.config import NetConfig
from peer.sim.transport import ChaosSpec, InMemoryTransport
from tests.gossip_helpers import LAYOUT, endpoints, make_engines, totals

ALGOS = [("sgp", 0.0, 32, 1.0), ("deepsqueeze", 0.9, 8, 0.5), ("choco", 0.9, 8, 0.5), ("choco", 0.0, 8, 1.0)]
#: (algorithm, compression, bits, gamma, rounds, tolerance as a fraction of the starting spread). Compressed gossip
#: needs a small gamma and many rounds; Deep-Squeeze keeps a residual error (its feedback is on the model itself).
CONVERGENCE = [("sgp", 0.0, 32, 1.0, 60, 0.02), ("choco", 0.0, 8, 1.0, 60, 0.02),
               ("choco", 0.5, 8, 0.05, 800, 0.1), ("deepsqueeze", 0.5, 8, 0.05, 800, 0.1)]


def run_rounds(engines, transport, topology, rounds, start=0):
    for t in range(start, start + rounds):
        transport.begin_round(t)
        online = transport.online(t)
        for peer in online:
            out = topology.out_neighbours(online, peer, t)
            transport.submit(engines[peer].send_round(out, t, transport.ready(peer, out)))
        transport.deliver(t)
    return start + rounds


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(algo=st.sampled_from(ALGOS), n=st.integers(2, 6), drop=st.floats(0.0, 0.5), delay=st.integers(0, 2),
       churn=st.floats(0.0, 0.3), kind=st.sampled_from(["ring", "exponential", "random", "undirected-ring"]),
       rotating=st.booleans(), seed=st.integers(0, 10_000), window=st.integers(1, 4))
def test_mass_conserved_under_drops_delay_churn(algo, n, drop, delay, churn, kind, rotating, seed, window):
    name, compression, bits, gamma = algo
    engines = make_engines(n, name, compression, bits, gamma, seed, window=window)
    mass0, weight0 = totals(engines)
    transport = InMemoryTransport(endpoints(engines), ChaosSpec(drop=drop, delay=delay, churn=churn), seed=seed)
    t = run_rounds(engines, transport, Topology(kind, rotating, k=2, seed=seed), 12)
    mass, weight = totals(engines)
    assert math.isclose(weight, weight0, rel_tol=1e-9)
    assert torch.allclose(mass, mass0, atol=1e-4 * n)
    transport.flush()  # settle everything: nothing left in flight
    assert all(e.in_flight()[1] == 0.0 for e in engines.values())
    mass, weight = totals(engines)
    assert math.isclose(weight, weight0, rel_tol=1e-9) and torch.allclose(mass, mass0, atol=1e-4 * n)


@pytest.mark.parametrize("name,compression,bits,gamma,rounds,tolerance", CONVERGENCE)
def test_debiased_models_converge_to_network_average(name, compression, bits, gamma, rounds, tolerance):
    engines = make_engines(5, name, compression, bits, gamma, seed=1)
    mass0, weight0 = totals(engines)
    target = (mass0 / weight0).float()
    transport = InMemoryTransport(endpoints(engines), ChaosSpec(drop=0.2), seed=3)
    topology = Topology("exponential", rotating=True)
    run_rounds(engines, transport, topology, rounds)
    transport.flush()
    spread0 = max(float((make_engines(5, name, seed=1)[p].x - target).norm()) for p in engines)
    for e in engines.values():
        err = float((e.state.debiased() - target).norm())
        assert err < tolerance * spread0, f"{e.peer_id} still {err:.4f} away (start {spread0:.3f})"


@given(drop=st.floats(0.0, 0.6), seed=st.integers(0, 1000), window=st.integers(1, 4))
@settings(max_examples=15, deadline=None)
def test_choco_replicas_identical_at_both_ends(drop, seed, window):
    engines = make_engines(4, "choco", 0.8, 8, 0.5, seed, window=window)
    transport = InMemoryTransport(endpoints(engines), ChaosSpec(drop=drop, delay=1), seed=seed)
    run_rounds(engines, transport, Topology("random", rotating=True, k=2, seed=seed), 10)
    transport.flush()
    for sender, e in engines.items():
        for receiver in e.out_edges:
            assert torch.equal(e.algorithm.replica_out(receiver), engines[receiver].algorithm.replica_in(sender))


@pytest.mark.parametrize("name", ["sgp", "deepsqueeze", "choco"])
def test_hostile_messages_refused_without_state_change(name):
    engines = make_engines(2, name, 0.0 if name == "sgp" else 0.9, 8)
    a, b = engines["p0"], engines["p1"]
    good = a.send_round(["p1"], 0)[0]
    before = (b.x.clone(), b.w, dict(b.in_edges))
    bad_inputs = [
        dict(payload=b"garbage"), dict(payload=good.payload[:-3]), dict(weight=float("nan")),
        dict(weight=-1.0), dict(scale=float("inf")), dict(scale=2.0), dict(seq=0),
        dict(weight=1000.0), dict(weight=1e308), dict(weight=good.scale * 65),  # a sender weight no fleet holds
        dict(seq=good.seq + SEQ_WINDOW + 1),  # would push the edge's numbers towards MAX_SEQ
    ]
    replicas = {k: v.clone() for k, v in getattr(b.algorithm, "replicas_in", {}).items()}
    for override in bad_inputs:
        kwargs = dict(seq=good.seq, weight=good.weight, scale=good.scale, payload=good.payload) | override
        with pytest.raises(GossipInputError):
            b.receive("p0", **kwargs)
        assert torch.equal(b.x, before[0]) and b.w == before[1] and b.in_edges == before[2]
        assert all(torch.equal(v, replicas[k]) for k, v in getattr(b.algorithm, "replicas_in", {}).items())
    assert b.receive("p0", good.seq, good.weight, good.scale, good.payload)
    assert not b.receive("p0", good.seq, good.weight, good.scale, good.payload)  # replay dropped


def test_nan_payload_values_refused():
    engines = make_engines(2, "sgp", 0.0, 32)
    a, b = engines["p0"], engines["p1"]
    first = struct.pack("<f", float(a.x[0]))  # raw fp32 payload carries x as it was before sending
    msg = a.send_round(["p1"], 0)[0]
    assert first in msg.payload
    hostile = msg.payload.replace(first, struct.pack("<f", float("nan")), 1)
    x_before = b.x.clone()
    with pytest.raises(GossipInputError):
        b.receive("p0", msg.seq, msg.weight, msg.scale, hostile)
    assert torch.equal(b.x, x_before) and b.w == 1.0


def test_payload_for_another_model_refused():
    from peer.compress.codec import CodecConfig, encode
    from peer.compress.layout import Layout
    other = Layout.from_named_shapes([("w", (LAYOUT.numel,))])
    payload, _ = encode(torch.ones(LAYOUT.numel), other, CodecConfig())
    b = make_engines(2, "sgp")["p1"]
    with pytest.raises(GossipInputError, match="payload"):
        b.receive("p0", 1, 0.5, 0.5, payload)


def test_engine_checkpoint_roundtrip_keeps_in_flight_mass():
    engines = make_engines(2, "choco", 0.9, 8)
    a = engines["p0"]
    a.send_round(["p1"], 0)
    restored = make_engines(2, "choco", 0.9, 8, seed=99)["p0"]
    restored.load_state_dict(a.state_dict())
    assert torch.equal(restored.in_flight()[0], a.in_flight()[0]) and restored.w == a.w


def test_choco_retraction_restores_replica_exactly_without_edge_reset():
    engines = make_engines(2, "choco", 0.9, 8, 0.5)
    a, b = engines["p0"], engines["p1"]
    for t in range(3):  # build up non-trivial replicas
        for msg in a.send_round(["p1"], t):
            b.receive("p0", msg.seq, msg.weight, msg.scale, msg.payload)
            a.on_ack("p1", msg.seq)
    a.send_round(["p1"], 3)  # lost on the wire
    hello = a.hello_for("p1")
    reply = b.answer_hello("p0", hello)
    assert not reply.reset
    a.on_hello_reply("p1", hello, reply)
    assert torch.equal(a.algorithm.replica_out("p1"), b.algorithm.replica_in("p0"))


def test_choco_delivered_message_with_lost_ack_keeps_edge():
    engines = make_engines(2, "choco", 0.9, 8, 0.5)
    a, b = engines["p0"], engines["p1"]
    msg = a.send_round(["p1"], 0)[0]
    b.receive("p0", msg.seq, msg.weight, msg.scale, msg.payload)  # applied; ack lost
    hello = a.hello_for("p1")
    reply = b.answer_hello("p0", hello)
    assert not reply.reset
    assert [seq for seq, _ in a.on_hello_reply("p1", hello, reply).delivered] == [msg.seq]
    assert torch.equal(a.algorithm.replica_out("p1"), b.algorithm.replica_in("p0"))


def test_choco_replicas_start_from_the_common_model_and_stay_consistent():
    from peer.compress.codec import CodecConfig
    from peer.gossip.engine import GossipEngine
    z0 = torch.randn(LAYOUT.numel, generator=torch.Generator().manual_seed(5))
    codec = CodecConfig(compression=0.9, bits=8)
    engines = {p: GossipEngine(p, LAYOUT, z0 + 0.01 * torch.randn(LAYOUT.numel), "choco", codec, gamma=0.2,
                               replica_init=z0) for p in ("p0", "p1")}
    a, b = engines["p0"], engines["p1"]
    msg = a.send_round(["p1"], 0)[0]
    assert len(msg.payload) < LAYOUT.numel // 2, "first message was dense although both ends share z0"
    assert b.receive("p0", msg.seq, msg.weight, msg.scale, msg.payload)
    assert torch.equal(a.algorithm.replica_out("p1"), b.algorithm.replica_in("p0"))
    assert not b.answer_hello("p0", a.hello_for("p1")).reset


@pytest.mark.parametrize("name", ["sgp", "deepsqueeze", "choco"])
def test_messages_received_while_encoding_keep_mass_exact(name):
    """The daemon encodes outside its lock: a message applied between plan and commit must not break the books."""
    engines = make_engines(3, name, 0.0 if name == "sgp" else 0.9, 8, window=2)
    a, b, c = engines["p0"], engines["p1"], engines["p2"]
    mass0, weight0 = totals(engines)
    plan = a.plan_round(["p1"], 0)
    incoming = c.send_round(["p0"], 0)[0]
    assert a.receive("p2", incoming.seq, incoming.weight, incoming.scale, incoming.payload)
    for msg in a.commit_round(a.encode_round(plan)):
        assert b.receive("p0", msg.seq, msg.weight, msg.scale, msg.payload)
        a.on_ack("p1", msg.seq)
    c.on_ack("p0", incoming.seq)
    mass, weight = totals(engines)
    assert math.isclose(weight, weight0, rel_tol=1e-12) and torch.allclose(mass, mass0, atol=1e-4)


def test_choco_edge_reset_while_encoding_drops_that_edges_message():
    """A handshake that resets (or retracts on) an edge between plan and commit makes the encoded payload stale
    for that edge's replica: it is dropped (the sender keeps its share), never sent against the wrong replica."""
    engines = make_engines(2, "choco", 0.9, 8, window=2)
    a, b = engines["p0"], engines["p1"]
    w0 = a.w
    plan = a.plan_round(["p1"], 0)
    hello = a.hello_for("p1")
    a.on_hello_reply("p1", hello, HelloReply(last_applied=0, fence=0, reset=True))
    assert a.commit_round(a.encode_round(plan)) == []
    assert a.w == w0 and a.has_room("p1")


def test_forget_peer_waits_for_in_flight_then_drops_all_its_state():
    engines = make_engines(3, "choco", 0.9, 8, window=2)
    a, b = engines["p0"], engines["p1"]
    msg = a.send_round(["p1"], 0)[0]
    back = b.send_round(["p0"], 0)[0]
    a.receive("p1", back.seq, back.weight, back.scale, back.payload)
    size_with = len(a.state_dict()["algorithm_state"]["replicas_out"]) + len(a.state_dict()["algorithm_state"]["replicas_in"])
    assert not a.forget_peer("p1"), "forgot a peer with a message in flight to it"
    b.receive("p0", msg.seq, msg.weight, msg.scale, msg.payload)
    a.on_ack("p1", msg.seq)
    assert a.forget_peer("p1")
    assert "p1" not in a.known_peers()
    state = a.state_dict()
    assert size_with == 2 and not state["algorithm_state"]["replicas_out"] and not state["algorithm_state"]["replicas_in"]
    assert "p1" not in state["out_edges"] and "p1" not in state["in_edges"]
    assert set(state["departed_in_edges"]) == {"p1"}  # two ints kept, for a handshake if it returns


@pytest.mark.parametrize(("algo", "compression", "bits", "gamma"), [a for a in ALGOS if a[0] != "deepsqueeze"])
def test_a_sender_that_returns_after_being_forgotten_keeps_its_applied_messages(algo, compression, bits, gamma):
    """The receiver forgets a departed sender while the sender still waits for an Ack of a message the receiver
    applied (Acks are paced to the receiver's round; the stream broke). When the sender returns, its handshake must
    judge that message delivered - retracting it would count its mass twice."""
    engines = make_engines(2, algo, compression, bits, gamma=gamma, window=2)
    a, b = engines["p0"], engines["p1"]
    mass0, weight0 = totals(engines)
    for msg in a.send_round(["p1"], 0):
        assert b.receive("p0", msg.seq, msg.weight, msg.scale, msg.payload)  # applied; its Ack never arrives
    assert b.forget_peer("p0") and "p0" not in b.known_peers()
    hello = a.hello_for("p1")
    settled = a.on_hello_reply("p1", hello, b.answer_hello("p0", hello))
    assert [seq for seq, _ in settled.delivered] == [1] and not settled.retracted
    mass, weight = totals(engines)
    assert torch.allclose(mass, mass0, atol=1e-5) and weight == pytest.approx(weight0)
    assert "p0" in b.state_dict()["in_edges"] and not b.departed_in  # the ledger is live again
    for msg in a.send_round(["p1"], 1):  # and the edge keeps working (Choco: after a consistent reset)
        assert b.receive("p0", msg.seq, msg.weight, msg.scale, msg.payload)
    if algo == "choco":
        assert torch.equal(a.algorithm.replica_out("p1"), b.algorithm.replica_in("p0"))


def test_forgotten_senders_ledgers_survive_a_checkpoint_and_stay_bounded(monkeypatch):
    import peer.gossip.engine as engine_module

    monkeypatch.setattr(engine_module, "MAX_DEPARTED", 2)
    engines = make_engines(4, "sgp", 0.0, 32)
    hub = engines["p0"]
    for sender in ("p1", "p2", "p3"):
        msg = engines[sender].send_round(["p0"], 0)[0]
        hub.receive(sender, msg.seq, msg.weight, msg.scale, msg.payload)
        assert hub.forget_peer(sender)
    assert list(hub.departed_in) == ["p2", "p3"]  # the oldest went first
    restored = make_engines(4, "sgp", 0.0, 32)["p0"]
    restored.load_state_dict(hub.state_dict())
    assert {k: (e.last_applied, e.fence) for k, e in restored.departed_in.items()} == {"p2": (1, 0), "p3": (1, 0)}


def test_window_lets_several_messages_fly_and_retracts_them_exactly():
    engines = make_engines(2, "choco", 0.9, 8, window=3)
    a, b = engines["p0"], engines["p1"]
    mass0, weight0 = totals(engines)
    sent = [m for t in range(4) for m in a.send_round(["p1"], t)]
    assert [m.seq for m in sent] == [1, 2, 3], "window 3 must allow exactly three messages in flight"
    assert b.receive("p0", sent[0].seq, sent[0].weight, sent[0].scale, sent[0].payload)
    hello = a.hello_for("p1")
    settled = a.on_hello_reply("p1", hello, b.answer_hello("p0", hello))
    assert [s for s, _ in settled.delivered] == [1] and [s for s, _ in settled.retracted] == [3, 2]
    assert torch.equal(a.algorithm.replica_out("p1"), b.algorithm.replica_in("p0"))
    mass, weight = totals(engines)
    assert math.isclose(weight, weight0, rel_tol=1e-12) and torch.allclose(mass, mass0, atol=1e-4)


def test_in_flight_payload_bytes_cap_the_window_but_one_update_always_goes():
    """A byte budget below two payloads lets two dense updates fly per edge (the second starts under it) even with a
    window of 8; an Ack frees the room; a budget of one byte still lets one go; without it the count bounds."""
    capped = make_engines(2, "sgp", 0.0, 32, window=8)
    a, b = capped["p0"], capped["p1"]
    probe = make_engines(2, "sgp", 0.0, 32, window=8)["p0"].send_round(["p1"], 0)[0]
    a.max_in_flight_bytes = int(1.5 * len(probe.payload))
    first = [m for t in range(3) for m in a.send_round(["p1"], t)]
    assert [m.seq for m in first] == [1, 2], "one under the budget, the second crosses it, then the edge is full"
    assert not a.has_room("p1")
    assert sum(s.payload_bytes for s in a.out_edges["p1"].in_flight.values()) == sum(len(m.payload) for m in first)
    for m in first:
        assert b.receive("p0", m.seq, m.weight, m.scale, m.payload)
    a.on_ack("p1", first[-1].seq)
    assert a.has_room("p1") and [m.seq for m in a.send_round(["p1"], 3)] == [3]
    tiny = make_engines(2, "sgp", 0.0, 32, window=8)["p0"]
    tiny.max_in_flight_bytes = 1
    assert [m.seq for t in range(3) for m in tiny.send_round(["p1"], t)] == [1]
    uncapped = make_engines(2, "sgp", 0.0, 32, window=8)["p0"]
    assert [m.seq for t in range(10) for m in uncapped.send_round(["p1"], t)] == list(range(1, 9))


def test_state_for_new_peers_is_capped():
    """A flood of new ids gets edge state for at most max_peers of them; known peers are still answered."""
    engine = make_engines(1, "choco", 0.9, 8, max_peers=3)["p0"]
    for i in range(3):
        engine.answer_hello(f"ghost-{i}", Hello(next_seq=1))
    with pytest.raises(GossipInputError) as refused:
        engine.answer_hello("ghost-3", Hello(next_seq=1))
    assert refused.value.reason == "peer_limit" and engine.known_peers() == {"ghost-0", "ghost-1", "ghost-2"}
    engine.answer_hello("ghost-0", Hello(next_seq=1))  # a known peer reconnects


def test_the_in_memory_transport_runs_the_daemons_stream_protocol():
    """Lossy, delayed rounds with every update cut in 64-byte chunks: the receivers' stream state
    (peer/net/inbound.py) reassembles and applies the updates, a break leaves the receiver's stale half of the
    stream until the reconnect's Hello supersedes it (no partial update stays buffered), and mass is conserved."""
    engines = make_engines(3, "choco", 0.8, 8, 0.5, seed=5, window=4)
    mass0, weight0 = totals(engines)
    config = NetConfig(chunk_bytes=64, batch_bytes=4096)
    transport = InMemoryTransport(endpoints(engines), ChaosSpec(drop=0.2, delay=1), seed=5, config=config)
    run_rounds(engines, transport, Topology("ring", rotating=False), 30)
    transport.flush()
    tables = transport.inbound.values()
    assert sum(t.counters.applied for t in tables) > 0
    assert sum(t.counters.refused["superseded"] for t in tables) > 0, "drops should have broken some streams"
    assert all(t.buffered.used == 0 for t in tables)
    mass, weight = totals(engines)
    assert math.isclose(weight, weight0, rel_tol=1e-9) and torch.allclose(mass, mass0, atol=1e-4 * 3)


def test_a_peer_whose_in_neighbours_are_silent_stops_giving_its_weight_away():
    """Directed ring p0 -> p1 -> p2 -> p0 with p1 silent (restarting): p2 hears from nobody, and handing on a share
    every round took its weight to 3e-23 in 75 rounds on a fast CPU - under MIN_WEIGHT, where z = x / w is clamped
    to nonsense and its sent weights underflow float32 to 0 (its neighbours then quarantined it). Below
    MIN_SEND_WEIGHT it keeps all it has: its model stays exact and mass is conserved; once weight comes back it sends
    again."""
    from peer.gossip.pushsum import MIN_SEND_WEIGHT, MIN_WEIGHT

    engines = make_engines(3, "sgp", gamma=1.0, window=4)
    p0, p1, p2 = engines["p0"], engines["p1"], engines["p2"]
    z2 = p2.state.debiased().clone()
    mass0, weight0 = totals(engines)
    for t in range(100):
        for m in p2.send_round(["p0"], t):
            assert p0.receive("p2", m.seq, m.weight, m.scale, m.payload)
            p2.on_ack("p0", m.seq)
        p0.send_round(["p1"], t)  # p1 is down: in flight until the window is full, then p0 keeps the share
    assert MIN_SEND_WEIGHT / 2 <= p2.w < MIN_SEND_WEIGHT and p2.w > MIN_WEIGHT
    assert torch.allclose(p2.state.debiased(), z2, rtol=1e-5, atol=1e-7), "the drained peer's model is still its own"
    assert p2.send_round(["p0"], 100) == []
    mass, weight = totals(engines)
    assert math.isclose(weight, weight0, rel_tol=1e-12) and torch.allclose(mass, mass0, atol=1e-4)
    for m in p1.send_round(["p2"], 101):  # p1 is back
        assert p2.receive("p1", m.seq, m.weight, m.scale, m.payload)
    assert p2.w > 0.1 and p2.send_round(["p0"], 102)
