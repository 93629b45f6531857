"""What a Gossip stream must do, run against every transport: the in-memory one (fast, the simulator's) and the
gRPC one over real sockets, insecure and with mutual TLS (tests/stream_links.py puts both behind one interface,
as Flower's state tests do with a factory per implementation). Both run the same pure stream classes
(peer/net/inbound.py, peer/net/outbound.py); this suite checks they run them the same way.

Raw streams play the sender frame by frame (serialized frames in, replies out); edges are the transport's own
sender. Sender peer-a's and receiver peer-b's engines are real (choco over the small layout of test_net_support):
mass conservation and at-most-once application are checked on them."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import torch

from peer.compress.codec import CodecConfig, encode
from peer.gossip.algorithms import digest as replica_digest
from peer.gossip.engine import GossipInputError
from peer.gossip.ledger import MAX_WINDOW, Hello
from peer.net import wire
from peer.net.api import Identity
from peer.net.config import NetConfig
from peer.net.proto.lpdl.v1 import peer_pb2 as pb
from tests.stream_links import TRANSPORTS, Link, make_link, make_pki
from tests.test_net_support import LAYOUT, RecordingGate, totals

CONFIG = NetConfig(connect_timeout_s=3.0, ack_timeout_s=5.0, backoff_base_s=0.02, backoff_max_s=0.2,
                   close_timeout_s=3.0, chunk_bytes=256, max_chunk_bytes=512, max_payload_bytes=64 * 1024,
                   max_buffered_bytes=4096, reassembly_timeout_s=30.0, max_peers=8)
Body = Callable[[Link, dict[str, RecordingGate]], Awaitable[None]]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_pki(tmp_path_factory.mktemp("stream_pki"))


@pytest.fixture(params=TRANSPORTS)
def contract(request: pytest.FixtureRequest, pki: Path) -> Callable[..., None]:
    """Runs a test body against the transport of this parameter: ``contract(body, config=..., window=...)``."""

    def run(body: Body, config: NetConfig = CONFIG, window: int = 1) -> None:
        async def main() -> None:
            link, gates = await make_link(request.param, config, pki, window)
            try:
                await body(link, gates)
            finally:
                await link.close()

        asyncio.run(main())

    return run


# --- frames --------------------------------------------------------------------------------------------------------
def payload(seed: int = 0) -> bytes:
    gen = torch.Generator().manual_seed(seed)
    data, _ = encode(torch.randn(LAYOUT.numel, generator=gen), LAYOUT, CodecConfig(compression=0.9), gen)
    return data


P = payload()


def hello(identity: Identity, next_seq: int = 1, receiver: str = "peer-b") -> bytes:
    """A fresh sender's Hello (its Choco replica of the edge all zero)."""
    digest = replica_digest(torch.zeros(LAYOUT.numel))
    return wire.hello_frame(identity, receiver, Hello(next_seq=next_seq, replica_digests=(digest,))) \
        .SerializeToString()


def update(seq: int, data: bytes = P, *, index: int = 0, count: int = 1, total: int | None = None,
           algorithm: str = "choco") -> pb.Update:
    return pb.Update(seq=seq, round=1, weight=0.25, scale=0.25, algorithm=algorithm, chunk_index=index,
                     chunk_count=count, total_length=len(data) if total is None else total, data=data)


def frame(*updates: pb.Update) -> bytes:
    """One Update frame, or an UpdateBatch frame of several (or none)."""
    if len(updates) == 1:
        return pb.GossipFrame(update=updates[0]).SerializeToString()
    return pb.GossipFrame(batch=pb.UpdateBatch(updates=list(updates))).SerializeToString()


def kinds(replies: list[pb.GossipReply]) -> list[str]:
    return [r.WhichOneof("reply") for r in replies]


def mass(gate: RecordingGate) -> tuple[torch.Tensor, float]:
    return gate.engine.x.clone(), gate.engine.w


def assert_conserved(gates: list[RecordingGate], before) -> None:
    after = totals(gates)
    assert torch.allclose(after.mass, before.mass, atol=1e-4, rtol=1e-6)
    assert after.weight == pytest.approx(before.weight, abs=1e-9)


