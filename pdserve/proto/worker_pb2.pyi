from pdserve.proto import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_PREFILL: _ClassVar[Role]
    ROLE_DECODE: _ClassVar[Role]

class KvEventKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_EVENT_KIND_UNSPECIFIED: _ClassVar[KvEventKind]
    KV_EVENT_KIND_STORED: _ClassVar[KvEventKind]
    KV_EVENT_KIND_REMOVED: _ClassVar[KvEventKind]
ROLE_UNSPECIFIED: Role
ROLE_PREFILL: Role
ROLE_DECODE: Role
KV_EVENT_KIND_UNSPECIFIED: KvEventKind
KV_EVENT_KIND_STORED: KvEventKind
KV_EVENT_KIND_REMOVED: KvEventKind

class KvHandle(_message.Message):
    __slots__ = ("model_id", "tenant_salt", "block_size_tokens", "num_tokens", "block_hashes", "keys", "store_address", "stream_id", "span_starts", "span_ends", "num_layers", "kv_dtype")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_SALT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    STORE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    SPAN_STARTS_FIELD_NUMBER: _ClassVar[int]
    SPAN_ENDS_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    tenant_salt: str
    block_size_tokens: int
    num_tokens: int
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    keys: _containers.RepeatedScalarFieldContainer[str]
    store_address: str
    stream_id: str
    span_starts: _containers.RepeatedScalarFieldContainer[int]
    span_ends: _containers.RepeatedScalarFieldContainer[int]
    num_layers: int
    kv_dtype: str
    def __init__(self, model_id: _Optional[str] = ..., tenant_salt: _Optional[str] = ..., block_size_tokens: _Optional[int] = ..., num_tokens: _Optional[int] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., keys: _Optional[_Iterable[str]] = ..., store_address: _Optional[str] = ..., stream_id: _Optional[str] = ..., span_starts: _Optional[_Iterable[int]] = ..., span_ends: _Optional[_Iterable[int]] = ..., num_layers: _Optional[int] = ..., kv_dtype: _Optional[str] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "tenant_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TENANT_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    tenant_salt: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., tenant_salt: _Optional[str] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("request_id", "first_token_id", "finish_reason", "kv", "num_cached_tokens", "first_logprobs", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_token_id: int
    finish_reason: _common_pb2.FinishReason
    kv: KvHandle
    num_cached_tokens: int
    first_logprobs: _common_pb2.TokenLogprobs
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    def __init__(self, request_id: _Optional[str] = ..., first_token_id: _Optional[int] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., kv: _Optional[_Union[KvHandle, _Mapping]] = ..., num_cached_tokens: _Optional[int] = ..., first_logprobs: _Optional[_Union[_common_pb2.TokenLogprobs, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "first_token_id", "sampling", "kv", "prefill_locally", "prefill_chunk_tokens", "resume_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    PREFILL_LOCALLY_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    first_token_id: int
    sampling: _common_pb2.SamplingParams
    kv: KvHandle
    prefill_locally: bool
    prefill_chunk_tokens: int
    resume_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., first_token_id: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., kv: _Optional[_Union[KvHandle, _Mapping]] = ..., prefill_locally: _Optional[bool] = ..., prefill_chunk_tokens: _Optional[int] = ..., resume_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("token_ids", "finish_reason", "logprobs", "made_unix_s", "prompt_logprobs", "moved")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MADE_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MOVED_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: _common_pb2.FinishReason
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    made_unix_s: float
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    moved: bool
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., made_unix_s: _Optional[float] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., moved: _Optional[bool] = ...) -> None: ...

class DecodeManyRequest(_message.Message):
    __slots__ = ("start", "cancel_request_id")
    START_FIELD_NUMBER: _ClassVar[int]
    CANCEL_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    start: DecodeRequest
    cancel_request_id: str
    def __init__(self, start: _Optional[_Union[DecodeRequest, _Mapping]] = ..., cancel_request_id: _Optional[str] = ...) -> None: ...

class DecodeEvent(_message.Message):
    __slots__ = ("request_id", "chunk", "status_code", "status_details")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    STATUS_CODE_FIELD_NUMBER: _ClassVar[int]
    STATUS_DETAILS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    chunk: DecodeResponse
    status_code: int
    status_details: str
    def __init__(self, request_id: _Optional[str] = ..., chunk: _Optional[_Union[DecodeResponse, _Mapping]] = ..., status_code: _Optional[int] = ..., status_details: _Optional[str] = ...) -> None: ...

class DecodeManyResponse(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[DecodeEvent]
    def __init__(self, events: _Optional[_Iterable[_Union[DecodeEvent, _Mapping]]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class SetRoleRequest(_message.Message):
    __slots__ = ("role", "drain", "drain_timeout_s", "migrate")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    DRAIN_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    MIGRATE_FIELD_NUMBER: _ClassVar[int]
    role: Role
    drain: bool
    drain_timeout_s: float
    migrate: bool
    def __init__(self, role: _Optional[_Union[Role, str]] = ..., drain: _Optional[bool] = ..., drain_timeout_s: _Optional[float] = ..., migrate: _Optional[bool] = ...) -> None: ...

class MigrateRequest(_message.Message):
    __slots__ = ("count", "reason")
    COUNT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    count: int
    reason: str
    def __init__(self, count: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class MigrateResponse(_message.Message):
    __slots__ = ("moved_requests", "copied_requests")
    MOVED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    COPIED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    moved_requests: int
    copied_requests: int
    def __init__(self, moved_requests: _Optional[int] = ..., copied_requests: _Optional[int] = ...) -> None: ...

class SetRoleResponse(_message.Message):
    __slots__ = ("previous_role", "role", "drained_requests", "moved_requests")
    PREVIOUS_ROLE_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    DRAINED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MOVED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    previous_role: Role
    role: Role
    drained_requests: int
    moved_requests: int
    def __init__(self, previous_role: _Optional[_Union[Role, str]] = ..., role: _Optional[_Union[Role, str]] = ..., drained_requests: _Optional[int] = ..., moved_requests: _Optional[int] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("role", "model_id", "num_running", "num_waiting", "num_free_blocks", "num_total_blocks", "prefix_cache_queries_tokens", "prefix_cache_hits_tokens", "kv_blocks_put", "kv_blocks_fetched", "kv_blocks_local_hits", "requests_finished", "role_switches", "weight_loads", "kv_blocks_from_store", "kv_store_reads_by_transport", "spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens_per_pos", "progressive_requests", "progressive_anchor_joins", "progressive_exact_joins", "progressive_fallbacks", "anchor_num_drafts", "anchor_num_draft_tokens", "anchor_num_accepted_tokens", "kv_stream_layers_put", "kv_stream_fallbacks", "kv_stream_put_failures", "prompt_tokens_computed", "busy_seconds", "decode_steps", "decode_step_seconds", "local_prefill_requests", "local_prefill_tokens", "draining", "store_degraded", "store_degraded_reason", "store_errors", "kv_recomputed_requests", "migrations", "migration_bytes", "resumed_tokens_computed")
    class KvStoreReadsByTransportEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class StoreErrorsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class MigrationsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_PUT_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FETCHED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_LOCAL_HITS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FINISHED_FIELD_NUMBER: _ClassVar[int]
    ROLE_SWITCHES_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_LOADS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FROM_STORE_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_READS_BY_TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_NUM_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_NUM_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS_FIELD_NUMBER: _ClassVar[int]
    PROGRESSIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PROGRESSIVE_ANCHOR_JOINS_FIELD_NUMBER: _ClassVar[int]
    PROGRESSIVE_EXACT_JOINS_FIELD_NUMBER: _ClassVar[int]
    PROGRESSIVE_FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    ANCHOR_NUM_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    ANCHOR_NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ANCHOR_NUM_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_STREAM_LAYERS_PUT_FIELD_NUMBER: _ClassVar[int]
    KV_STREAM_FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    KV_STREAM_PUT_FAILURES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_COMPUTED_FIELD_NUMBER: _ClassVar[int]
    BUSY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEPS_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILL_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    STORE_DEGRADED_FIELD_NUMBER: _ClassVar[int]
    STORE_DEGRADED_REASON_FIELD_NUMBER: _ClassVar[int]
    STORE_ERRORS_FIELD_NUMBER: _ClassVar[int]
    KV_RECOMPUTED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MIGRATIONS_FIELD_NUMBER: _ClassVar[int]
    MIGRATION_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESUMED_TOKENS_COMPUTED_FIELD_NUMBER: _ClassVar[int]
    role: Role
    model_id: str
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    prefix_cache_queries_tokens: int
    prefix_cache_hits_tokens: int
    kv_blocks_put: int
    kv_blocks_fetched: int
    kv_blocks_local_hits: int
    requests_finished: int
    role_switches: int
    weight_loads: int
    kv_blocks_from_store: int
    kv_store_reads_by_transport: _containers.ScalarMap[str, int]
    spec_decode_num_drafts: int
    spec_decode_num_draft_tokens: int
    spec_decode_num_accepted_tokens: int
    spec_decode_num_accepted_tokens_per_pos: _containers.RepeatedScalarFieldContainer[int]
    progressive_requests: int
    progressive_anchor_joins: int
    progressive_exact_joins: int
    progressive_fallbacks: int
    anchor_num_drafts: int
    anchor_num_draft_tokens: int
    anchor_num_accepted_tokens: int
    kv_stream_layers_put: int
    kv_stream_fallbacks: int
    kv_stream_put_failures: int
    prompt_tokens_computed: int
    busy_seconds: float
    decode_steps: int
    decode_step_seconds: float
    local_prefill_requests: int
    local_prefill_tokens: int
    draining: bool
    store_degraded: bool
    store_degraded_reason: str
    store_errors: _containers.ScalarMap[str, int]
    kv_recomputed_requests: int
    migrations: _containers.ScalarMap[str, int]
    migration_bytes: int
    resumed_tokens_computed: int
    def __init__(self, role: _Optional[_Union[Role, str]] = ..., model_id: _Optional[str] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., prefix_cache_queries_tokens: _Optional[int] = ..., prefix_cache_hits_tokens: _Optional[int] = ..., kv_blocks_put: _Optional[int] = ..., kv_blocks_fetched: _Optional[int] = ..., kv_blocks_local_hits: _Optional[int] = ..., requests_finished: _Optional[int] = ..., role_switches: _Optional[int] = ..., weight_loads: _Optional[int] = ..., kv_blocks_from_store: _Optional[int] = ..., kv_store_reads_by_transport: _Optional[_Mapping[str, int]] = ..., spec_decode_num_drafts: _Optional[int] = ..., spec_decode_num_draft_tokens: _Optional[int] = ..., spec_decode_num_accepted_tokens: _Optional[int] = ..., spec_decode_num_accepted_tokens_per_pos: _Optional[_Iterable[int]] = ..., progressive_requests: _Optional[int] = ..., progressive_anchor_joins: _Optional[int] = ..., progressive_exact_joins: _Optional[int] = ..., progressive_fallbacks: _Optional[int] = ..., anchor_num_drafts: _Optional[int] = ..., anchor_num_draft_tokens: _Optional[int] = ..., anchor_num_accepted_tokens: _Optional[int] = ..., kv_stream_layers_put: _Optional[int] = ..., kv_stream_fallbacks: _Optional[int] = ..., kv_stream_put_failures: _Optional[int] = ..., prompt_tokens_computed: _Optional[int] = ..., busy_seconds: _Optional[float] = ..., decode_steps: _Optional[int] = ..., decode_step_seconds: _Optional[float] = ..., local_prefill_requests: _Optional[int] = ..., local_prefill_tokens: _Optional[int] = ..., draining: _Optional[bool] = ..., store_degraded: _Optional[bool] = ..., store_degraded_reason: _Optional[str] = ..., store_errors: _Optional[_Mapping[str, int]] = ..., kv_recomputed_requests: _Optional[int] = ..., migrations: _Optional[_Mapping[str, int]] = ..., migration_bytes: _Optional[int] = ..., resumed_tokens_computed: _Optional[int] = ...) -> None: ...

class WatchKvEventsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KvCacheEvent(_message.Message):
    __slots__ = ("kind", "block_hash")
    KIND_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    kind: KvEventKind
    block_hash: bytes
    def __init__(self, kind: _Optional[_Union[KvEventKind, str]] = ..., block_hash: _Optional[bytes] = ...) -> None: ...

class KvEventBatch(_message.Message):
    __slots__ = ("snapshot", "seq", "events", "block_size_tokens", "model_id", "events_dropped", "first_event_unix_s")
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    EVENTS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    FIRST_EVENT_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    snapshot: bool
    seq: int
    events: _containers.RepeatedCompositeFieldContainer[KvCacheEvent]
    block_size_tokens: int
    model_id: str
    events_dropped: int
    first_event_unix_s: float
    def __init__(self, snapshot: _Optional[bool] = ..., seq: _Optional[int] = ..., events: _Optional[_Iterable[_Union[KvCacheEvent, _Mapping]]] = ..., block_size_tokens: _Optional[int] = ..., model_id: _Optional[str] = ..., events_dropped: _Optional[int] = ..., first_event_unix_s: _Optional[float] = ...) -> None: ...
