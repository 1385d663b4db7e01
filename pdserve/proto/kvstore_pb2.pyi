from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Plane(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PLANE_FULL: _ClassVar[Plane]
    PLANE_ANCHOR: _ClassVar[Plane]
    PLANE_RESIDUAL: _ClassVar[Plane]
PLANE_FULL: Plane
PLANE_ANCHOR: Plane
PLANE_RESIDUAL: Plane

class KvKey(_message.Message):
    __slots__ = ("model_id", "tenant_salt", "block_hash", "layer_start", "layer_end", "plane")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_SALT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    PLANE_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    tenant_salt: str
    block_hash: bytes
    layer_start: int
    layer_end: int
    plane: Plane
    def __init__(self, model_id: _Optional[str] = ..., tenant_salt: _Optional[str] = ..., block_hash: _Optional[bytes] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., plane: _Optional[_Union[Plane, str]] = ...) -> None: ...

class ObjectMeta(_message.Message):
    __slots__ = ("dtype", "shape", "checksum")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    checksum: int
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., checksum: _Optional[int] = ...) -> None: ...

class PutRequest(_message.Message):
    __slots__ = ("key", "data", "meta")
    KEY_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    META_FIELD_NUMBER: _ClassVar[int]
    key: str
    data: bytes
    meta: ObjectMeta
    def __init__(self, key: _Optional[str] = ..., data: _Optional[bytes] = ..., meta: _Optional[_Union[ObjectMeta, _Mapping]] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("evicted_objects",)
    EVICTED_OBJECTS_FIELD_NUMBER: _ClassVar[int]
    evicted_objects: int
    def __init__(self, evicted_objects: _Optional[int] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: str
    def __init__(self, key: _Optional[str] = ...) -> None: ...

class GetResponse(_message.Message):
    __slots__ = ("key", "found", "data", "meta")
    KEY_FIELD_NUMBER: _ClassVar[int]
    FOUND_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    META_FIELD_NUMBER: _ClassVar[int]
    key: str
    found: bool
    data: bytes
    meta: ObjectMeta
    def __init__(self, key: _Optional[str] = ..., found: _Optional[bool] = ..., data: _Optional[bytes] = ..., meta: _Optional[_Union[ObjectMeta, _Mapping]] = ...) -> None: ...

class BatchGetRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, keys: _Optional[_Iterable[str]] = ...) -> None: ...

class ExistsRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, keys: _Optional[_Iterable[str]] = ...) -> None: ...

class ExistsResponse(_message.Message):
    __slots__ = ("exists",)
    EXISTS_FIELD_NUMBER: _ClassVar[int]
    exists: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, exists: _Optional[_Iterable[bool]] = ...) -> None: ...

class RemoveRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: str
    def __init__(self, key: _Optional[str] = ...) -> None: ...

class RemoveResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class StoreStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StoreStats(_message.Message):
    __slots__ = ("object_count", "used_bytes", "capacity_bytes", "puts", "gets", "hits", "misses", "evictions")
    OBJECT_COUNT_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    PUTS_FIELD_NUMBER: _ClassVar[int]
    GETS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    object_count: int
    used_bytes: int
    capacity_bytes: int
    puts: int
    gets: int
    hits: int
    misses: int
    evictions: int
    def __init__(self, object_count: _Optional[int] = ..., used_bytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., puts: _Optional[int] = ..., gets: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., evictions: _Optional[int] = ...) -> None: ...
