from pdserve.proto import worker_pb2 as _worker_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ControllerMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CONTROLLER_MODE_UNSPECIFIED: _ClassVar[ControllerMode]
    CONTROLLER_MODE_ACTIVE: _ClassVar[ControllerMode]
    CONTROLLER_MODE_ADVISORY: _ClassVar[ControllerMode]
    CONTROLLER_MODE_OFF: _ClassVar[ControllerMode]
CONTROLLER_MODE_UNSPECIFIED: ControllerMode
CONTROLLER_MODE_ACTIVE: ControllerMode
CONTROLLER_MODE_ADVISORY: ControllerMode
CONTROLLER_MODE_OFF: ControllerMode

class ControllerStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ControlledWorker(_message.Message):
    __slots__ = ("address", "role", "state", "pinned", "running", "waiting", "kv_used_blocks", "kv_total_blocks", "last_flip_age_s", "last_flip_reason", "role_switches", "offload_budget_tokens", "offload_in_flight_tokens", "in_flight")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LAST_FLIP_AGE_S_FIELD_NUMBER: _ClassVar[int]
    LAST_FLIP_REASON_FIELD_NUMBER: _ClassVar[int]
    ROLE_SWITCHES_FIELD_NUMBER: _ClassVar[int]
    OFFLOAD_BUDGET_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OFFLOAD_IN_FLIGHT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    address: str
    role: _worker_pb2.Role
    state: str
    pinned: bool
    running: int
    waiting: int
    kv_used_blocks: int
    kv_total_blocks: int
    last_flip_age_s: float
    last_flip_reason: str
    role_switches: int
    offload_budget_tokens: int
    offload_in_flight_tokens: int
    in_flight: int
    def __init__(self, address: _Optional[str] = ..., role: _Optional[_Union[_worker_pb2.Role, str]] = ..., state: _Optional[str] = ..., pinned: _Optional[bool] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., kv_used_blocks: _Optional[int] = ..., kv_total_blocks: _Optional[int] = ..., last_flip_age_s: _Optional[float] = ..., last_flip_reason: _Optional[str] = ..., role_switches: _Optional[int] = ..., offload_budget_tokens: _Optional[int] = ..., offload_in_flight_tokens: _Optional[int] = ..., in_flight: _Optional[int] = ...) -> None: ...

class ControllerStatus(_message.Message):
    __slots__ = ("mode", "workers", "prefill_pressure", "decode_pressure", "prefill_work_s", "window_s", "window_requests", "slo_attainment", "ttft_p90_s", "itl_p90_s", "ttft_slo_s", "itl_slo_s", "has_target", "target_prefill", "target_decode", "conflicts", "last_action", "last_reason", "flips_total", "ticks")
    MODE_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_PRESSURE_FIELD_NUMBER: _ClassVar[int]
    DECODE_PRESSURE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORK_S_FIELD_NUMBER: _ClassVar[int]
    WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    WINDOW_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    SLO_ATTAINMENT_FIELD_NUMBER: _ClassVar[int]
    TTFT_P90_S_FIELD_NUMBER: _ClassVar[int]
    ITL_P90_S_FIELD_NUMBER: _ClassVar[int]
    TTFT_SLO_S_FIELD_NUMBER: _ClassVar[int]
    ITL_SLO_S_FIELD_NUMBER: _ClassVar[int]
    HAS_TARGET_FIELD_NUMBER: _ClassVar[int]
    TARGET_PREFILL_FIELD_NUMBER: _ClassVar[int]
    TARGET_DECODE_FIELD_NUMBER: _ClassVar[int]
    CONFLICTS_FIELD_NUMBER: _ClassVar[int]
    LAST_ACTION_FIELD_NUMBER: _ClassVar[int]
    LAST_REASON_FIELD_NUMBER: _ClassVar[int]
    FLIPS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    TICKS_FIELD_NUMBER: _ClassVar[int]
    mode: ControllerMode
    workers: _containers.RepeatedCompositeFieldContainer[ControlledWorker]
    prefill_pressure: float
    decode_pressure: float
    prefill_work_s: float
    window_s: float
    window_requests: int
    slo_attainment: float
    ttft_p90_s: float
    itl_p90_s: float
    ttft_slo_s: float
    itl_slo_s: float
    has_target: bool
    target_prefill: int
    target_decode: int
    conflicts: _containers.RepeatedScalarFieldContainer[str]
    last_action: str
    last_reason: str
    flips_total: int
    ticks: int
    def __init__(self, mode: _Optional[_Union[ControllerMode, str]] = ..., workers: _Optional[_Iterable[_Union[ControlledWorker, _Mapping]]] = ..., prefill_pressure: _Optional[float] = ..., decode_pressure: _Optional[float] = ..., prefill_work_s: _Optional[float] = ..., window_s: _Optional[float] = ..., window_requests: _Optional[int] = ..., slo_attainment: _Optional[float] = ..., ttft_p90_s: _Optional[float] = ..., itl_p90_s: _Optional[float] = ..., ttft_slo_s: _Optional[float] = ..., itl_slo_s: _Optional[float] = ..., has_target: _Optional[bool] = ..., target_prefill: _Optional[int] = ..., target_decode: _Optional[int] = ..., conflicts: _Optional[_Iterable[str]] = ..., last_action: _Optional[str] = ..., last_reason: _Optional[str] = ..., flips_total: _Optional[int] = ..., ticks: _Optional[int] = ...) -> None: ...

