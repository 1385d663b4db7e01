from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Placement(_message.Message):
    __slots__ = ("node_id", "host_id", "data_address", "segment_id", "shm_path", "offset_bytes", "size_bytes", "tier", "ucx_address")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    SHM_PATH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    UCX_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    host_id: str
    data_address: str
    segment_id: str
    shm_path: str
    offset_bytes: int
    size_bytes: int
    tier: str
    ucx_address: str
    def __init__(self, node_id: _Optional[str] = ..., host_id: _Optional[str] = ..., data_address: _Optional[str] = ..., segment_id: _Optional[str] = ..., shm_path: _Optional[str] = ..., offset_bytes: _Optional[int] = ..., size_bytes: _Optional[int] = ..., tier: _Optional[str] = ..., ucx_address: _Optional[str] = ...) -> None: ...

class SegmentInfo(_message.Message):
    __slots__ = ("segment_id", "size_bytes", "tier", "shm_path")
    SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    SHM_PATH_FIELD_NUMBER: _ClassVar[int]
    segment_id: str
    size_bytes: int
    tier: str
    shm_path: str
    def __init__(self, segment_id: _Optional[str] = ..., size_bytes: _Optional[int] = ..., tier: _Optional[str] = ..., shm_path: _Optional[str] = ...) -> None: ...

class RegisterNodeRequest(_message.Message):
    __slots__ = ("node_id", "host_id", "data_address", "segments", "ucx_address")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    UCX_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    host_id: str
    data_address: str
    segments: _containers.RepeatedCompositeFieldContainer[SegmentInfo]
    ucx_address: str
    def __init__(self, node_id: _Optional[str] = ..., host_id: _Optional[str] = ..., data_address: _Optional[str] = ..., segments: _Optional[_Iterable[_Union[SegmentInfo, _Mapping]]] = ..., ucx_address: _Optional[str] = ...) -> None: ...

class RegisterNodeResponse(_message.Message):
    __slots__ = ("heartbeat_interval_s",)
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    heartbeat_interval_s: float
    def __init__(self, heartbeat_interval_s: _Optional[float] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("node_id",)
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    def __init__(self, node_id: _Optional[str] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: _Optional[bool] = ...) -> None: ...

class PutStartRequest(_message.Message):
    __slots__ = ("key", "size_bytes", "checksum", "replicas")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    key: str
    size_bytes: int
    checksum: int
    replicas: int
    def __init__(self, key: _Optional[str] = ..., size_bytes: _Optional[int] = ..., checksum: _Optional[int] = ..., replicas: _Optional[int] = ...) -> None: ...

class PutStartResponse(_message.Message):
    __slots__ = ("placements", "already_exists")
    PLACEMENTS_FIELD_NUMBER: _ClassVar[int]
    ALREADY_EXISTS_FIELD_NUMBER: _ClassVar[int]
    placements: _containers.RepeatedCompositeFieldContainer[Placement]
    already_exists: bool
    def __init__(self, placements: _Optional[_Iterable[_Union[Placement, _Mapping]]] = ..., already_exists: _Optional[bool] = ...) -> None: ...

class PutCommitRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: str
    def __init__(self, key: _Optional[str] = ...) -> None: ...

class PutCommitResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BatchPutStartRequest(_message.Message):
    __slots__ = ("puts",)
    PUTS_FIELD_NUMBER: _ClassVar[int]
    puts: _containers.RepeatedCompositeFieldContainer[PutStartRequest]
    def __init__(self, puts: _Optional[_Iterable[_Union[PutStartRequest, _Mapping]]] = ...) -> None: ...

class BatchPutStartResponse(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[PutStartItem]
    def __init__(self, items: _Optional[_Iterable[_Union[PutStartItem, _Mapping]]] = ...) -> None: ...

class PutStartItem(_message.Message):
    __slots__ = ("outcome", "placements", "error")
    class Outcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STARTED: _ClassVar[PutStartItem.Outcome]
        ALREADY_EXISTS: _ClassVar[PutStartItem.Outcome]
        IN_PROGRESS: _ClassVar[PutStartItem.Outcome]
        NO_SPACE: _ClassVar[PutStartItem.Outcome]
        INVALID: _ClassVar[PutStartItem.Outcome]
    STARTED: PutStartItem.Outcome
    ALREADY_EXISTS: PutStartItem.Outcome
    IN_PROGRESS: PutStartItem.Outcome
    NO_SPACE: PutStartItem.Outcome
    INVALID: PutStartItem.Outcome
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    PLACEMENTS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    outcome: PutStartItem.Outcome
    placements: _containers.RepeatedCompositeFieldContainer[Placement]
    error: str
    def __init__(self, outcome: _Optional[_Union[PutStartItem.Outcome, str]] = ..., placements: _Optional[_Iterable[_Union[Placement, _Mapping]]] = ..., error: _Optional[str] = ...) -> None: ...

class BatchPutCommitRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, keys: _Optional[_Iterable[str]] = ...) -> None: ...

class BatchPutCommitResponse(_message.Message):
    __slots__ = ("failed_keys", "errors")
    FAILED_KEYS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    failed_keys: _containers.RepeatedScalarFieldContainer[str]
    errors: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, failed_keys: _Optional[_Iterable[str]] = ..., errors: _Optional[_Iterable[str]] = ...) -> None: ...

class PutAbortRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: str
    def __init__(self, key: _Optional[str] = ...) -> None: ...

class PutAbortResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ObjectInfo(_message.Message):
    __slots__ = ("key", "found", "size_bytes", "checksum", "replicas", "lease_s")
    KEY_FIELD_NUMBER: _ClassVar[int]
    FOUND_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    key: str
    found: bool
    size_bytes: int
    checksum: int
    replicas: _containers.RepeatedCompositeFieldContainer[Placement]
    lease_s: float
    def __init__(self, key: _Optional[str] = ..., found: _Optional[bool] = ..., size_bytes: _Optional[int] = ..., checksum: _Optional[int] = ..., replicas: _Optional[_Iterable[_Union[Placement, _Mapping]]] = ..., lease_s: _Optional[float] = ...) -> None: ...

class MasterGetRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, keys: _Optional[_Iterable[str]] = ...) -> None: ...

class MasterGetResponse(_message.Message):
    __slots__ = ("objects",)
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    objects: _containers.RepeatedCompositeFieldContainer[ObjectInfo]
    def __init__(self, objects: _Optional[_Iterable[_Union[ObjectInfo, _Mapping]]] = ...) -> None: ...

class MasterExistsRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, keys: _Optional[_Iterable[str]] = ...) -> None: ...

class MasterExistsResponse(_message.Message):
    __slots__ = ("exists",)
    EXISTS_FIELD_NUMBER: _ClassVar[int]
    exists: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, exists: _Optional[_Iterable[bool]] = ...) -> None: ...

class MasterRemoveRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: str
    def __init__(self, key: _Optional[str] = ...) -> None: ...

class MasterRemoveResponse(_message.Message):
    __slots__ = ("removed",)
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    removed: bool
    def __init__(self, removed: _Optional[bool] = ...) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("key", "ttl_s")
    KEY_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    key: str
    ttl_s: float
    def __init__(self, key: _Optional[str] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class PinResponse(_message.Message):
    __slots__ = ("pinned",)
    PINNED_FIELD_NUMBER: _ClassVar[int]
    pinned: bool
    def __init__(self, pinned: _Optional[bool] = ...) -> None: ...

class LongestPrefixRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, keys: _Optional[_Iterable[str]] = ...) -> None: ...

class ReplicaList(_message.Message):
    __slots__ = ("replicas",)
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    replicas: _containers.RepeatedCompositeFieldContainer[Placement]
    def __init__(self, replicas: _Optional[_Iterable[_Union[Placement, _Mapping]]] = ...) -> None: ...