def assert_at_most_once(gate: RecordingGate) -> None:
    assert len(gate.applied) == len(set(gate.applied)), gate.applied


async def handshake(link: Link, sender: RecordingGate):
    """A raw stream opened by ``sender``'s own Hello, its reply given to the sender's ledger."""
    raw = await link.open(sender.identity().peer_id)
    h = sender.hello_for("peer-b")
    await raw.write(wire.hello_frame(link.identity(sender.identity().peer_id), "peer-b", h).SerializeToString())
    reply = await raw.read()
    assert reply is not None and reply.WhichOneof("reply") == "hello_reply", reply
    settlement = sender.on_hello_reply("peer-b", h, wire.reply_from_pb(reply.hello_reply))
    return raw, settlement


# --- in-order apply, cumulative acks, windows, batches --------------------------------------------------------------
def test_updates_are_applied_in_order_and_acknowledged_cumulatively(contract) -> None:
    async def body(link: Link, gates) -> None:
        raw = await link.open()
        await raw.write(hello(link.identity("peer-a")))
        assert kinds([await raw.read()]) == ["hello_reply"]
        for seq in (1, 2, 3):
            await raw.write(frame(update(seq, payload(seq))))
        await raw.write(frame(update(4, payload(4)), update(5, payload(5))))  # one batch, one Ack
        replies = await raw.finish()
        acks = [r.ack.seq for r in replies if r.WhichOneof("reply") == "ack"]
        assert set(kinds(replies)) <= {"ack"} and acks == sorted(acks) and acks[-1] == 5, replies
        assert gates["peer-b"].applied == [("peer-a", seq) for seq in range(1, 6)]
        assert link.counters.applied == 5

    contract(body)


def test_a_window_of_updates_is_settled_by_cumulative_acks(contract) -> None:
    async def body(link: Link, gates) -> None:
        a, b = gates["peer-a"], gates["peer-b"]
        before = totals([a, b])
        edge = await link.edge(a)
        for r in range(3):
            edge.submit([m for sub in range(4) for m in a.engine.send_round(["peer-b"], 4 * r + sub)])
            assert a.in_flight_count("peer-b") == 4  # the whole window unsettled at once
            await edge.drain()
        assert edge.stream_delivered == 12 and not a.in_flight_count("peer-b")
        assert b.applied == [("peer-a", seq) for seq in range(1, 13)]
        assert_conserved([a, b], before)
        assert torch.equal(a.engine.algorithm.replica_out("peer-b"), b.engine.algorithm.replica_in("peer-a"))
        await edge.close()

    contract(body, window=4)


# --- broken streams, reconnect handshakes, retraction, fencing ------------------------------------------------------
@pytest.mark.parametrize("point", ["before_first_chunk", "after_first_chunk", "before_last_chunk", "after_last_chunk",
                                   "after_ack"])
def test_a_stream_broken_anywhere_in_a_message_settles_it_exactly_once(contract, point: str) -> None:
    """The stream breaks at ``point`` of a message cut in chunks; the sender's reconnect handshake judges it
    delivered (every chunk arrived) or retracts it, and the receiver fences a late copy either way."""

    async def body(link: Link, gates) -> None:
        a, b = gates["peer-a"], gates["peer-b"]
        before = totals([a, b])
        raw, _ = await handshake(link, a)
        msg, = a.engine.send_round(["peer-b"], 0)
        (_, chunks), = wire.update_frames([msg], "choco", 40)
        assert len(chunks) >= 3
        sent = {"before_first_chunk": 0, "after_first_chunk": 1, "before_last_chunk": len(chunks) - 1}.get(
            point, len(chunks))
        for raw_frame in chunks[:sent]:
            await raw.write(raw_frame)
        await link.arrived("peer-a", sent)
        if point == "after_ack":
            ack = await raw.read()
            assert ack is not None and ack.ack.seq == msg.seq
            a.on_ack("peer-b", ack.ack.seq)
        await raw.cut()
        await link.gone("peer-a")
        assert link.buffered.used == 0
        assert link.counters.refused["truncated"] == (1 if 0 < sent < len(chunks) else 0)
        raw, settlement = await handshake(link, a)
        whole = sent == len(chunks)
        assert b.applied == ([("peer-a", msg.seq)] if whole else [])
        if point == "after_ack":
            assert not settlement.seqs()  # the Ack settled it already
        else:
            assert [s for s, _ in (settlement.delivered if whole else settlement.retracted)] == [msg.seq]
        assert not a.in_flight_count("peer-b")
        assert_conserved([a, b], before)
        # a late copy of the settled message is fenced: refused, nothing changes
        held = mass(b)
        await raw.write(chunks[0])
        replies = await raw.finish()
        assert replies[-1].refusal.code == pb.REFUSAL_BAD_SEQ and replies[-1].refusal.reason == "seq_order"
        assert torch.equal(held[0], b.engine.x) and held[1] == b.engine.w
        assert_at_most_once(b)

    contract(body)


