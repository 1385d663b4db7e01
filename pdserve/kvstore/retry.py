"""When a store client tries a call again, as a pure core.

Owns the rule for transient failures: UNAVAILABLE and DEADLINE_EXCEEDED (a master restarting,
a failover in progress, a standby that is not the leader, a store process not up yet) are
retried after a bounded exponential backoff while the operation's budget lasts; anything else
is an answer and is not retried. And the fail-fast rule: while the client knows the store is
down (its last operation used its whole budget without an answer), an operation gets one round
of attempts and no backoff, so a worker recomputes at once instead of waiting; the first answer
clears it. Must not do I/O, sleep or read a clock: the client passes the elapsed time and sleeps
the returned delay itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.core.retry import RetryDecision

TRANSIENT_CODES = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED"})


@dataclass(frozen=True)
class StoreRetryPolicy:
    """`budget_s` bounds one operation: every attempt and backoff of it. The delay before round
    n+1 is `backoff_s` x 2^(n-1), capped at `backoff_max_s`. One attempt waits at most
    `attempt_timeout_s`, and never past the budget by more than `min_attempt_s` (a last attempt
    always gets that long); while the store is down, at most `down_attempt_timeout_s`."""

    budget_s: float = 3.0
    backoff_s: float = 0.05
    backoff_max_s: float = 0.5
    attempt_timeout_s: float = 30.0
    min_attempt_s: float = 0.25
    down_attempt_timeout_s: float = 1.0

    def __post_init__(self) -> None:
        for name in ("budget_s", "backoff_s", "backoff_max_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        for name in ("attempt_timeout_s", "min_attempt_s", "down_attempt_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{name} must be a number > 0, got {value!r}")

    def delay_s(self, rounds: int) -> float:
        """The wait after failed round `rounds` (1-based)."""
        return min(self.backoff_max_s, self.backoff_s * 2.0 ** min(max(0, rounds - 1), 60))

    def attempt_timeout(self, elapsed_s: float, store_down: bool) -> float:
        """How long the next attempt may wait for an answer."""
        cap = self.down_attempt_timeout_s if store_down else self.attempt_timeout_s
        return min(cap, max(self.min_attempt_s, self.budget_s - elapsed_s))

    def decide(self, rounds: int, code: str, elapsed_s: float, store_down: bool
               ) -> RetryDecision:
        """Round `rounds` (1-based; a round tries every master once) failed, its last status
        `code` (a grpc.StatusCode name), `elapsed_s` into the operation; `store_down` says the
        client's previous operation found no store."""
        if rounds < 1:
            raise ValueError(f"rounds is 1-based, got {rounds}")
        if code not in TRANSIENT_CODES:
            return RetryDecision(False, 0.0, f"{code} is an answer, not a transient failure")
        if store_down:
            return RetryDecision(False, 0.0, "the store is down: failing fast")
        delay = self.delay_s(rounds)
        if elapsed_s + delay >= self.budget_s:
            return RetryDecision(False, 0.0, f"budget of {self.budget_s}s used "
                                              f"({elapsed_s:.3f}s elapsed)")
        return RetryDecision(True, delay, f"{code}: round {rounds + 1} after {delay:.3f}s")