class LongestPrefixResponse(_message.Message):
    __slots__ = ("cached_blocks", "locations")
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LOCATIONS_FIELD_NUMBER: _ClassVar[int]
    cached_blocks: int
    locations: _containers.RepeatedCompositeFieldContainer[ReplicaList]
    def __init__(self, cached_blocks: _Optional[int] = ..., locations: _Optional[_Iterable[_Union[ReplicaList, _Mapping]]] = ...) -> None: ...

class ReportCorruptRequest(_message.Message):
    __slots__ = ("key", "node_id")
    KEY_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    key: str
    node_id: str
    def __init__(self, key: _Optional[str] = ..., node_id: _Optional[str] = ...) -> None: ...

class ReportCorruptResponse(_message.Message):
    __slots__ = ("replicas_left",)
    REPLICAS_LEFT_FIELD_NUMBER: _ClassVar[int]
    replicas_left: int
    def __init__(self, replicas_left: _Optional[int] = ...) -> None: ...

class WatchEventsRequest(_message.Message):
    __slots__ = ("after_seq",)
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    after_seq: int
    def __init__(self, after_seq: _Optional[int] = ...) -> None: ...

class StoreEvent(_message.Message):
    __slots__ = ("seq", "kind", "key", "node_ids", "reason")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    seq: int
    kind: str
    key: str
    node_ids: _containers.RepeatedScalarFieldContainer[str]
    reason: str
    def __init__(self, seq: _Optional[int] = ..., kind: _Optional[str] = ..., key: _Optional[str] = ..., node_ids: _Optional[_Iterable[str]] = ..., reason: _Optional[str] = ...) -> None: ...

class GetLeaderRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetLeaderResponse(_message.Message):
    __slots__ = ("leader_address", "is_leader", "cluster_id")
    LEADER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    IS_LEADER_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_ID_FIELD_NUMBER: _ClassVar[int]
    leader_address: str
    is_leader: bool
    cluster_id: str
    def __init__(self, leader_address: _Optional[str] = ..., is_leader: _Optional[bool] = ..., cluster_id: _Optional[str] = ...) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("tier", "capacity_bytes", "used_bytes", "objects", "evictions")
    TIER_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    tier: str
    capacity_bytes: int
    used_bytes: int
    objects: int
    evictions: int
    def __init__(self, tier: _Optional[str] = ..., capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., objects: _Optional[int] = ..., evictions: _Optional[int] = ...) -> None: ...

class MasterStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MasterStatsResponse(_message.Message):
    __slots__ = ("tiers", "pending_puts", "nodes_alive", "cluster_id", "methods")
    TIERS_FIELD_NUMBER: _ClassVar[int]
    PENDING_PUTS_FIELD_NUMBER: _ClassVar[int]
    NODES_ALIVE_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_ID_FIELD_NUMBER: _ClassVar[int]
    METHODS_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    pending_puts: int
    nodes_alive: int
    cluster_id: str
    methods: _containers.RepeatedCompositeFieldContainer[MethodCalls]
    def __init__(self, tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., pending_puts: _Optional[int] = ..., nodes_alive: _Optional[int] = ..., cluster_id: _Optional[str] = ..., methods: _Optional[_Iterable[_Union[MethodCalls, _Mapping]]] = ...) -> None: ...

class MethodCalls(_message.Message):
    __slots__ = ("method", "calls", "bounds_s", "cumulative", "seconds")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    BOUNDS_S_FIELD_NUMBER: _ClassVar[int]
    CUMULATIVE_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    method: str
    calls: int
    bounds_s: _containers.RepeatedScalarFieldContainer[float]
    cumulative: _containers.RepeatedScalarFieldContainer[int]
    seconds: float
    def __init__(self, method: _Optional[str] = ..., calls: _Optional[int] = ..., bounds_s: _Optional[_Iterable[float]] = ..., cumulative: _Optional[_Iterable[int]] = ..., seconds: _Optional[float] = ...) -> None: ...
