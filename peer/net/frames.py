"""Strict reader of the sender's Gossip frames (GossipFrame with an Update or UpdateBatch, proto/lpdl/v1/peer.proto)
that hands each update's payload out as a memoryview slice of the received bytes (pure logic, no I/O).

Why: protobuf's parser copies every ``data`` field into the message, and each read of that field copies it again:
two copies of every payload byte on the receiving end of the hot path. This reader copies none; the server passes
the slices on to reassembly and the gate (the codec reads memoryviews). Hello, QuarantineNotice and ConsensusProbe
frames, rare, are still parsed by protobuf (their message only).

What it reads is protobuf's wire format, and for every frame protobuf parses, it reads either the same fields and
values as ``pb.GossipFrame.FromString`` (including its merge rules: a repeated singular field's last value wins, a
repeated ``update`` field merges into one Update, repeated ``batch`` fields concatenate their updates, a later field
of the oneof replaces an earlier one) or refuses the frame. It refuses everything protobuf refuses, and, on purpose,
a few encodings protobuf accepts that no protobuf serializer writes (tests/test_net_frames.py fuzzes both):
    - a known field with another wire type than its own (protobuf keeps it as an unknown field and reads the
      field as unset: a sender meaning one thing and a receiver reading another);
    - a varint holding more than 64 bits in its 10th byte (protobuf drops the excess bits);
    - group wire types (3, 4), deprecated and never used by this protocol (protobuf skips unknown groups);
    - an UpdateBatch of more than ledger.MAX_WINDOW updates, refused at the first update past the limit (the
      server refuses such a batch anyway; protobuf would parse all of them first - a 4 MiB frame holds up to two
      million empty updates - and a later oneof field could still replace the batch).
Unknown fields of the valid wire types (varint, 64-bit, length-delimited, 32-bit) are skipped, as protobuf does,
so a newer sender's additional fields do not break an older receiver. Non-minimal varints (up to 10 bytes) are
read as protobuf reads them. uint32 fields keep the low 32 bits of their varint, as protobuf does.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

from google.protobuf.message import DecodeError, Message

from peer.errors import PeerError
from peer.gossip.ledger import MAX_WINDOW
from peer.net.proto.lpdl.v1 import peer_pb2 as pb

_DOUBLE = struct.Struct("<d")
_UINT32 = 0xFFFFFFFF
_EMPTY = memoryview(b"")


class FrameError(PeerError, ValueError):
    """The frame is refused: ``reason`` is the server's counter key ("malformed", or "batch_size" for an
    UpdateBatch of more than MAX_WINDOW updates, whose first seq is ``seq``)."""

    def __init__(self, reason: str, message: str, seq: int = 0) -> None:
        super().__init__(message, reason=reason)
        self.seq = seq


class UpdateView:
    """One Update's fields as plain values; ``data`` is a read-only memoryview into the received frame (or an
    empty one). Same attribute names as pb.Update, so reassembly reads either. A field absent from the wire reads
    as its class default (protobuf's default), as on a message."""

    seq = 0
    round = 0
    weight = 0.0
    scale = 0.0
    algorithm = ""
    chunk_index = 0
    chunk_count = 0
    total_length = 0
    data: memoryview = _EMPTY

    def __repr__(self) -> str:
        return (f"UpdateView(seq={self.seq}, round={self.round}, weight={self.weight!r}, scale={self.scale!r}, "
                f"algorithm={self.algorithm!r}, chunk_index={self.chunk_index}, chunk_count={self.chunk_count}, "
                f"total_length={self.total_length}, data=<{len(self.data)} bytes>)")


@dataclass
class Frame:
    """A read GossipFrame: ``kind`` is "hello", "update", "batch", "notice", "probe" or None (no oneof field: an
    empty frame)."""

    kind: str | None = None
    hello: pb.Hello | None = None
    notice: pb.QuarantineNotice | None = None
    probe: pb.ConsensusProbe | None = None
    update: UpdateView | None = None
    updates: list[UpdateView] = field(default_factory=list)


#: The GossipFrame fields parsed by protobuf: field number -> (Frame.kind and attribute, message class).
_PARSED: dict[int, tuple[str, type[Message]]] = {1: ("hello", pb.Hello), 4: ("notice", pb.QuarantineNotice),
                                                 5: ("probe", pb.ConsensusProbe)}


def _merge_parsed(frame: Frame, kind: str, message: type[Message], data: bytes) -> Frame:
    """``frame`` with the oneof field ``kind`` merged from ``data`` (a field of another kind is replaced, the same
    one merges, as protobuf does)."""
    if frame.kind != kind:
        frame = Frame(kind=kind, **{kind: message()})
    try:
        getattr(frame, kind).MergeFromString(data)
    except DecodeError:
        raise _malformed(f"{message.__name__} is not a valid protobuf message") from None
    return frame


def _malformed(what: str) -> FrameError:
    return FrameError("malformed", what)


def _varint(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    """(value, position after it) of the varint at ``pos``: at most 10 bytes, at most 64 bits."""
    if pos + 3 <= end:  # lengths and offsets of up to 2 MiB: three bytes, unrolled
        byte = buf[pos]
        if byte < 0x80:
            return byte, pos + 1
        result = byte & 0x7F
        byte = buf[pos + 1]
        if byte < 0x80:
            return result | byte << 7, pos + 2
        result |= (byte & 0x7F) << 7
        byte = buf[pos + 2]
        if byte < 0x80:
            return result | byte << 14, pos + 3
    result = 0
    shift = 0
    while True:
        if pos >= end:
            raise _malformed("truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            break
        shift += 7
        if shift == 70:
            raise _malformed("varint longer than 10 bytes")
    if result >> 64:
        raise _malformed("varint over 64 bits")
    return result, pos


def _extent(buf: bytes, pos: int, end: int, what: str) -> tuple[int, int]:
    """(start, stop) of the length-delimited value whose length varint is at ``pos``; refused if it runs past
    ``end``."""
    length, pos = _varint(buf, pos, end)
    stop = pos + length
    if stop > end:
        raise _malformed(f"{what} runs past the end")
    return pos, stop


def _tag(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    """(tag, position after it): at most 5 bytes and 32 bits (protobuf's limits), field number >= 1."""
    byte = buf[pos]
    if byte < 0x80:
        tag, after = byte, pos + 1
    else:
        tag, after = _varint(buf, pos, end)
        if after - pos > 5 or tag > _UINT32:
            raise _malformed("field tag too long")
    if tag < 8:
        raise _malformed("field number 0")
    wire_type = tag & 7
    if wire_type > 5:
        raise _malformed(f"invalid wire type {wire_type}")
    if wire_type == 3 or wire_type == 4:
        raise _malformed("group wire type")
    return tag, after


def _skip(buf: bytes, pos: int, end: int, wire_type: int) -> int:
    """Position after an unknown field's value of ``wire_type`` starting at ``pos``."""
    if wire_type == 0:
        return _varint(buf, pos, end)[1]
    if wire_type == 1:
        pos += 8
    elif wire_type == 2:
        return _extent(buf, pos, end, "field")[1]
    else:  # 5 (_tag refused the others)
        pos += 4
    if pos > end:
        raise _malformed("field runs past the end")
    return pos


def _read_update(buf: bytes, view: memoryview, pos: int, end: int, update: UpdateView) -> None:
    """Merge the Update serialized in buf[pos:end] into ``update`` (fields present on the wire replace it).
    The keys of the known fields with their own wire types are dispatched inline (the hot path: every field the
    sender writes); a key is a varint, and one written in more bytes than it needs (valid protobuf) is read into
    the same one-byte value first; anything else goes through _update_field."""
    unpack_double = _DOUBLE.unpack_from
    while pos < end:
        start = pos
        key = buf[pos]
        if key < 0x80:
            pos += 1
        else:
            key, pos = _tag(buf, pos, end)
        if key == 0x4A or key == 0x2A:  # data (9), algorithm (5): length-delimited
            length = buf[pos] if pos < end else 0x80
            if length < 0x80:
                pos += 1
            else:
                length, pos = _varint(buf, pos, end)
            stop = pos + length
            if stop > end:
                raise _malformed("Update field runs past the end")
            if key == 0x4A:
                update.data = view[pos:stop]
            else:
                try:
                    update.algorithm = buf[pos:stop].decode("utf-8")
                except UnicodeDecodeError:
                    raise _malformed("Update.algorithm is not valid UTF-8") from None
            pos = stop
        elif key == 0x19 or key == 0x21:  # weight (3), scale (4): double
            pos += 8
            if pos > end:
                raise _malformed("truncated double")
            if key == 0x19:
                update.weight = unpack_double(buf, pos - 8)[0]
            else:
                update.scale = unpack_double(buf, pos - 8)[0]
        elif key in _VARINT_KEYS:  # seq 1, round 2, chunk_index 6, chunk_count 7, total_length 8
            value = buf[pos] if pos < end else 0x80
            if value < 0x80:
                pos += 1
            else:
                value, pos = _varint(buf, pos, end)
            setattr(update, _VARINT_KEYS[key], value if key < 0x30 or key == 0x40 else value & _UINT32)
        else:
            pos = _update_field(buf, start, end)


#: key (field << 3 | wire type 0) -> attribute of the Update's varint fields
_VARINT_KEYS = {0x08: "seq", 0x10: "round", 0x30: "chunk_index", 0x38: "chunk_count", 0x40: "total_length"}
#: wire type of each known Update field
_UPDATE_TYPES = {1: 0, 2: 0, 3: 1, 4: 1, 5: 2, 6: 0, 7: 0, 8: 0, 9: 2}


def _update_field(buf: bytes, pos: int, end: int) -> int:
    """Position after a field of an Update whose key (at ``pos``) is not that of a known field with its own wire
    type: an unknown field (skipped) or a refusal (a known field of another wire type, or a malformed key)."""
    tag, pos = _tag(buf, pos, end)
    number, wire_type = tag >> 3, tag & 7
    if number in _UPDATE_TYPES:  # its own wire type was dispatched by the caller, whatever the key's length
        raise _malformed(f"Update field {number} with wire type {wire_type}")
    return _skip(buf, pos, end, wire_type)


def _read_batch(buf: bytes, view: memoryview, pos: int, end: int, updates: list[UpdateView]) -> None:
    """Append the updates of the UpdateBatch serialized in buf[pos:end] to ``updates``."""
    while pos < end:
        tag, pos = _tag(buf, pos, end)
        if tag >> 3 != 1:
            pos = _skip(buf, pos, end, tag & 7)
            continue
        if tag & 7 != 2:
            raise _malformed(f"UpdateBatch field 1 with wire type {tag & 7}")
        pos, stop = _extent(buf, pos, end, "UpdateBatch.updates")
        if len(updates) == MAX_WINDOW:
            raise FrameError("batch_size", f"holds {MAX_WINDOW + 1} updates or more", updates[0].seq)
        update = UpdateView()
        _read_update(buf, view, pos, stop, update)
        updates.append(update)
        pos = stop


def read_frame(raw: bytes) -> Frame:
    """The GossipFrame serialized in ``raw`` (see the module's doc for what is refused).

    Raises:
        FrameError: malformed (reason "malformed") or an UpdateBatch of too many updates (reason "batch_size").
    """
    buf = raw if type(raw) is bytes else bytes(raw)
    view = memoryview(buf)
    end = len(buf)
    pos = 0
    frame = Frame()
    while pos < end:
        tag, pos = _tag(buf, pos, end)
        number, wire_type = tag >> 3, tag & 7
        if number > 5:
            pos = _skip(buf, pos, end, wire_type)
            continue
        if wire_type != 2:
            raise _malformed(f"GossipFrame field {number} with wire type {wire_type}")
        pos, stop = _extent(buf, pos, end, "GossipFrame field")
        if number == 2:
            if frame.kind != "update":  # a field of the oneof replaces another; the same one merges
                frame = Frame(kind="update", update=UpdateView())
            _read_update(buf, view, pos, stop, frame.update)  # type: ignore[arg-type]
        elif number == 3:
            if frame.kind != "batch":
                frame = Frame(kind="batch")
            _read_batch(buf, view, pos, stop, frame.updates)
        else:  # Hello, QuarantineNotice, ConsensusProbe: rare, parsed by protobuf at once, as protobuf parses them,
            # even if a later field of the oneof replaces them
            frame = _merge_parsed(frame, *_PARSED[number], buf[pos:stop])
        pos = stop
    return frame
