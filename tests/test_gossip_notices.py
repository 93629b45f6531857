"""Quarantine notices (peer/gossip/notices.py): a peer that sends to an insider but never hears from it learns of
the insider's quarantine from the peers that do, and every honest peer drops the insider from the schedule at one
round - the book's rules, the frame through the pure stream classes, and the simulator's rotating exponential graph,
where the one-way senders otherwise keep giving the quarantined insider their share and skipped edges leave honest
peers rounds without mixing."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence

import pytest

from peer.config import DataSpec, GossipSpec, ModelSpec, OptimSpec, RunSpec
from peer.data import DatasetSplits, load_dataset
from peer.gossip.engine import OutMessage
from peer.gossip.notices import NOTICE_ENDED, NOTICED, NoticeBook, notice_targets
from peer.gossip.robust import RobustConfig
from peer.gossip.topology import Topology
from peer.net.config import NetConfig
from peer.net.inbound import MAX_NOTICE_ID_BYTES, InboundStream, InboundStreams
from peer.net.outbound import OutboundStream
from peer.net.proto.lpdl.v1 import peer_pb2 as pb
from peer.net.wire import notice_frame
from peer.runtime.round import send_notice_if_due
from peer.sim.attacks import Attack
from peer.sim.simulation import Simulation
from tests.test_net_support import RecordingGate, make_gate, totals

IDS = [f"peer-{i:03d}" for i in range(8)]
EXP = Topology("exponential", rotating=True)


def sends_to(peer: str) -> set[str]:
    """Whom ``peer`` sends to over one period of the rotating exponential graph of 8 peers (i+1, i+2, i+4)."""
    return EXP.reaches(IDS, peer, 0)


# --- the book ----------------------------------------------------------------------------------------------------
def test_a_notice_goes_to_every_live_peer_but_the_suspects() -> None:
    """Every peer computes the exclusion from the same notices, so a quarantiner (005) tells every live peer - not
    only the ones that send to peer-003 - and never the suspect itself."""
    assert sends_to("peer-003") == {"peer-004", "peer-005", "peer-007"}
    assert notice_targets({"peer-003"}, IDS, "peer-005") == set(IDS) - {"peer-003", "peer-005"}
    assert notice_targets(set(), IDS, "peer-005") == set()
    assert notice_targets({"peer-099"}, IDS, "peer-005") == set()  # not live: nobody to tell


def test_every_peer_the_suspect_sends_to_must_name_it_and_nothing_less_does() -> None:
    """Every peer the suspect sends to must have named it, and at least a quorum: two of peer-003's three
    receivers are not enough (the third, an honest one that sees nothing wrong, vetoes - so two slanderers that
    both hear from an honest peer cannot cut it off), nor is a notifier it never sends to. A notice counts from the
    round after it arrived."""
    book = NoticeBook()
    book.note("peer-005", ["peer-003"], 4)
    assert book.exclude("peer-001", 5, 2, 12, IDS, sends_to) == set()  # one notifier: under the quorum
    book.note("peer-006", ["peer-003"], 4)  # 003 never sends to 006: it cannot know
    assert book.exclude("peer-001", 5, 2, 12, IDS, sends_to) == set()
    book.note("peer-007", ["peer-003"], 5)
    assert book.exclude("peer-001", 6, 2, 12, IDS, sends_to) == set()  # 004 has not named it: a veto
    book.note("peer-004", ["peer-003"], 6)
    assert book.exclude("peer-001", 6, 2, 12, IDS, sends_to) == set()  # arrived this round: counts from the next
    assert book.exclude("peer-001", 7, 2, 12, [p for p in IDS if p != "peer-003"], sends_to) == set()  # not live
    assert book.exclude("peer-001", 7, 2, 12, IDS, sends_to) == {"peer-003"}
    assert book.events == [dataclasses.replace(book.events[0], kind=NOTICED, round=7,
                                               notifiers=("peer-004", "peer-005", "peer-007"))]
    assert book.snapshot("peer-001", 7, 12)["peer-003"] == {
        "named_by": ["peer-004", "peer-005", "peer-006", "peer-007"], "left_out_since": 7}


def test_with_the_default_quorum_of_one_a_directed_rings_suspect_is_excluded_on_its_one_receivers_notice() -> None:
    """On a static directed ring (peer-003 sends to peer-004 only) its one receiver is every receiver: at the
    default quorum (1) that one's notice excludes it; at a quorum of 2 nothing could, and its sender fed it for good
    (the README fleet's graph). A notifier it does not send to is still no witness, and on the exponential graph
    every one of its three receivers must still name it."""
    ring = Topology("ring")

    def ring_sends_to(peer: str) -> set[str]:
        return ring.reaches(IDS, peer, 0)

    assert ring_sends_to("peer-003") == {"peer-004"} and RobustConfig().notice_quorum == 1
    book = NoticeBook()
    book.note("peer-005", ["peer-003"], 4)
    assert book.exclude("peer-001", 5, 1, 12, IDS, ring_sends_to) == set()
    book.note("peer-004", ["peer-003"], 4)
    assert book.exclude("peer-001", 5, 2, 12, IDS, ring_sends_to) == set(), "a quorum of 2: never on this ring"
    assert book.exclude("peer-001", 5, 1, 12, IDS, ring_sends_to) == {"peer-003"}
    assert book.exclude("peer-001", 5, 1, 12, IDS, sends_to) == set(), "exponential graph: 004 and 005 of 3"


def test_a_receivers_own_notice_counts_and_without_it_it_vetoes() -> None:
    """peer-004 hears from peer-003: its own notice is one of the three the exclusion needs - from the round after
    it went out, as its notice reaches the others - and without one nobody excludes 003, this peer included."""
    book = NoticeBook()
    book.note("peer-005", ["peer-003"], 0)
    book.note("peer-007", ["peer-003"], 0)
    assert book.exclude("peer-004", 1, 2, 12, IDS, sends_to) == set()
    book.sent({"peer-003"}, 1)
    assert book.exclude("peer-004", 1, 2, 12, IDS, sends_to) == set()
    assert book.exclude("peer-004", 2, 2, 12, IDS, sends_to) == {"peer-003"}
    assert book.snapshot("peer-004", 2, 12)["peer-003"]["named_by"] == ["peer-004", "peer-005", "peer-007"]
    assert book.exclude("peer-004", 3, 4, 12, IDS, sends_to) == set()  # 3 < quorum 4


def test_a_suspect_excluded_is_no_witness_against_another_and_no_veto_for_it() -> None:
    """peer-005 excluded: its notice naming peer-004 does not count, and as one of 004's receivers it is not
    waited for either - 004 is excluded once its other receivers, 006 and 000, both named it."""
    book = NoticeBook()
    assert sends_to("peer-005") == {"peer-006", "peer-007", "peer-001"}
    assert sends_to("peer-004") == {"peer-005", "peer-006", "peer-000"}
    for notifier in ("peer-006", "peer-007", "peer-001"):
        book.note(notifier, ["peer-005"], 0)
    book.note("peer-005", ["peer-004"], 0)
    book.note("peer-000", ["peer-004"], 0)
    assert book.exclude("peer-002", 1, 2, 12, IDS, sends_to) == {"peer-005"}
    assert book.exclude("peer-002", 2, 2, 12, IDS, sends_to) == {"peer-005"}  # 000 alone names 004
    book.note("peer-006", ["peer-005", "peer-004"], 2)
    assert book.exclude("peer-002", 3, 2, 12, IDS, sends_to) == {"peer-005", "peer-004"}


def test_a_suspect_never_excludes_itself() -> None:
    book = NoticeBook()
    for notifier in ("peer-004", "peer-005", "peer-007"):
        book.note(notifier, ["peer-003"], 0)
    assert book.exclude("peer-003", 1, 2, 12, IDS, sends_to) == set()
    assert book.exclude("peer-002", 1, 2, 12, IDS, sends_to) == {"peer-003"}


def test_notices_expire_and_a_withdrawal_takes_the_suspect_back() -> None:
    book = NoticeBook()
    receivers = ("peer-004", "peer-005", "peer-007")
    for notifier in receivers:
        book.note(notifier, ["peer-003"], 0)
    assert book.exclude("peer-001", 12, 2, 12, IDS, sends_to) == {"peer-003"}
    assert book.exclude("peer-001", 13, 2, 12, IDS, sends_to) == set()  # older than the ttl
    assert [e.kind for e in book.events] == [NOTICED, NOTICE_ENDED]
    for notifier in receivers:
        book.note(notifier, ["peer-003"], 14)
    assert book.exclude("peer-001", 15, 2, 12, IDS, sends_to) == {"peer-003"}
    book.note("peer-007", [], 15)  # released there: its notice names nobody now
    assert book.exclude("peer-001", 16, 2, 12, IDS, sends_to) == set()
    for notifier in receivers:
        book.forget(notifier)
    assert book.received == {}


def test_the_book_keeps_at_most_max_notifiers_and_ignores_a_notifier_naming_itself() -> None:
    book = NoticeBook(max_notifiers=2)
    book.note("a", ["x"], 0)
    book.note("b", ["x"], 1)
    book.note("c", ["x"], 2)  # full: the notifier heard from longest ago makes room
    assert set(book.received) == {"b", "c"}
    book.note("b", ["y"], 3)  # a known notifier replaces its notice (the one before counts in this round)
    book.note("c", ["c"], 3)  # names only itself: a withdrawal
    book.note("d", [], 3)  # an unknown notifier withdraws: nothing kept
    assert book.received == {"b": (3, frozenset({"y"})), "c": (3, frozenset())}
    assert book.named("z", 3, 12) == {"x": {"b", "c"}}
    assert book.named("z", 4, 12) == {"y": {"b"}}
    book.forget("b")
    assert "b" not in book.received and "b" not in book.earlier


def test_the_guard_ignores_notices_with_the_rule_off_and_from_a_peer_it_quarantined() -> None:
    from peer.gossip.robust import ReceiveGuard

    off = ReceiveGuard(RobustConfig(enabled=False))
    off.note_notice("peer-005", ["peer-003"])
    assert off.notices.received == {} and not off.notice_due(0)
    guard = ReceiveGuard()
    guard.quarantine("peer-005", "test")
    guard.note_notice("peer-005", ["peer-003"])
    guard.note_notice("peer-007", ["peer-003"])
    assert set(guard.notices.received) == {"peer-007"}


def test_a_notice_goes_at_once_on_a_change_then_every_few_rounds() -> None:
    book = NoticeBook()
    assert not book.due(set(), 0, 3)
    assert book.due({"peer-003"}, 4, 3)
    book.sent({"peer-003"}, 4)
    assert not book.due({"peer-003"}, 6, 3) and book.due({"peer-003"}, 7, 3)
    assert book.due(set(), 5, 3)  # released: the withdrawal goes out at once
    book.sent(set(), 5)
    assert not book.due(set(), 50, 3)


@pytest.mark.parametrize("quorum,every,ttl", [(0, 3, 12), (2, 0, 12), (2, 13, 12)])
def test_notice_settings_out_of_range_are_refused(quorum: int, every: int, ttl: int) -> None:
    with pytest.raises(ValueError, match="notice"):
        RobustConfig(notice_quorum=quorum, notice_every=every, notice_ttl=ttl)


# --- the frame -----------------------------------------------------------------------------------------------------
def open_stream(sender: str = "peer-a") -> tuple[RecordingGate, RecordingGate, OutboundStream, InboundStreams,
                                                InboundStream]:
    """A handshaken stream from ``sender`` (robust rule on) to peer-b through the pure classes."""
    a, b = make_gate(sender, seed=1), make_gate("peer-b", seed=2)
    b.engine.guard.config = RobustConfig()
    config = NetConfig(max_peers=4)
    out, table = OutboundStream(a, "peer-b", config), InboundStreams(b, config)
    stream = table.open("wire", caller=sender)
    received = stream.on_frame(out.hello(), 0.0)
    assert received.reply is not None
    out.on_reply(pb.GossipReply.FromString(received.reply.SerializeToString()), 0.0)
    return a, b, out, table, stream


def test_a_notice_frame_reaches_the_receivers_book_and_changes_no_mass() -> None:
    a, b, out, table, stream = open_stream()
    before = totals([a, b])
    out.notify(["peer-x", "peer-y"])
    out.notify(["peer-x"])  # only the newest notice is kept: each names every peer
    frames = list(out.frames(lambda: 0.0))
    assert len(frames) == 1
    received = stream.on_frame(frames[0], 0.0)
    assert received.refusal is None and received.reply is None and received.ack is None
    assert b.notices == [("peer-a", ["peer-x"])]
    assert b.engine.guard.notices.received["peer-a"][1] == frozenset({"peer-x"})
    after = totals([a, b])
    assert after.weight == before.weight and bool((after.mass == before.mass).all())


@pytest.mark.parametrize("names,reason", [(["p1", "p2", "p3", "p4", "p5"], "bad_notice"),
                                          (["x" * (MAX_NOTICE_ID_BYTES + 1)], "bad_notice"),
                                          ([""], "bad_notice")])
def test_a_hostile_notice_is_refused_and_recorded_nowhere(names: list[str], reason: str) -> None:
    _, b, _, _, stream = open_stream()
    received = stream.on_frame(notice_frame(names), 0.0)
    assert received.refusal is not None and received.refusal.reason == reason
    assert b.notices == [] and b.engine.guard.notices.received == {}


def test_a_notice_before_the_hello_is_refused() -> None:
    b = make_gate("peer-b", seed=2)
    stream = InboundStreams(b, NetConfig()).open("wire", caller="peer-a")
    received = stream.on_frame(notice_frame(["peer-x"]), 0.0)
    assert received.refusal is not None and received.refusal.reason == "no_hello" and b.notices == []


# --- the simulator: the rotating exponential graph -----------------------------------------------------------------
INSIDER = "peer-003"
ONE_WAY = ("peer-001", "peer-002")  # send to the insider (i+2, i+1), never hear from it


@pytest.fixture(scope="module")
def splits() -> DatasetSplits:
    return load_dataset("synthetic", n_train=320, n_test=64, image_size=12, in_channels=1)


def exp_spec() -> RunSpec:
    """Dense fp32 SGP at lr = 0 (nothing but gossip moves x or w) on the rotating exponential graph."""
    return RunSpec(model=ModelSpec(name="mnist-cnn", precision="fp32"),
                   data=DataSpec(dataset="synthetic", batch_size=16), optim=OptimSpec(lr=0.0, epochs=2.0),
                   gossip=GossipSpec(algorithm="sgp", compression=0.0, topology="exponential", rotating=True,
                                     robust=True))


class RecordingTransport:
    """Records the notices a round hands to the transport: (sender, receivers, names)."""

    def __init__(self) -> None:
        self.notices: list[tuple[str, set[str], list[str]]] = []

    def notify(self, sender: str, receivers: Collection[str], quarantined: Sequence[str]) -> None:
        self.notices.append((sender, set(receivers), list(quarantined)))

    def probe(self, sender: str, receivers: Collection[str], sketch: bytes, round_index: int) -> None:
        raise AssertionError("a training round sends no consensus probe")


def test_a_quarantine_is_told_at_once_repeated_and_its_release_withdrawn_from_the_same_peers(splits) -> None:
    sim = Simulation(exp_spec(), splits, 8)
    peer = sim.peers["peer-005"]
    live = [p for p in IDS if p != "peer-005"]
    transport = RecordingTransport()
    peer.engine.guard.quarantine(INSIDER, "test")
    for t in range(4, 8):
        send_notice_if_due(peer, transport, live, t)  # type: ignore[arg-type]
    everyone = set(live) - {INSIDER}
    told = ("peer-005", everyone, [INSIDER])
    assert transport.notices == [told, told]  # round 4, then every 3 rounds
    assert peer.release(INSIDER)
    send_notice_if_due(peer, transport, live, 8)  # type: ignore[arg-type]
    assert transport.notices[-1] == ("peer-005", everyone, [])
    send_notice_if_due(peer, transport, live, 20)  # type: ignore[arg-type]
    assert len(transport.notices) == 3  # nobody quarantined: nothing more


def exp_run(splits: DatasetSplits, quorum: int,
            rounds: int) -> tuple[Simulation, list[tuple[int, str, str]], list[float]]:
    """:func:`exp_spec` on 8 peers, :data:`INSIDER` sign-flipping every message; every honest peer's message
    (round, sender, receiver) and the honest peers' sum w (held included) after each round."""
    sim = Simulation(exp_spec(), splits, 8, attacks={INSIDER: Attack("sign_flip")})
    for p in sim.peers.values():
        p.engine.guard.config = dataclasses.replace(p.engine.guard.config, notice_quorum=quorum)
    sent: list[tuple[int, str, str]] = []
    submit = sim.transport.submit

    def record(messages: Sequence[OutMessage]) -> None:
        sent.extend((sim.round, m.sender, m.receiver) for m in messages if m.sender in sim.honest)
        submit(messages)

    sim.transport.submit = record  # type: ignore[method-assign]
    weights = []
    for _ in range(rounds):
        sim.step_round()
        weights.append(sum(sim.peers[p].engine.holdings()[1] for p in sim.honest))
    return sim, sent, weights


@pytest.mark.slow
def test_every_honest_peer_excludes_a_quarantined_insider_at_one_round_and_mixes_every_round(splits) -> None:
    """Without notices (a quorum no fleet of 8 reaches) peer-001 and peer-002 send the quarantined insider half
    their weight every third round for good, and the insider's receivers skip their edge to it: rounds in which an
    honest peer mixes nothing. With them, every honest peer excludes it from the same round (named by its three
    receivers, quarantined by those alone), sends it nothing after, and from then on every honest peer sends one
    message a round to an honest peer - the rotating exponential graph of the seven, the same at every peer - and
    the honest peers keep more of their weight."""
    sim, sent, weights = exp_run(splits, 2, 18)
    plain, sent_plain, weights_plain = exp_run(splits, 99, 18)
    print(f"honest sum w with notices {weights[-1]:.3f}, without {weights_plain[-1]:.3f}")
    receivers = {"peer-004", "peer-005", "peer-007"}
    since = {sim.peers[p].engine.guard.notices.left_out.get(INSIDER) for p in sim.honest}
    assert len(since) == 1 and None not in since, since
    records = {p: sim.peers[p].robust_snapshot()[INSIDER] for p in ONE_WAY}  # status: they sent to it
    assert {r["left_out_on_notice_since"] for r in records.values()} == since, records
    (start,) = since
    assert start < 18 - 3, f"excluded only at round {start}: no rounds after to test"
    for peer_id in ONE_WAY:
        assert records[peer_id]["named_by"] == sorted(receivers), records[peer_id]
        assert not sim.peers[peer_id].quarantined()
        assert [m for m in sent_plain if m[1] == peer_id and m[2] == INSIDER and m[0] >= start], \
            "the plain run did not feed it after: no test"
        assert plain.peers[peer_id].robust_snapshot()[INSIDER]["left_out_on_notice_since"] is None
    assert [m for m in sent if m[2] == INSIDER and m[0] >= start] == []
    assert all(sim.peers[p].quarantined() == {INSIDER} for p in receivers)
    after = [(t, p) for t in range(start, 18) for p in sim.honest]
    per_round = {key: [m[2] for m in sent if (m[0], m[1]) == key] for key in after}
    assert all(len(to) == 1 and to[0] != INSIDER for to in per_round.values()), per_round
    idle_plain = [key for key in after if not [m for m in sent_plain if (m[0], m[1]) == key]]
    assert idle_plain, "without notices no honest peer skipped a round: no test"
    assert weights[-1] > weights_plain[-1] + 0.5


@pytest.mark.slow
def test_quarantiners_keep_the_schedule_their_neighbours_compute_for_them(splits) -> None:
    """Two insiders (peer-003, peer-006) quarantined on the rotating exponential graph: a quarantiner that rebuilt
    its schedule without them re-indexed the graph (peer-007, which quarantines both, expected peer-001 and
    peer-004, which never sent to it, and routed around both as sinks from round 13-14). Every honest peer keeps
    computing the graph over the live set: no honest peer is flagged, routed around or quarantined."""
    insiders = {INSIDER: Attack("sign_flip"), "peer-006": Attack("sign_flip")}
    sim = Simulation(exp_spec(), splits, 8, attacks=insiders)
    for _ in range(24):
        sim.step_round()
    for peer_id in sim.honest:
        snapshot = sim.peers[peer_id].robust_snapshot()
        for neighbour, record in snapshot.items():
            if neighbour in insiders:
                continue
            assert not record["sink"] and record["routed_around_since"] is None, (peer_id, neighbour, record)
            assert record["quarantined_since"] is None, (peer_id, neighbour, record)
    quarantiners = [p for p in sim.honest if set(insiders) & sim.peers[p].quarantined()]
    assert "peer-007" in quarantiners and set(insiders) <= sim.peers["peer-007"].quarantined()


@pytest.mark.slow
def test_false_notices_cut_an_honest_peer_off_only_where_insiders_are_all_it_sends_to(splits) -> None:
    """The abuse docs/design.md#quarantine-notices measures: insiders whose messages are honest name every honest
    peer in notices. One, and two that both hear from peer-002 (it sends to 003, 004 and 006), are vetoed by its
    honest receiver 004: nobody is left out. Three that are all it sends to get the peers it never
    sends to leave it out, so its one-way senders (peer-000, peer-001) send it nothing more - and nothing else: no
    other honest peer is left out, nobody is quarantined, and at lr = 0 every peer's weight is still there."""
    cut = {p: {"peer-002"} for p in ("peer-000", "peer-001", "peer-005", "peer-007")}
    for slanderers, left_out_expected in (((INSIDER,), {}), ((INSIDER, "peer-006"), {}),
                                          ((INSIDER, "peer-004", "peer-006"), cut)):
        honest = tuple(p for p in IDS if p not in slanderers)
        sim = Simulation(exp_spec(), splits, 8, attacks={p: Attack("slander", slander=honest) for p in slanderers})
        fed: list[tuple[int, str]] = []
        submit = sim.transport.submit

        def record(messages: Sequence[OutMessage]) -> None:
            fed.extend((sim.round, m.sender) for m in messages if m.receiver == "peer-002" and m.sender in honest)
            submit(messages)

        sim.transport.submit = record  # type: ignore[method-assign]
        for _ in range(9):
            sim.step_round()
        left_out = {p: set(sim.peers[p].engine.guard.notices.left_out) for p in sim.honest}
        assert {p: s for p, s in left_out.items() if s} == left_out_expected, slanderers
        assert ({sender for r, sender in fed if r >= 1} == set()) == bool(left_out_expected), (slanderers, fed)
        assert not any(sim.peers[p].quarantined() for p in IDS)
        assert sum(sim.peers[p].engine.holdings()[1] for p in IDS) == pytest.approx(8.0, abs=1e-6)


def test_a_slanderer_needs_names_and_sends_its_notices_every_few_rounds() -> None:
    with pytest.raises(ValueError, match="slander"):
        Attack("slander")
    attack = Attack("slander", slander=("peer-002", "peer-001"))
    assert [attack.false_notice(t) for t in range(5)] == [["peer-001", "peer-002"], None, None,
                                                         ["peer-001", "peer-002"], None]
    assert Attack("sign_flip").false_notice(0) is None
