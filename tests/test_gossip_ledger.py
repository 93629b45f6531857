"""Exactly-once bookkeeping of one edge (docs/design.md#exactly-once-mass-transfer): a window of in-flight seqs,
cumulative acks, fences, handshake verdicts with the reply clamp, resets, hostile Hellos - as pure logic, no tensors."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from peer.gossip.ledger import (
    MAX_SEQ,
    MAX_WINDOW,
    SEQ_WINDOW,
    Hello,
    HelloError,
    HelloReply,
    InboundEdge,
    OutboundEdge,
)


def test_receiver_applies_each_seq_once_and_in_order():
    edge = InboundEdge()
    assert edge.accepts(1)
    edge.record_applied(1)
    assert not edge.accepts(1)  # replay
    assert edge.accepts(2)


def test_window_bounds_messages_in_flight():
    out: OutboundEdge[str] = OutboundEdge()
    assert [out.issue(f"m{i}", window=3) for i in range(3)] == [1, 2, 3]
    assert not out.has_room(3)
    with pytest.raises(RuntimeError):
        out.issue("m3", window=3)
    assert out.has_room(4)


def test_ack_is_cumulative_and_stale_acks_settle_nothing():
    out: OutboundEdge[str] = OutboundEdge()
    for i in range(4):
        out.issue(f"m{i}", window=4)
    settled = out.acknowledge(2)
    assert [seq for seq, _ in settled.delivered] == [1, 2] and list(out.in_flight) == [3, 4]
    assert out.acknowledge(2).delivered == []
    assert [seq for seq, _ in out.acknowledge(4).delivered] == [3, 4] and not out.in_flight


def test_handshake_delivers_the_applied_prefix_and_retracts_the_rest_newest_first():
    out: OutboundEdge[str] = OutboundEdge()
    inbound = InboundEdge()
    for i in range(4):
        out.issue(f"m{i}", window=4)
    inbound.record_applied(1)
    inbound.record_applied(2)  # seq 3 and 4 lost with the stream
    hello = out.hello()
    reply = inbound.answer(hello)
    settled = out.settle(hello, reply)
    assert [s for s, _ in settled.delivered] == [1, 2]
    assert [s for s, _ in settled.retracted] == [4, 3]
    assert not inbound.accepts(3) and not inbound.accepts(4)  # late copies are dropped forever
    assert inbound.accepts(out.issue("next", window=4))


def test_reply_is_clamped_to_the_announced_range():
    """A message issued after the Hello was built never went out on the new stream: it is retracted even if the
    receiver claims more (a confused or hostile receiver cannot make the sender forget mass it never sent)."""
    out: OutboundEdge[str] = OutboundEdge()
    out.issue("announced", window=4)
    hello = out.hello()
    out.issue("unannounced", window=4)
    settled = out.settle(hello, HelloReply(last_applied=99, fence=0, reset=False))
    assert [s for s, _ in settled.delivered] == [1]
    assert [s for s, _ in settled.retracted] == [2]


def test_sender_behind_resets_edge_and_resumes_above_fence():
    inbound = InboundEdge()
    for seq in range(1, 6):
        inbound.record_applied(seq)
    restored: OutboundEdge[str] = OutboundEdge(next_seq=3)  # sender restarted from an older checkpoint
    hello = restored.hello()
    reply = inbound.answer(hello)
    assert reply.reset
    restored.settle(hello, reply)
    assert restored.next_seq == 6 and inbound.accepts(restored.issue("m", window=1))


def test_replica_digest_of_the_applied_prefix_decides_reset():
    out: OutboundEdge[str] = OutboundEdge()
    out.issue("m1", window=2)
    out.issue("m2", window=2)
    inbound = InboundEdge()
    inbound.record_applied(1)
    digests = (b"none", b"one", b"two")  # replica after 0, 1, 2 of the in-flight messages
    assert not InboundEdge(last_applied=1).answer(out.hello(digests), b"one").reset
    assert InboundEdge(last_applied=1).answer(out.hello(digests), b"two").reset
    assert not InboundEdge().answer(out.hello(digests), b"none").reset


@pytest.mark.parametrize("hello", [
    Hello(next_seq=0), Hello(next_seq=2**63), Hello(next_seq=3, first_in_flight=5),
    Hello(next_seq=MAX_WINDOW + 10, first_in_flight=1), Hello(next_seq=3, first_in_flight=1, replica_digests=(b"a",)),
])
def test_malformed_hello_is_refused_without_change(hello):
    edge = InboundEdge(last_applied=4, fence=2)
    with pytest.raises(HelloError):
        edge.answer(hello)
    assert edge == InboundEdge(last_applied=4, fence=2)


@settings(max_examples=200, deadline=None)
@given(window=st.integers(1, 8), ops=st.lists(st.sampled_from(["send", "deliver", "ack", "break"]), max_size=60))
def test_every_message_is_applied_at_most_once_and_settled_consistently(window, ops):
    """Random sends, in-order deliveries, cumulative acks and stream breaks (handshakes): a message is delivered
    by the sender's books iff the receiver applied it, and is never applied twice."""
    out: OutboundEdge[int] = OutboundEdge()
    inbound = InboundEdge()
    wire: list[int] = []          # sent on the current stream, not yet delivered (in order)
    applied: list[int] = []       # seqs the receiver applied
    delivered: set[int] = set()   # sender's verdicts
    retracted: set[int] = set()
    for op in ops:
        if op == "send" and out.has_room(window):
            seq = out.issue(0, window)
            wire.append(seq)
        elif op == "deliver" and wire:
            seq = wire.pop(0)
            if inbound.accepts(seq):
                inbound.record_applied(seq)
                applied.append(seq)
        elif op == "ack" and applied:
            delivered |= {s for s, _ in out.acknowledge(inbound.last_applied).delivered}
        elif op == "break":
            wire.clear()
            hello = out.hello()
            settled = out.settle(hello, inbound.answer(hello))
            delivered |= {s for s, _ in settled.delivered}
            retracted |= {s for s, _ in settled.retracted}
    assert len(applied) == len(set(applied))
    assert delivered <= set(applied)
    assert not (retracted & set(applied))
    assert not (delivered & retracted)


