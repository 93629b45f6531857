"""peer/net/frames.py, the server's reader of Gossip frames, against protobuf's own parser: every valid frame reads
the same (merge rules, unknown fields and all), random or mutated bytes either read the same or are refused - never
a crash, never a frame protobuf refuses - and the refusals beyond protobuf's are only the documented ones. Payloads
come out as slices of the received bytes, uncopied; reassembly copies only what it holds across frames."""

from __future__ import annotations

import math
import re
import struct

import pytest
from google.protobuf import empty_pb2
from google.protobuf.message import DecodeError
from google.protobuf.unknown_fields import UnknownFieldSet
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from peer.gossip.ledger import MAX_WINDOW
from peer.net import frames, wire
from peer.net.proto.lpdl.v1 import peer_pb2 as pb
from peer.net.reassembly import Reassembler

FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
U64 = 2 ** 64 - 1


def varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def key(number: int, wire_type: int) -> bytes:
    return varint(number << 3 | wire_type)


def length_delimited(number: int, body: bytes) -> bytes:
    return key(number, 2) + varint(len(body)) + body


# --- what both parsers are compared on --------------------------------------------------------------------------
def _bits(x: float) -> bytes:
    return struct.pack("<d", x)


def update_fields(update) -> tuple:
    return (update.seq, update.round, _bits(update.weight), _bits(update.scale), update.algorithm,
            update.chunk_index, update.chunk_count, update.total_length, bytes(update.data))


def protobuf_view(msg: pb.GossipFrame) -> tuple:
    kind = msg.WhichOneof("frame")
    if kind == "update":
        return kind, update_fields(msg.update)
    if kind == "batch":
        return kind, [update_fields(u) for u in msg.batch.updates]
    if kind == "hello":
        return kind, msg.hello.SerializeToString(deterministic=True)
    if kind == "notice":
        return kind, list(msg.notice.quarantined)
    if kind == "probe":
        return kind, (msg.probe.sketch, msg.probe.round)
    return None, None


def reader_view(frame: frames.Frame) -> tuple:
    if frame.kind == "update":
        return frame.kind, update_fields(frame.update)
    if frame.kind == "batch":
        return frame.kind, [update_fields(u) for u in frame.updates]
    if frame.kind == "hello":
        return frame.kind, frame.hello.SerializeToString(deterministic=True)
    if frame.kind == "notice":
        return frame.kind, list(frame.notice.quarantined)
    if frame.kind == "probe":
        return frame.kind, (frame.probe.sketch, frame.probe.round)
    return None, None


# The refusals protobuf does not make (frames.py's doc): each must be explained by the bytes themselves, read by
# protobuf (every field of a message parsed as Empty is an unknown field: its number, wire type and bytes).
UPDATE_TYPES = {1: 0, 2: 0, 3: 1, 4: 1, 5: 2, 6: 0, 7: 0, 8: 0, 9: 2}
SCHEMA = {  # message: (wire type of each known field, the message each length-delimited one holds)
    "frame": ({1: 2, 2: 2, 3: 2, 4: 2, 5: 2}, {2: "update", 3: "batch"}),
    "batch": ({1: 2}, {1: "update"}),
    "update": (UPDATE_TYPES, {}),
}


def fields_of(raw: bytes) -> list:
    return list(UnknownFieldSet(empty_pb2.Empty.FromString(raw)))


def wire_type_mismatch(raw: bytes, message: str = "frame") -> bool:
    """Whether ``raw`` holds, at any depth the reader reads, a known field of another wire type, or a group."""
    types, nested = SCHEMA[message]
    for f in fields_of(raw):
        if f.wire_type == 3 or types.get(f.field_number, f.wire_type) != f.wire_type:
            return True
        if f.field_number in nested and wire_type_mismatch(f.data, nested[f.field_number]):
            return True
    return False


