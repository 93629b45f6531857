from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RefusalCode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REFUSAL_UNSPECIFIED: _ClassVar[RefusalCode]
    REFUSAL_PROTOCOL: _ClassVar[RefusalCode]
    REFUSAL_FINGERPRINT: _ClassVar[RefusalCode]
    REFUSAL_FLEET: _ClassVar[RefusalCode]
    REFUSAL_SELF: _ClassVar[RefusalCode]
    REFUSAL_WRONG_RECEIVER: _ClassVar[RefusalCode]
    REFUSAL_ALGORITHM: _ClassVar[RefusalCode]
    REFUSAL_BAD_FRAME: _ClassVar[RefusalCode]
    REFUSAL_BAD_CHUNK: _ClassVar[RefusalCode]
    REFUSAL_BAD_SEQ: _ClassVar[RefusalCode]
    REFUSAL_BAD_UPDATE: _ClassVar[RefusalCode]
    REFUSAL_SUPERSEDED: _ClassVar[RefusalCode]
    REFUSAL_NOT_READY: _ClassVar[RefusalCode]
    REFUSAL_UNAUTHENTICATED: _ClassVar[RefusalCode]
    REFUSAL_LIMIT: _ClassVar[RefusalCode]
REFUSAL_UNSPECIFIED: RefusalCode
REFUSAL_PROTOCOL: RefusalCode
REFUSAL_FINGERPRINT: RefusalCode
REFUSAL_FLEET: RefusalCode
REFUSAL_SELF: RefusalCode
REFUSAL_WRONG_RECEIVER: RefusalCode
REFUSAL_ALGORITHM: RefusalCode
REFUSAL_BAD_FRAME: RefusalCode
REFUSAL_BAD_CHUNK: RefusalCode
REFUSAL_BAD_SEQ: RefusalCode
REFUSAL_BAD_UPDATE: RefusalCode
REFUSAL_SUPERSEDED: RefusalCode
REFUSAL_NOT_READY: RefusalCode
REFUSAL_UNAUTHENTICATED: RefusalCode
REFUSAL_LIMIT: RefusalCode

class PeerIdentity(_message.Message):
    __slots__ = ("peer_id", "protocol_version", "fingerprint", "fleet", "listen_addr", "algorithm")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    FLEET_FIELD_NUMBER: _ClassVar[int]
    LISTEN_ADDR_FIELD_NUMBER: _ClassVar[int]
    ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    protocol_version: int
    fingerprint: str
    fleet: str
    listen_addr: str
    algorithm: str
    def __init__(self, peer_id: _Optional[str] = ..., protocol_version: _Optional[int] = ..., fingerprint: _Optional[str] = ..., fleet: _Optional[str] = ..., listen_addr: _Optional[str] = ..., algorithm: _Optional[str] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("sender", "receiver_id", "next_seq", "first_in_flight", "replica_digests")
    SENDER_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_ID_FIELD_NUMBER: _ClassVar[int]
    NEXT_SEQ_FIELD_NUMBER: _ClassVar[int]
    FIRST_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    REPLICA_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    sender: PeerIdentity
    receiver_id: str
    next_seq: int
    first_in_flight: int
    replica_digests: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, sender: _Optional[_Union[PeerIdentity, _Mapping]] = ..., receiver_id: _Optional[str] = ..., next_seq: _Optional[int] = ..., first_in_flight: _Optional[int] = ..., replica_digests: _Optional[_Iterable[bytes]] = ...) -> None: ...

class HelloReply(_message.Message):
    __slots__ = ("last_applied", "fence", "reset", "receiver")
    LAST_APPLIED_FIELD_NUMBER: _ClassVar[int]
    FENCE_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_FIELD_NUMBER: _ClassVar[int]
    last_applied: int
    fence: int
    reset: bool
    receiver: PeerIdentity
    def __init__(self, last_applied: _Optional[int] = ..., fence: _Optional[int] = ..., reset: _Optional[bool] = ..., receiver: _Optional[_Union[PeerIdentity, _Mapping]] = ...) -> None: ...