def test_a_replay_behind_a_stale_hello_is_fenced(contract) -> None:
    """A sender that lies about its history (its Hello starts at seq 1 again, as a restart from an older checkpoint
    would) is reset and fenced by the handshake: the replay of an applied seq is refused on the stream itself."""

    async def body(link: Link, gates) -> None:
        b = gates["peer-b"]
        first = await link.open()
        await first.write(hello(link.identity("peer-a")))
        await first.write(frame(update(1)))
        assert kinds(await first.finish()) == ["hello_reply", "ack"]
        await link.gone("peer-a")
        held = mass(b)
        again = await link.open()
        await again.write(hello(link.identity("peer-a")))
        await again.write(frame(update(1)))
        replies = await again.finish()
        assert replies[0].hello_reply.reset and replies[0].hello_reply.fence >= 1
        assert (replies[-1].refusal.code, replies[-1].refusal.reason) == (pb.REFUSAL_BAD_SEQ, "seq_order")
        assert torch.equal(held[0], b.engine.x) and held[1] == b.engine.w and b.applied == [("peer-a", 1)]

    contract(body)


def test_an_edge_cut_with_its_window_in_flight_reconnects_and_settles(contract) -> None:
    async def body(link: Link, gates) -> None:
        a, b = gates["peer-a"], gates["peer-b"]
        before = totals([a, b])
        edge = await link.edge(a)
        for r in range(4):
            edge.submit([m for sub in range(4) for m in a.engine.send_round(["peer-b"], 4 * r + sub)])
            if r % 2 == 0:
                await edge.cut()
            await edge.drain()
            assert not a.in_flight_count("peer-b")
            assert_conserved([a, b], before)
        assert_at_most_once(b)
        assert len(b.applied) >= 8  # the uncut rounds went through
        assert torch.equal(a.engine.algorithm.replica_out("peer-b"), b.engine.algorithm.replica_in("peer-a"))
        await edge.close()

    contract(body, window=4)


def test_closing_an_edge_settles_what_it_carries(contract) -> None:
    async def body(link: Link, gates) -> None:
        a, b = gates["peer-a"], gates["peer-b"]
        before = totals([a, b])
        edge = await link.edge(a)
        edge.submit([m for sub in range(3) for m in a.engine.send_round(["peer-b"], sub)])
        await edge.close()
        assert not a.in_flight_count("peer-b")
        assert_conserved([a, b], before)
        assert_at_most_once(b)

    contract(body, window=4)


# --- supersession, budgets, deadlines --------------------------------------------------------------------------------
def test_a_newer_stream_supersedes_the_older_one(contract) -> None:
    async def body(link: Link, gates) -> None:
        old = await link.open()
        await old.write(hello(link.identity("peer-a")))
        assert kinds([await old.read()]) == ["hello_reply"]
        new = await link.open()
        await new.write(hello(link.identity("peer-a")))
        assert kinds([await new.read()]) == ["hello_reply"]
        told = await old.read()
        assert told is not None and told.refusal.code == pb.REFUSAL_SUPERSEDED, told
        assert link.counters.refused["superseded"] == 1
        await new.write(frame(update(1)))
        assert [r.ack.seq for r in await new.finish()] == [1]
        assert gates["peer-b"].applied == [("peer-a", 1)]
        await old.cut()

    contract(body)


