"""Exactly-once bookkeeping of one edge (DESIGN.md 3): seqs, fences, handshake verdicts, resets."""

from peer.gossip.ledger import Hello, InboundEdge, OutboundEdge, Verdict, answer_hello, judge_reply


def test_receiver_applies_each_seq_once_and_in_order():
    edge = InboundEdge()
    assert edge.accepts(1)
    edge.record_applied(1)
    assert not edge.accepts(1)  # replay
    assert edge.accepts(2)


def test_unapplied_in_flight_message_is_fenced_and_retracted():
    out, inbound = OutboundEdge(), InboundEdge()
    seq = out.issue()
    reply = answer_hello(inbound, Hello(next_seq=out.next_seq, retract_seq=seq), b"")
    assert judge_reply(out, reply) is Verdict.RETRACTED
    assert not inbound.accepts(seq)  # a late copy is dropped forever
    out.settle()
    out.resume_after(reply.fence)
    assert inbound.accepts(out.issue())


def test_applied_in_flight_message_is_delivered_not_fenced():
    out, inbound = OutboundEdge(), InboundEdge()
    seq = out.issue()
    inbound.record_applied(seq)  # applied, ack lost
    reply = answer_hello(inbound, Hello(next_seq=out.next_seq, retract_seq=seq), b"")
    assert judge_reply(out, reply) is Verdict.DELIVERED
    assert inbound.fence == 0


def test_sender_behind_resets_edge_and_resumes_above_fence():
    inbound = InboundEdge()
    for seq in range(1, 6):
        inbound.record_applied(seq)
    restored = OutboundEdge(next_seq=3)  # sender restarted from an older checkpoint
    reply = answer_hello(inbound, Hello(next_seq=3, retract_seq=0), b"")
    assert reply.reset
    restored.resume_after(reply.fence)
    assert restored.next_seq == 6 and inbound.accepts(restored.issue())


def test_replica_mismatch_resets_edge():
    inbound = InboundEdge()
    reply = answer_hello(inbound, Hello(next_seq=1, retract_seq=0, replica_digest=b"a", replica_digest_applied=b"a"), b"b")
    assert reply.reset
    reply = answer_hello(inbound, Hello(next_seq=1, retract_seq=0, replica_digest=b"a", replica_digest_applied=b"a"), b"a")
    assert not reply.reset


def test_busy_edge_refuses_second_message():
    out = OutboundEdge()
    out.issue()
    assert out.busy
    try:
        out.issue()
    except RuntimeError:
        pass
    else:
        raise AssertionError("a second in-flight message was allowed")