def batch_over_window(raw: bytes) -> bool:
    """Whether the updates of consecutive batch fields (before another oneof field replaces them) pass the window."""
    count = 0
    for f in fields_of(raw):
        if f.field_number in (1, 2):
            count = 0
        elif f.field_number == 3:
            count += sum(1 for g in fields_of(f.data) if g.field_number == 1)
            if count > MAX_WINDOW:
                return True
    return False


_OVER_64_BITS = re.compile(rb"[\x80-\xff]{9}[\x02-\x7f]")


def deviation_explained(raw: bytes, error: frames.FrameError) -> bool:
    text = str(error)
    if error.reason == "batch_size":
        return batch_over_window(raw)
    if "with wire type" in text or text == "group wire type":
        return wire_type_mismatch(raw)
    if text == "varint over 64 bits":
        return _OVER_64_BITS.search(raw) is not None
    return False


def check_against_protobuf(raw: bytes) -> frames.Frame | None:
    """Read ``raw`` with both parsers: same result, or a refusal protobuf makes too, or a documented one."""
    try:
        msg = pb.GossipFrame.FromString(raw)
    except DecodeError:
        msg = None
    try:
        frame = frames.read_frame(raw)
    except frames.FrameError as error:
        assert error.reason in ("malformed", "batch_size")
        if msg is not None:
            assert deviation_explained(raw, error), (raw.hex(), str(error), msg)
        return None
    assert msg is not None, f"the reader accepted {raw.hex()} which protobuf refuses"
    assert reader_view(frame) == protobuf_view(msg), raw.hex()
    for update in ([frame.update] if frame.kind == "update" else frame.updates if frame.kind == "batch" else []):
        assert isinstance(update.data, memoryview) and update.data.readonly
        if len(update.data):
            assert update.data.obj is raw  # a slice of the received bytes, not a copy
    return frame


# --- strategies: valid frames, field by field (duplicates, any order, unknown fields, oneof switches) -----------
u64 = st.integers(0, U64)
unknown_field = st.one_of(
    st.builds(lambda n, v: key(n, 0) + varint(v), st.integers(10, 2 ** 29 - 1), u64),
    st.builds(lambda n, b: key(n, 1) + b, st.integers(10, 2 ** 29 - 1), st.binary(min_size=8, max_size=8)),
    st.builds(length_delimited, st.integers(10, 2 ** 29 - 1), st.binary(max_size=16)),
    st.builds(lambda n, b: key(n, 5) + b, st.integers(10, 2 ** 29 - 1), st.binary(min_size=4, max_size=4)),
)
update_field = st.one_of(
    st.builds(lambda n, v: key(n, 0) + varint(v), st.sampled_from([1, 2, 6, 7, 8]), u64),
    st.builds(lambda n, x: key(n, 1) + struct.pack("<d", x), st.sampled_from([3, 4]), st.floats()),
    st.builds(lambda n, b: key(n, 1) + b, st.sampled_from([3, 4]), st.binary(min_size=8, max_size=8)),
    st.builds(lambda s: length_delimited(5, s.encode()), st.text(max_size=8)),
    st.builds(lambda b: length_delimited(9, b), st.binary(max_size=64)),
    unknown_field,
)
update_body = st.lists(update_field, max_size=12).map(b"".join)
batch_body = st.lists(st.one_of(update_body.map(lambda b: length_delimited(1, b)), unknown_field),
                      max_size=8).map(b"".join)
identities = st.builds(pb.PeerIdentity, peer_id=st.text(max_size=6), protocol_version=st.integers(0, 2 ** 32 - 1),
                       fingerprint=st.text(max_size=6), fleet=st.text(max_size=6))
hello_body = st.builds(pb.Hello, sender=identities, receiver_id=st.text(max_size=6), next_seq=u64,
                       first_in_flight=u64, replica_digests=st.lists(st.binary(max_size=8), max_size=3)
                       ).map(lambda h: h.SerializeToString())
notice_body = st.builds(pb.QuarantineNotice, quarantined=st.lists(st.text(max_size=6), max_size=3)
                        ).map(lambda n: n.SerializeToString())