class Update(_message.Message):
    __slots__ = ("seq", "round", "weight", "scale", "algorithm", "chunk_index", "chunk_count", "total_length", "data")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    CHUNK_COUNT_FIELD_NUMBER: _ClassVar[int]
    TOTAL_LENGTH_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    seq: int
    round: int
    weight: float
    scale: float
    algorithm: str
    chunk_index: int
    chunk_count: int
    total_length: int
    data: bytes
    def __init__(self, seq: _Optional[int] = ..., round: _Optional[int] = ..., weight: _Optional[float] = ..., scale: _Optional[float] = ..., algorithm: _Optional[str] = ..., chunk_index: _Optional[int] = ..., chunk_count: _Optional[int] = ..., total_length: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class GossipFrame(_message.Message):
    __slots__ = ("hello", "update", "batch", "notice", "probe")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    UPDATE_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    NOTICE_FIELD_NUMBER: _ClassVar[int]
    PROBE_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    update: Update
    batch: UpdateBatch
    notice: QuarantineNotice
    probe: ConsensusProbe
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., update: _Optional[_Union[Update, _Mapping]] = ..., batch: _Optional[_Union[UpdateBatch, _Mapping]] = ..., notice: _Optional[_Union[QuarantineNotice, _Mapping]] = ..., probe: _Optional[_Union[ConsensusProbe, _Mapping]] = ...) -> None: ...

class QuarantineNotice(_message.Message):
    __slots__ = ("quarantined",)
    QUARANTINED_FIELD_NUMBER: _ClassVar[int]
    quarantined: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, quarantined: _Optional[_Iterable[str]] = ...) -> None: ...

class ConsensusProbe(_message.Message):
    __slots__ = ("sketch", "round")
    SKETCH_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    sketch: bytes
    round: int
    def __init__(self, sketch: _Optional[bytes] = ..., round: _Optional[int] = ...) -> None: ...

class UpdateBatch(_message.Message):
    __slots__ = ("updates",)
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    updates: _containers.RepeatedCompositeFieldContainer[Update]
    def __init__(self, updates: _Optional[_Iterable[_Union[Update, _Mapping]]] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ("seq", "applied")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    seq: int
    applied: bool
    def __init__(self, seq: _Optional[int] = ..., applied: _Optional[bool] = ...) -> None: ...

class Refusal(_message.Message):
    __slots__ = ("code", "reason", "message", "seq")
    CODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    code: RefusalCode
    reason: str
    message: str
    seq: int
    def __init__(self, code: _Optional[_Union[RefusalCode, str]] = ..., reason: _Optional[str] = ..., message: _Optional[str] = ..., seq: _Optional[int] = ...) -> None: ...

class GossipReply(_message.Message):
    __slots__ = ("hello_reply", "ack", "refusal")
    HELLO_REPLY_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    REFUSAL_FIELD_NUMBER: _ClassVar[int]
    hello_reply: HelloReply
    ack: Ack
    refusal: Refusal
    def __init__(self, hello_reply: _Optional[_Union[HelloReply, _Mapping]] = ..., ack: _Optional[_Union[Ack, _Mapping]] = ..., refusal: _Optional[_Union[Refusal, _Mapping]] = ...) -> None: ...

class GetModelRequest(_message.Message):
    __slots__ = ("fingerprint", "requester_id")
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    REQUESTER_ID_FIELD_NUMBER: _ClassVar[int]
    fingerprint: str
    requester_id: str
    def __init__(self, fingerprint: _Optional[str] = ..., requester_id: _Optional[str] = ...) -> None: ...

class ModelChunk(_message.Message):
    __slots__ = ("fingerprint", "total_length", "data")
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TOTAL_LENGTH_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    fingerprint: str
    total_length: int
    data: bytes
    def __init__(self, fingerprint: _Optional[str] = ..., total_length: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class IdentifyRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("json",)
    JSON_FIELD_NUMBER: _ClassVar[int]
    json: str
    def __init__(self, json: _Optional[str] = ...) -> None: ...