def test_hello_far_beyond_a_known_edge_is_refused_without_change():
    """A Hello announcing next_seq = MAX_SEQ - 1 would fence every seq the real sender can still use."""
    edge = InboundEdge(last_applied=7, fence=3)
    for next_seq in (7 + SEQ_WINDOW + 1, MAX_SEQ - 1):
        with pytest.raises(HelloError):
            edge.answer(Hello(next_seq=next_seq, first_in_flight=next_seq - 1))
        assert (edge.last_applied, edge.fence) == (7, 3)
    assert not edge.in_window(7 + SEQ_WINDOW + 1) and edge.in_window(8)
    # an edge this receiver has no state for (new, or forgotten after the peer left) takes any honest number
    fresh = InboundEdge()
    assert fresh.answer(Hello(next_seq=5 * SEQ_WINDOW)).fence == 0


@pytest.mark.parametrize("reply", [HelloReply(last_applied=0, fence=2**64 - 1, reset=False),
                                   HelloReply(last_applied=2**64 - 1, fence=0, reset=False),
                                   HelloReply(last_applied=3, fence=3 + SEQ_WINDOW + 1, reset=True)])
def test_sender_refuses_a_hostile_reply_and_keeps_its_edge(reply):
    """A reply far beyond the Hello settles nothing: the in-flight messages wait for an honest handshake and the
    sender's numbers stay usable (the edge used to die with 'Value out of range')."""
    out: OutboundEdge[str] = OutboundEdge()
    for i in range(3):
        out.issue(f"m{i}", window=4)
    hello = out.hello()
    with pytest.raises(HelloError):
        out.settle(hello, reply)
    assert out.next_seq == 4 and list(out.in_flight) == [1, 2, 3]