probe_body = st.builds(pb.ConsensusProbe, sketch=st.binary(max_size=16), round=u64).map(lambda p: p.SerializeToString())
frame_field = st.one_of(update_body.map(lambda b: length_delimited(2, b)),
                        batch_body.map(lambda b: length_delimited(3, b)),
                        hello_body.map(lambda b: length_delimited(1, b)),
                        notice_body.map(lambda b: length_delimited(4, b)),
                        probe_body.map(lambda b: length_delimited(5, b)), unknown_field)
frame_bytes = st.one_of(st.lists(frame_field, max_size=4).map(b"".join),
                        update_body.map(lambda b: length_delimited(2, b)),
                        batch_body.map(lambda b: length_delimited(3, b)))
pb_updates = st.builds(pb.Update, seq=u64, round=u64, weight=st.floats(), scale=st.floats(),
                       algorithm=st.text(max_size=8), chunk_index=st.integers(0, 2 ** 32 - 1),
                       chunk_count=st.integers(0, 2 ** 32 - 1), total_length=u64, data=st.binary(max_size=64))
serialized_frames = st.one_of(
    pb_updates.map(lambda u: pb.GossipFrame(update=u).SerializeToString()),
    st.lists(pb_updates, max_size=MAX_WINDOW).map(
        lambda us: pb.GossipFrame(batch=pb.UpdateBatch(updates=us)).SerializeToString()),
)


@FUZZ
@given(serialized_frames)
def test_frames_protobuf_serializes_read_the_same(raw: bytes) -> None:
    assert check_against_protobuf(raw) is not None


@FUZZ
@given(frame_bytes)
def test_valid_frames_of_any_field_order_read_the_same(raw: bytes) -> None:
    """Duplicated fields (last wins, updates merge, batches concatenate), oneof switches and unknown fields of every
    valid wire type: read exactly as protobuf reads them."""
    pb.GossipFrame.FromString(raw)  # the strategy makes valid frames only
    assert check_against_protobuf(raw) is not None


@FUZZ
@given(st.binary(max_size=400))
@example(b"\x12\x02\x08")                             # an update whose varint is cut by the update's end
@example(b"\x1a\x03\x0a\x05\x08")                     # an update running past its batch
@example(b"\x12\x0b\x08" + b"\xff" * 9 + b"\x7f")    # a varint over 64 bits
@example(b"\x12\x02\x0a\x00")                         # seq (a varint) sent length-delimited
@example(b"\x12\x04\x5b\x08\x01\x5c")                 # an unknown group
@example(b"\x12\x03\x2a\x01\xff")                     # algorithm not UTF-8
@example(b"\x12\x08\x19" + bytes(7))                  # a double cut by the frame's end
@example(b"\x12\x08\x19" + bytes(7) + b"\x20\x01")    # ... by the update's end
@example(b"\x1a\x07\x0a\x03\x4a\x02\x00\x0a\x00")     # data cut by its update's end inside a batch
@example(b"\x12\x02\x4a\x01")                         # ... by the frame's end
@example(b"\x0a\x02\x00\x00\x12\x00")                 # a malformed Hello, replaced by an update
def test_random_bytes_read_the_same_or_are_refused(raw: bytes) -> None:
    check_against_protobuf(raw)


@st.composite
def mutated_frames(draw: st.DrawFn) -> bytes:
    raw = bytearray(draw(st.one_of(frame_bytes, serialized_frames)))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "insert", "delete", "truncate"]))
        at = draw(st.integers(0, len(raw)))
        if op == "flip" and at < len(raw):
            raw[at] = draw(st.integers(0, 255))
        elif op == "insert":
            raw[at:at] = draw(st.binary(min_size=1, max_size=11))
        elif op == "delete":
            del raw[at:at + draw(st.integers(1, 4))]
        else:
            del raw[at:]
    return bytes(raw)


