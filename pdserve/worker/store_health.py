"""Whether the KV store serves this worker, as a pure core: degraded mode and its counters.

Owns the worker's view of its store. A store call that fails (no master answers, no storage node,
a put refused, a read of blocks whose node is gone) marks its operation failing and the worker
degraded; the next success of that operation clears it, and a probe that finds the store whole
(a master answers and a storage node is registered) clears every operation. Degraded means
"serving, slower": the prefill side still answers with its first token, the decode side
recomputes what it cannot fetch. No flag is permanent. Also counts failures per operation.
Must not do I/O, read a clock or lock: the adapter (`guarded_store`) passes `now_s` and holds
the lock.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The operations a worker calls on its store (labels of store_errors_total; a fixed set).
OPERATIONS = ("longest_prefix", "exists", "put", "get", "probe")
_MAX_REASON_CHARS = 300


@dataclass(frozen=True)
class StoreHealthView:
    degraded: bool
    reason: str  # the latest failure still standing, else ""
    since_s: float | None  # when the worker became degraded
    errors: dict[str, int]  # cumulative failed calls per operation


@dataclass
class StoreHealth:
    """`probe_interval_s`: while degraded and no store call was made for this long, probe."""

    probe_interval_s: float = 2.0
    _failing: dict[str, str] = field(default_factory=dict)  # operation -> its last failure
    _reason: str = ""
    _since_s: float | None = None
    _last_call_s: float = float("-inf")
    _errors: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.probe_interval_s > 0:
            raise ValueError(f"probe_interval_s must be > 0, got {self.probe_interval_s!r}")

    @staticmethod
    def _check(op: str) -> str:
        if op not in OPERATIONS:
            raise ValueError(f"op must be one of {', '.join(OPERATIONS)}, got {op!r}")
        return op

    def failed(self, op: str, reason: str, now_s: float) -> None:
        """A store call `op` failed with `reason`."""
        self._failing.pop(self._check(op), None)  # re-inserted last: the order is recency
        self._failing[op] = reason
        self._errors[op] = self._errors.get(op, 0) + 1
        self._reason = f"{op}: {reason}"[:_MAX_REASON_CHARS]
        if self._since_s is None:
            self._since_s = now_s
        self._last_call_s = now_s

    def succeeded(self, op: str, now_s: float) -> None:
        """A store call `op` got its answer (a miss is an answer)."""
        self._failing.pop(self._check(op), None)
        self._last_call_s = now_s
        self._settle()

    def whole(self, now_s: float) -> None:
        """A probe found a master answering with a storage node registered: clear everything."""
        self._failing.clear()
        self._last_call_s = now_s
        self._settle()

    def _settle(self) -> None:
        if not self._failing:
            self._reason, self._since_s = "", None
        else:  # still failing elsewhere: name the latest of those
            op, why = next(reversed(self._failing.items()))
            self._reason = f"{op}: {why}"[:_MAX_REASON_CHARS]

    def probe_due(self, now_s: float) -> bool:
        return bool(self._failing) and now_s - self._last_call_s >= self.probe_interval_s

    def view(self) -> StoreHealthView:
        return StoreHealthView(bool(self._failing), self._reason, self._since_s,
                               dict(self._errors))
