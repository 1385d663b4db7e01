from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ClusterMember(_message.Message):
    __slots__ = ("address", "kind", "role", "state", "reason", "state_seq", "age_s", "client_address")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    STATE_SEQ_FIELD_NUMBER: _ClassVar[int]
    AGE_S_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    address: str
    kind: str
    role: str
    state: str
    reason: str
    state_seq: int
    age_s: float
    client_address: str
    def __init__(self, address: _Optional[str] = ..., kind: _Optional[str] = ..., role: _Optional[str] = ..., state: _Optional[str] = ..., reason: _Optional[str] = ..., state_seq: _Optional[int] = ..., age_s: _Optional[float] = ..., client_address: _Optional[str] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("address", "kind", "role", "client_address")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    address: str
    kind: str
    role: str
    client_address: str
    def __init__(self, address: _Optional[str] = ..., kind: _Optional[str] = ..., role: _Optional[str] = ..., client_address: _Optional[str] = ...) -> None: ...

class JoinResponse(_message.Message):
    __slots__ = ("version", "heartbeat_s")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_S_FIELD_NUMBER: _ClassVar[int]
    version: int
    heartbeat_s: float
    def __init__(self, version: _Optional[int] = ..., heartbeat_s: _Optional[float] = ...) -> None: ...

class SetMemberStateRequest(_message.Message):
    __slots__ = ("address", "state", "role", "reason")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    address: str
    state: str
    role: str
    reason: str
    def __init__(self, address: _Optional[str] = ..., state: _Optional[str] = ..., role: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class WatchMembersRequest(_message.Message):
    __slots__ = ("after_version", "epoch", "wait_s")
    AFTER_VERSION_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    after_version: int
    epoch: str
    wait_s: float
    def __init__(self, after_version: _Optional[int] = ..., epoch: _Optional[str] = ..., wait_s: _Optional[float] = ...) -> None: ...

class MembersView(_message.Message):
    __slots__ = ("epoch", "version", "members")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    epoch: str
    version: int
    members: _containers.RepeatedCompositeFieldContainer[ClusterMember]
    def __init__(self, epoch: _Optional[str] = ..., version: _Optional[int] = ..., members: _Optional[_Iterable[_Union[ClusterMember, _Mapping]]] = ...) -> None: ...