@pytest.mark.parametrize("hexed", [
    "12050800880000",  # Update.seq twice, the second key as the two-byte varint 0x88 0x00 (a fuzz run found it)
    "120d8800009900000000000000f03f",  # seq and weight (1.0), each key in two bytes
    "1205ca8000017a",  # data "z" under the three-byte key 0xca 0x80 0x00
])
def test_known_update_fields_under_longer_keys_read_as_protobuf_reads_them(hexed: str) -> None:
    """A key is a varint, and one written in more bytes than it needs is still valid: protobuf reads the field,
    so the reader must too (it refused them as a wire-type mismatch)."""
    frame = check_against_protobuf(bytes.fromhex(hexed))
    assert frame is not None and frame.kind == "update"


@FUZZ
@given(mutated_frames())
def test_mutated_frames_read_the_same_or_are_refused(raw: bytes) -> None:
    check_against_protobuf(raw)


# --- the refusals, by name ------------------------------------------------------------------------------------
BAD = {
    # name: (bytes, does protobuf accept them, fragment of the reader's message)
    "truncated_varint": (b"\x12\x01\x08", False, "truncated varint"),
    "length_past_end": (b"\x12\x05\x08\x01", False, "past the end"),
    "data_past_update": (b"\x12\x03\x4a\x05\x00", False, "past the end"),
    "eleven_byte_varint": (b"\x12\x0c\x08" + b"\xff" * 10 + b"\x01", False, "longer than 10 bytes"),
    "varint_over_64_bits": (b"\x12\x0b\x08" + b"\xff" * 9 + b"\x02", True, "over 64 bits"),
    "six_byte_tag": (b"\x88\x80\x80\x80\x80\x00\x01", False, "tag too long"),
    "field_zero": (b"\x00\x01", False, "field number 0"),
    "wire_type_6": (b"\x12\x01\x0e", False, "invalid wire type"),
    "end_group_alone": (b"\x5c", False, "group"),
    "unknown_group": (b"\x5b\x08\x01\x5c", True, "group"),
    "seq_as_bytes": (b"\x12\x03\x0a\x01\x05", True, "wire type 2"),
    "data_as_varint": (b"\x12\x02\x48\x05", True, "wire type 0"),
    "weight_as_fixed32": (b"\x12\x05\x1d\x00\x00\x80\x3f", True, "wire type 5"),
    "update_as_varint": (b"\x10\x01", True, "wire type 0"),
    "batch_entry_as_varint": (b"\x1a\x02\x08\x01", True, "wire type 0"),
    "algorithm_not_utf8": (b"\x12\x04\x2a\x02\xc3\x28", False, "UTF-8"),
    "hello_malformed": (b"\x0a\x02\x0a\x05", False, "Hello"),
    "notice_malformed": (b"\x22\x02\x0a\x05", False, "QuarantineNotice"),
    "notice_as_varint": (b"\x20\x01", True, "wire type 0"),
    "probe_malformed": (b"\x2a\x02\x0a\x05", False, "ConsensusProbe"),
    "probe_as_varint": (b"\x28\x01", True, "wire type 0"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_malformed_frames_are_refused(case: str) -> None:
    raw, protobuf_accepts, fragment = BAD[case]
    try:
        pb.GossipFrame.FromString(raw)
        accepted = True
    except DecodeError:
        accepted = False
    assert accepted == protobuf_accepts
    with pytest.raises(frames.FrameError, match=fragment) as refused:
        frames.read_frame(raw)
    assert refused.value.reason == "malformed"
    check_against_protobuf(raw)


def test_a_batch_is_refused_at_its_65th_update() -> None:
    """Two million empty updates fit in a 4 MiB frame: the reader stops at the first one past the window."""
    entry = length_delimited(1, pb.Update(seq=7).SerializeToString())
    raw = length_delimited(3, entry * (MAX_WINDOW + 1))
    with pytest.raises(frames.FrameError, match=f"holds {MAX_WINDOW + 1} updates or more") as refused:
        frames.read_frame(raw)
    assert (refused.value.reason, refused.value.seq) == ("batch_size", 7)
    assert len(frames.read_frame(length_delimited(3, entry * MAX_WINDOW)).updates) == MAX_WINDOW
    huge = length_delimited(3, b"\x0a\x00" * 2_000_000)
    with pytest.raises(frames.FrameError, match="updates or more"):
        frames.read_frame(huge)


def test_merge_rules_match_protobuf() -> None:
    u1 = pb.Update(seq=1, round=2, data=b"aa").SerializeToString()
    u2 = pb.Update(round=5, data=b"bbb").SerializeToString()
    cases = [
        length_delimited(2, u1) + length_delimited(2, u2),                          # updates merge: round 5, bbb
        length_delimited(3, length_delimited(1, u1)) + length_delimited(3, length_delimited(1, u2)),  # concatenate
        length_delimited(2, u1) + length_delimited(3, length_delimited(1, u2)),     # the batch replaces the update
        length_delimited(2, u1) + length_delimited(3, b"") + length_delimited(2, u2),  # ... and back: u2 only
        length_delimited(3, length_delimited(1, u1)) + length_delimited(1, b""),    # a Hello replaces the batch
        b"", length_delimited(99, b"x"),                                              # no frame at all
    ]
    for raw in cases:
        assert check_against_protobuf(raw) is not None
    merged = frames.read_frame(cases[0]).update
    assert (merged.seq, merged.round, bytes(merged.data)) == (1, 5, b"bbb")
    assert frames.read_frame(cases[3]).update.seq == 0


def test_the_senders_frames_read_back_uncopied() -> None:
    """wire.update_frames' frames (what EdgeSender writes) read back to the same updates, payloads as slices."""
    class Out:
        def __init__(self, seq: int, payload: bytes) -> None:
            self.seq, self.round, self.weight, self.scale, self.payload = seq, 3, 0.25, 0.5, payload

    msgs = [Out(seq, bytes([seq]) * (100 * seq)) for seq in range(1, 6)] + [Out(6, b"y" * 5000)]
    got = []
    for _, encoded in wire.update_frames(msgs, "choco", chunk_bytes=2048, batch_bytes=4096):
        for raw in encoded:
            frame = check_against_protobuf(raw)
            got += [frame.update] if frame.kind == "update" else frame.updates
    assert [(u.seq, u.algorithm, u.weight, u.scale) for u in got if u.chunk_index == 0] == \
        [(m.seq, "choco", 0.25, 0.5) for m in msgs]
    assert b"".join(bytes(u.data) for u in got if u.seq == 6) == msgs[-1].payload
    assert not math.isnan(got[0].weight)


def test_reassembly_passes_one_chunk_uncopied_and_copies_what_it_holds() -> None:
    """A whole update's payload is the frame's slice itself; the chunks of a larger one are copied while held, so a
    partial update never pins (or sees later changes to) the buffers it arrived in."""
    whole = frames.read_frame(length_delimited(2, pb.Update(seq=1, chunk_count=1, total_length=3,
                                                            data=b"abc").SerializeToString())).update
    done = Reassembler(16, 64).feed(whole, whole.data)
    assert done is not None and done.payload is whole.data
    reassembler = Reassembler(16, 64)
    backing = bytearray(b"0123456789")
    first = pb.Update(seq=2, chunk_index=0, chunk_count=2, total_length=10)
    assert reassembler.feed(first, memoryview(backing)[:5]) is None
    backing[:5] = b"XXXXX"  # the caller's buffer changes after the chunk was taken
    last = pb.Update(seq=2, chunk_index=1, chunk_count=2, total_length=10)
    done = reassembler.feed(last, memoryview(backing)[5:])
    assert done is not None and bytes(done.payload) == b"0123456789"
    assert reassembler.partial is None and reassembler.buffered == 0
