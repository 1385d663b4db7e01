"""The controller policy's vocabulary: what a tick knows and what a decision says.

Owns the frozen records `decide()` reads (`WorkerView`, `PolicyConfig`, `PolicyState`,
`ControllerInput`) and returns (`Decision` with its `Flip`s, `OffloadBudget`s and
`Migration`s), with their validation. Must not decide anything or do I/O: `policy.py` and
`actions.py` do the deciding; the service and the simulator build the inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.controller.projection import StepModel
from pdserve.controller.signals import DecodePressure, PrefillPressure, Slo
from pdserve.core.roles import ROLES, SERVING, WORKER_STATES

STATES = WORKER_STATES


@dataclass(frozen=True)
class WorkerView:
    """What the controller knows of one worker at a tick (counters as last reported)."""

    address: str
    role: str  # the role it serves now (while DRAINING or SWITCHING for a flip: the one it leaves)
    state: str = SERVING
    pinned: bool = False  # the operator fixed its role: no flip moves it
    last_flip_s: float | None = None  # same clock as `now`
    running: int = 0
    waiting: int = 0
    kv_used_blocks: int = 0
    kv_total_blocks: int = 0
    queued_prompt_tokens: float = 0.0  # the router's predicted prefill work in flight on it
    prefill_tokens_per_s: float | None = None  # measured on this worker
    decode_step_s: float | None = None  # measured mean decode step time on this worker
    in_flight: int = 0  # requests the router has sent it and not yet seen end
    # Decode workers: the step it is projected to take once the requests prefilling now
    # arrived (`projection.project`), None without a step model.
    projected_step_s: float | None = None
    # The role a flip in progress takes it to, when the actuator knows it (a SWITCHING worker
    # without it is taken to be bound for the other role). The worker counts toward it, so no
    # second flip is ordered for the same shortfall.
    to_role: str | None = None

    def __post_init__(self) -> None:
        if self.role not in ROLES or self.to_role not in (None, *ROLES) or self.state not in STATES:
            raise ValueError(f"worker {self.address}: role and to_role must be in {ROLES}, state "
                             f"in {STATES}; got {self.role!r}, {self.to_role!r}, {self.state!r}")


@dataclass(frozen=True)
class PolicyConfig:
    fluid_role: bool = True
    fluid_token: bool = True
    max_flips_per_tick: int = 1
    cooldown_s: float = 30.0  # per worker, since its last flip
    min_per_role: int = 1  # SERVING workers a role keeps after a pressure-driven flip
    sustain_s: float = 3.0  # a role must stay pressured this long before a flip toward it
    high: float = 1.0  # pressure ratio above which a role is pressured
    low: float = 0.5  # the giving role's pressure must be below this
    offload_itl_share: float = 0.8  # a decode step carrying an offloaded chunk stays under this
    offload_kv_max: float = 0.7  # no offload to a decode worker whose KV occupancy is above
    offload_max_tokens: int = 4096  # cap on one worker's offload budget
    offload_min_chunk_tokens: int = 16  # below this the slack is not worth it: no budget
    # Moving running decodes off the most loaded decode worker (with a step model only): when
    # its projected step exceeds balance_share of the ITL SLO, at most this many a tick.
    balance: bool = True
    balance_share: float = 0.9
    max_migrations_per_tick: int = 4

    def __post_init__(self) -> None:
        for name, least in (("max_flips_per_tick", 0), ("cooldown_s", 0), ("min_per_role", 0),
                            ("sustain_s", 0), ("offload_max_tokens", 0),
                            ("offload_min_chunk_tokens", 1), ("max_migrations_per_tick", 0)):
            if getattr(self, name) < least:
                raise ValueError(f"{name} must be >= {least}, got {getattr(self, name)}")
        if not 0 <= self.low <= self.high:
            raise ValueError(f"need 0 <= low <= high, got low={self.low}, high={self.high}")
        if not 0 < self.balance_share <= 1:
            raise ValueError(f"balance_share must be in (0, 1], got {self.balance_share}")
        if not (0 < self.offload_itl_share <= 1 and 0 <= self.offload_kv_max <= 1):
            raise ValueError("offload_itl_share must be in (0, 1] and offload_kv_max in [0, 1], "
                             f"got {self.offload_itl_share}, {self.offload_kv_max}")


@dataclass(frozen=True)
class PolicyState:
    """Fed back from `Decision.state` each tick. `<role>_high_since_s`: since when the role's
    pressure counts toward a flip: when its ratio went above `high` (None at or below it),
    moved up to any tick that ordered a flip toward the role or saw a flip in flight, so each
    flip earns its own sustain_s of pressure measured after the previous one landed."""

    prefill_high_since_s: float | None = None
    decode_high_since_s: float | None = None


@dataclass(frozen=True)
class ControllerInput:
    workers: tuple[WorkerView, ...]
    prefill: PrefillPressure
    decode: DecodePressure
    slo: Slo
    state: PolicyState = PolicyState()
    target: tuple[int, int] | None = None  # the operator's (prefill, decode) split, if one stands
    # Decode step time from batch and KV (fitted or profiled); None: no projection, no balance.
    step_model: StepModel | None = None
    # Output tokens a second the admitted requests are expected to decode (`view.decode_work`:
    # their max_tokens a second, times the share of max_tokens recent requests used).
    decode_tokens_per_s: float = 0.0

    def __post_init__(self) -> None:
        if self.target is not None and (len(self.target) != 2 or min(self.target) < 0):
            raise ValueError(f"target must be (prefill, decode) counts >= 0, got {self.target}")


@dataclass(frozen=True)
class Flip:
    address: str
    from_role: str
    to_role: str
    reason: str


@dataclass(frozen=True)
class OffloadBudget:
    """Prefill work one decode worker may take on. A decode step carries at most one chunk of
    offloaded prefill (several offloaded requests advance in turn), so the ITL bound holds."""

    address: str
    max_tokens: int  # prompt tokens of offloaded requests it may hold in flight
    chunk_tokens: int  # prompt tokens one decode step may prefill for an offloaded request
    step_s: float = 0.0  # predicted decode step carrying one chunk (<= offload_itl_share x ITL)


@dataclass(frozen=True)
class Decision:
    """`action`: "flip" / "offload" / "flip+offload" / "hold" under pressure; with a target
    standing, "target" when it flips toward the target (else "offload" or "hold")."""

    state: PolicyState
    flips: tuple[Flip, ...] = ()
    budgets: tuple[OffloadBudget, ...] = ()  # empty: offload nothing
    action: str = "hold"
    reason: str = ""  # one line a person understands, with the numbers
    conflicts: tuple[str, ...] = ()  # where the operator's choice and the pressure disagree
    migrations: tuple[Migration, ...] = ()  # running decodes to move, keeping roles


@dataclass(frozen=True)
class Migration:
    """Running decodes to move off one decode worker, with their KV, to the others (the router
    places each on the decode worker its policy picks, never back on this one)."""

    address: str
    count: int
    reason: str