def test_partial_updates_are_bounded_by_the_shared_byte_budget(contract) -> None:
    async def body(link: Link, gates) -> None:
        data = bytes(range(256)) * 3
        raw = await link.open()
        await raw.write(hello(link.identity("peer-a")))
        await raw.read()
        await raw.write(frame(update(1, data[:256], count=3, total=len(data))))
        await raw.write(frame(update(1, data[256:512], index=1, count=3, total=len(data))))
        await raw.write(frame(update(1, data[512:], index=2, count=3, total=len(data))))
        replies = await raw.finish()
        assert replies[-1].refusal.code == pb.REFUSAL_LIMIT and replies[-1].refusal.reason == "buffer_full"
        assert link.buffered.used == 0 and gates["peer-b"].applied == []

    contract(body, config=dataclasses.replace(CONFIG, max_buffered_bytes=512))


def test_a_partial_update_past_its_deadline_is_refused(contract) -> None:
    async def body(link: Link, gates) -> None:
        raw = await link.open()
        await raw.write(hello(link.identity("peer-a")))
        await raw.read()
        await raw.write(frame(update(1, P[:10], count=2, total=len(P))))
        await link.wait(0.5)
        refusal = await raw.read()
        assert refusal is not None and refusal.refusal.code == pb.REFUSAL_LIMIT, refusal
        assert refusal.refusal.reason == "reassembly_timeout" and refusal.refusal.seq == 1
        assert link.buffered.used == 0 and link.counters.refused["reassembly_timeout"] == 1
        await raw.cut()

    contract(body, config=dataclasses.replace(CONFIG, reassembly_timeout_s=0.2))


# --- every refusal code -----------------------------------------------------------------------------------------------
def _claim(**changes) -> Callable[[Link], list[bytes]]:
    return lambda link: [hello(dataclasses.replace(link.identity("peer-a"), **changes)), frame(update(1))]


def _after_hello(*frames: bytes) -> Callable[[Link], list[bytes]]:
    return lambda link: [hello(link.identity("peer-a")), *frames]


