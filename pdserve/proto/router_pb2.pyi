from pdserve.proto import worker_pb2 as _worker_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class MemberState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MEMBER_STATE_UNSPECIFIED: _ClassVar[MemberState]
    MEMBER_STATE_ACTIVE: _ClassVar[MemberState]
    MEMBER_STATE_DRAINING: _ClassVar[MemberState]
    MEMBER_STATE_GONE: _ClassVar[MemberState]
    MEMBER_STATE_FAILED: _ClassVar[MemberState]
MEMBER_STATE_UNSPECIFIED: MemberState
MEMBER_STATE_ACTIVE: MemberState
MEMBER_STATE_DRAINING: MemberState
MEMBER_STATE_GONE: MemberState
MEMBER_STATE_FAILED: MemberState

class WorkerMember(_message.Message):
    __slots__ = ("address", "role", "state", "in_flight", "in_flight_tokens", "offload_in_flight_tokens", "offload_budget_tokens", "stats", "last_seen_age_s", "reason", "missed_polls")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OFFLOAD_IN_FLIGHT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OFFLOAD_BUDGET_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_AGE_S_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MISSED_POLLS_FIELD_NUMBER: _ClassVar[int]
    address: str
    role: _worker_pb2.Role
    state: MemberState
    in_flight: int
    in_flight_tokens: float
    offload_in_flight_tokens: int
    offload_budget_tokens: int
    stats: _worker_pb2.WorkerStats
    last_seen_age_s: float
    reason: str
    missed_polls: int
    def __init__(self, address: _Optional[str] = ..., role: _Optional[_Union[_worker_pb2.Role, str]] = ..., state: _Optional[_Union[MemberState, str]] = ..., in_flight: _Optional[int] = ..., in_flight_tokens: _Optional[float] = ..., offload_in_flight_tokens: _Optional[int] = ..., offload_budget_tokens: _Optional[int] = ..., stats: _Optional[_Union[_worker_pb2.WorkerStats, _Mapping]] = ..., last_seen_age_s: _Optional[float] = ..., reason: _Optional[str] = ..., missed_polls: _Optional[int] = ...) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerMember]
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerMember, _Mapping]]] = ...) -> None: ...

class RegisterWorkerRequest(_message.Message):
    __slots__ = ("address", "role")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    address: str
    role: _worker_pb2.Role
    def __init__(self, address: _Optional[str] = ..., role: _Optional[_Union[_worker_pb2.Role, str]] = ...) -> None: ...

class SetWorkerStateRequest(_message.Message):
    __slots__ = ("address", "state", "role", "reason")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    address: str
    state: MemberState
    role: _worker_pb2.Role
    reason: str
    def __init__(self, address: _Optional[str] = ..., state: _Optional[_Union[MemberState, str]] = ..., role: _Optional[_Union[_worker_pb2.Role, str]] = ..., reason: _Optional[str] = ...) -> None: ...

class OffloadBudget(_message.Message):
    __slots__ = ("address", "max_tokens", "chunk_tokens", "step_s")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEP_S_FIELD_NUMBER: _ClassVar[int]
    address: str
    max_tokens: int
    chunk_tokens: int
    step_s: float
    def __init__(self, address: _Optional[str] = ..., max_tokens: _Optional[int] = ..., chunk_tokens: _Optional[int] = ..., step_s: _Optional[float] = ...) -> None: ...

class SetOffloadBudgetsRequest(_message.Message):
    __slots__ = ("budgets",)
    BUDGETS_FIELD_NUMBER: _ClassVar[int]
    budgets: _containers.RepeatedCompositeFieldContainer[OffloadBudget]
    def __init__(self, budgets: _Optional[_Iterable[_Union[OffloadBudget, _Mapping]]] = ...) -> None: ...

class SetOffloadBudgetsResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetSignalsRequest(_message.Message):
    __slots__ = ("window_s",)
    WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    window_s: float
    def __init__(self, window_s: _Optional[float] = ...) -> None: ...

class RequestSample(_message.Message):
    __slots__ = ("age_s", "ttft_s", "tpot_s", "prompt_tokens", "output_tokens", "offloaded", "retries", "finish", "path", "deflection", "prefill_ttft_estimate_s", "decode_ttft_estimate_s", "max_tokens")
    AGE_S_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    TPOT_S_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OFFLOADED_FIELD_NUMBER: _ClassVar[int]
    RETRIES_FIELD_NUMBER: _ClassVar[int]
    FINISH_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    DEFLECTION_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TTFT_ESTIMATE_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_TTFT_ESTIMATE_S_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    age_s: float
    ttft_s: float
    tpot_s: float
    prompt_tokens: int
    output_tokens: int
    offloaded: bool
    retries: int
    finish: str
    path: str
    deflection: str
    prefill_ttft_estimate_s: float
    decode_ttft_estimate_s: float
    max_tokens: int
    def __init__(self, age_s: _Optional[float] = ..., ttft_s: _Optional[float] = ..., tpot_s: _Optional[float] = ..., prompt_tokens: _Optional[int] = ..., output_tokens: _Optional[int] = ..., offloaded: _Optional[bool] = ..., retries: _Optional[int] = ..., finish: _Optional[str] = ..., path: _Optional[str] = ..., deflection: _Optional[str] = ..., prefill_ttft_estimate_s: _Optional[float] = ..., decode_ttft_estimate_s: _Optional[float] = ..., max_tokens: _Optional[int] = ...) -> None: ...

class RouterSignals(_message.Message):
    __slots__ = ("samples", "workers", "in_flight_requests", "offloaded_requests_total", "offloaded_tokens_total", "retries_total", "admitted_output_tokens_total")
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    OFFLOADED_REQUESTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    OFFLOADED_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    RETRIES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_OUTPUT_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    samples: _containers.RepeatedCompositeFieldContainer[RequestSample]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerMember]
    in_flight_requests: int
    offloaded_requests_total: int
    offloaded_tokens_total: int
    retries_total: int
    admitted_output_tokens_total: int
    def __init__(self, samples: _Optional[_Iterable[_Union[RequestSample, _Mapping]]] = ..., workers: _Optional[_Iterable[_Union[WorkerMember, _Mapping]]] = ..., in_flight_requests: _Optional[int] = ..., offloaded_requests_total: _Optional[int] = ..., offloaded_tokens_total: _Optional[int] = ..., retries_total: _Optional[int] = ..., admitted_output_tokens_total: _Optional[int] = ...) -> None: ...