class FlipResult(_message.Message):
    __slots__ = ("address", "from_role", "to_role", "ok", "seconds", "error", "drained_requests")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    FROM_ROLE_FIELD_NUMBER: _ClassVar[int]
    TO_ROLE_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    DRAINED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    address: str
    from_role: _worker_pb2.Role
    to_role: _worker_pb2.Role
    ok: bool
    seconds: float
    error: str
    drained_requests: int
    def __init__(self, address: _Optional[str] = ..., from_role: _Optional[_Union[_worker_pb2.Role, str]] = ..., to_role: _Optional[_Union[_worker_pb2.Role, str]] = ..., ok: _Optional[bool] = ..., seconds: _Optional[float] = ..., error: _Optional[str] = ..., drained_requests: _Optional[int] = ...) -> None: ...

class ControllerSetRoleRequest(_message.Message):
    __slots__ = ("address", "role", "drain_timeout_s")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    DRAIN_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    address: str
    role: _worker_pb2.Role
    drain_timeout_s: float
    def __init__(self, address: _Optional[str] = ..., role: _Optional[_Union[_worker_pb2.Role, str]] = ..., drain_timeout_s: _Optional[float] = ...) -> None: ...

class RebalanceRequest(_message.Message):
    __slots__ = ("prefill", "decode", "dry_run", "drain_timeout_s")
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    DRAIN_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    prefill: int
    decode: int
    dry_run: bool
    drain_timeout_s: float
    def __init__(self, prefill: _Optional[int] = ..., decode: _Optional[int] = ..., dry_run: _Optional[bool] = ..., drain_timeout_s: _Optional[float] = ...) -> None: ...

class PlannedFlip(_message.Message):
    __slots__ = ("address", "from_role", "to_role")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    FROM_ROLE_FIELD_NUMBER: _ClassVar[int]
    TO_ROLE_FIELD_NUMBER: _ClassVar[int]
    address: str
    from_role: _worker_pb2.Role
    to_role: _worker_pb2.Role
    def __init__(self, address: _Optional[str] = ..., from_role: _Optional[_Union[_worker_pb2.Role, str]] = ..., to_role: _Optional[_Union[_worker_pb2.Role, str]] = ...) -> None: ...

class RebalanceResponse(_message.Message):
    __slots__ = ("plan", "results")
    PLAN_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    plan: _containers.RepeatedCompositeFieldContainer[PlannedFlip]
    results: _containers.RepeatedCompositeFieldContainer[FlipResult]
    def __init__(self, plan: _Optional[_Iterable[_Union[PlannedFlip, _Mapping]]] = ..., results: _Optional[_Iterable[_Union[FlipResult, _Mapping]]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("had_target",)
    HAD_TARGET_FIELD_NUMBER: _ClassVar[int]
    had_target: bool
    def __init__(self, had_target: _Optional[bool] = ...) -> None: ...

class PinWorkerRequest(_message.Message):
    __slots__ = ("address",)
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    address: str
    def __init__(self, address: _Optional[str] = ...) -> None: ...

class PinWorkerResponse(_message.Message):
    __slots__ = ("address", "pinned")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    address: str
    pinned: bool
    def __init__(self, address: _Optional[str] = ..., pinned: _Optional[bool] = ...) -> None: ...

class SetModeRequest(_message.Message):
    __slots__ = ("mode",)
    MODE_FIELD_NUMBER: _ClassVar[int]
    mode: ControllerMode
    def __init__(self, mode: _Optional[_Union[ControllerMode, str]] = ...) -> None: ...

class SetModeResponse(_message.Message):
    __slots__ = ("previous", "mode")
    PREVIOUS_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    previous: ControllerMode
    mode: ControllerMode
    def __init__(self, previous: _Optional[_Union[ControllerMode, str]] = ..., mode: _Optional[_Union[ControllerMode, str]] = ...) -> None: ...