REFUSALS = {
    # name: (frames, code, counter reason)
    "protocol": (_claim(protocol_version=99), pb.REFUSAL_PROTOCOL, "protocol"),
    "fingerprint": (_claim(fingerprint="another-model"), pb.REFUSAL_FINGERPRINT, "fingerprint"),
    "fleet": (_claim(fleet="another-fleet"), pb.REFUSAL_FLEET, "fleet"),
    "algorithm": (_claim(algorithm="sgp"), pb.REFUSAL_ALGORITHM, "algorithm"),
    "wrong_receiver": (lambda link: [hello(link.identity("peer-a"), receiver="peer-c")], pb.REFUSAL_WRONG_RECEIVER,
                       "wrong_receiver"),
    "no_hello": (lambda link: [frame(update(1))], pb.REFUSAL_BAD_FRAME, "no_hello"),
    "hello_twice": (lambda link: [hello(link.identity("peer-a"))] * 2, pb.REFUSAL_BAD_FRAME, "hello_twice"),
    "empty_frame": (_after_hello(b""), pb.REFUSAL_BAD_FRAME, "empty_frame"),
    "malformed": (_after_hello(b"\xff\xff\xff\x07"), pb.REFUSAL_BAD_FRAME, "malformed"),
    "batch_size": (_after_hello(frame(*[update(s, b"z") for s in range(1, MAX_WINDOW + 2)])), pb.REFUSAL_BAD_FRAME,
                   "batch_size"),
    "chunk_order": (_after_hello(frame(update(1, P[:10], count=2, total=len(P))),
                                 frame(update(1, P[10:], index=3, count=2, total=len(P)))),
                    pb.REFUSAL_BAD_CHUNK, "chunk_order"),
    "chunk_too_large": (_after_hello(frame(update(1, b"x" * 600))), pb.REFUSAL_BAD_CHUNK, "chunk_too_large"),
    "payload_too_large": (_after_hello(frame(update(1, b"x" * 10, count=2, total=10 ** 9))), pb.REFUSAL_BAD_CHUNK,
                          "payload_too_large"),
    "batch_chunked": (_after_hello(frame(update(1), update(2, P[:10], count=2, total=len(P)))), pb.REFUSAL_BAD_CHUNK,
                      "batch_chunked"),
    "replayed_seq": (_after_hello(frame(update(1)), frame(update(1))), pb.REFUSAL_BAD_SEQ, "seq_order"),
    "replay_inside_batch": (_after_hello(frame(update(2), update(2))), pb.REFUSAL_BAD_SEQ, "seq_order"),
    "engine_refuses": (_after_hello(frame(update(1, b"\x00garbage" * 8))), pb.REFUSAL_BAD_UPDATE, "bad_payload"),
    "update_algorithm": (_after_hello(frame(update(1, algorithm="sgp"))), pb.REFUSAL_ALGORITHM, "algorithm"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_every_refusal_ends_the_stream_and_changes_no_mass(contract, case: str) -> None:
    build, code, reason = REFUSALS[case]

    async def body(link: Link, gates) -> None:
        b = gates["peer-b"]
        held = mass(b)
        applied_before = list(b.applied)
        raw = await link.open()
        for raw_frame in build(link):
            await raw.write(raw_frame)
        replies = await raw.finish()
        assert replies and replies[-1].WhichOneof("reply") == "refusal", replies
        assert (replies[-1].refusal.code, replies[-1].refusal.reason) == (code, reason), replies[-1]
        assert link.counters.refused[reason] == 1, dict(link.counters.refused)
        assert "ack" not in kinds(replies) or case == "replayed_seq"  # only the first, good copy is acknowledged
        if case != "replayed_seq":
            assert torch.equal(held[0], b.engine.x) and held[1] == b.engine.w and b.applied == applied_before
        assert link.buffered.used == 0

    contract(body)


def test_a_peer_greeting_itself_is_refused(contract) -> None:
    async def body(link: Link, gates) -> None:
        raw = await link.open("peer-b")
        await raw.write(hello(link.identity("peer-b")))
        replies = await raw.finish()
        assert [(r.refusal.code, r.refusal.reason) for r in replies] == [(pb.REFUSAL_SELF, "self")]

    contract(body)


def test_a_hello_naming_another_peer_than_the_certificate_is_refused(contract, request) -> None:
    async def body(link: Link, gates) -> None:
        if not link.authenticated:
            pytest.skip("an insecure link trusts the claimed id")
        raw = await link.open("peer-a")
        await raw.write(hello(link.identity("peer-c")))
        replies = await raw.finish()
        assert [(r.refusal.code, r.refusal.reason) for r in replies] == [(pb.REFUSAL_UNAUTHENTICATED,
                                                                          "sender_mismatch")]
        assert gates["peer-b"].engine.in_edges == {}

    contract(body)


def test_a_receiver_not_ready_refuses_the_hello(contract) -> None:
    async def body(link: Link, gates) -> None:
        def joining(sender_id, hello):
            raise GossipInputError("not_ready", "this peer is joining the fleet")

        gates["peer-b"].answer_hello = joining
        raw = await link.open()
        await raw.write(hello(link.identity("peer-a")))
        replies = await raw.finish()
        assert [(r.refusal.code, r.refusal.reason) for r in replies] == [(pb.REFUSAL_NOT_READY, "not_ready")]

    contract(body)


def test_senders_past_max_peers_are_refused(contract) -> None:
    async def body(link: Link, gates) -> None:
        first = await link.open("peer-c")
        await first.write(hello(link.identity("peer-c")))
        assert kinds([await first.read()]) == ["hello_reply"]
        second = await link.open("peer-a")
        await second.write(hello(link.identity("peer-a")))
        replies = await second.finish()
        assert [(r.refusal.code, r.refusal.reason) for r in replies] == [(pb.REFUSAL_LIMIT, "peer_limit")]
        await first.cut()

    contract(body, config=dataclasses.replace(CONFIG, max_peers=1))
