"""When the router re-routes a hop that a worker refused or failed, as a pure core.

Owns the retry rule: which statuses mean "another worker (or this one a little later) can serve
it", how many attempts a request gets, the backoff between them, and the request's remaining
deadline as a bound; the resume rule for a decode stream that broke after it sent tokens; and
when a prompt no prefill worker could take is prefilled on a decode worker instead. Must not do
I/O, sleep or read a clock: the service passes the attempt, the status name and the remaining
time, and sleeps the returned delay itself.

Retryable, each naming something about one worker, not about the request:
- UNAVAILABLE: the worker is draining for a role switch, or dead;
- FAILED_PRECONDITION: it switched role behind the router's back;
- RESOURCE_EXHAUSTED: its queue is full.
Never retried: INVALID_ARGUMENT (the request is bad everywhere), DEADLINE_EXCEEDED (no time
left), CANCELLED (the client left), INTERNAL and anything else (a bug: repeating it elsewhere
would only hide it). Never once the hop has streamed tokens to the client either: a second
worker would send them again.

Resumed (`decide_resume`): a decode stream that broke and may not be re-sent as it is (it sent
tokens already, or its status is not retryable), with UNAVAILABLE (the connection to the worker
is gone), or UNKNOWN, INTERNAL or CANCELLED from a stream the client did not cancel (what a
worker killed mid-stream leaves behind). Another decode worker recomputes the prompt and every
token sent and samples on from there; seeded sampling makes its tokens the ones the dead worker
would have sent. Never when the client left, at most `max_resumes` times per request (so a
worker bug that INTERNAL reports is repeated a bounded number of times, then reported), and
only with the deadline left that a retry needs.

Prefill fallback (`prefill_fallback`): when no prefill worker is in the pool, or the last prefill
attempt failed with a retryable status, a decode worker prefills the prompt itself.

What the client gets when a hop gives up (`client_status`): INVALID_ARGUMENT and OUT_OF_RANGE
as they are (the request is bad everywhere), RESOURCE_EXHAUSTED as it is (every queue is full:
retry later, HTTP 429); anything else a worker answered (UNAVAILABLE, DEADLINE_EXCEEDED while
waiting for it, INTERNAL or UNKNOWN from one that broke, FAILED_PRECONDITION from one that
switched role) is UNAVAILABLE (HTTP 503, with a retry hint): another component failed, not the
router and not the request.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.core.retry import RetryDecision

RETRYABLE_CODES = frozenset({"UNAVAILABLE", "FAILED_PRECONDITION", "RESOURCE_EXHAUSTED"})
# A broken stream, not a verdict on the request: INVALID_ARGUMENT or DEADLINE_EXCEEDED would
# come back the same from any worker.
RESUMABLE_CODES = frozenset({"UNAVAILABLE", "UNKNOWN", "INTERNAL", "CANCELLED"})
# A worker's statuses passed on to the client as they are; every other one is UNAVAILABLE.
CLIENT_CODES = frozenset({"INVALID_ARGUMENT", "OUT_OF_RANGE", "RESOURCE_EXHAUSTED"})


# What the gRPC library says of a call that never reached a worker's handler or lost it (a
# closed channel, a reset stream, a refused connection): words about the transport, not
# pdserve's, never shown to a client as they are.
_TRANSPORT_WORDS = ("channel closed", "socket closed", "stream removed", "connection reset",
                    "broken pipe", "goaway", "rst_stream", "failed to connect",
                    "connection refused", "locally cancelled", "deadline exceeded",
                    "endpoint read failed", "keepalive")


def worker_message(code: str, details: str | None) -> str:
    """What a worker's failed call says, in pdserve's words: the worker's own message as it is
    (its handler's errors name the field or the cause), the transport's replaced by what it
    means for the call."""
    text = (details or "").strip()
    if text and not any(w in text.lower() for w in _TRANSPORT_WORDS):
        return text
    return {"UNAVAILABLE": "the worker cannot be reached",
            "DEADLINE_EXCEEDED": "the worker did not answer in time",
            "CANCELLED": "the call to the worker was cut off"}.get(
                code, f"the call to the worker failed ({code})")


def client_status(code: str) -> str:
    """The status name the client gets for a hop that gave up with the worker's `code`."""
    return code if code in CLIENT_CODES else "UNAVAILABLE"


@dataclass(frozen=True)
class RetryPolicy:
    """`max_attempts` counts the first try; the delay before attempt n+1 is
    `backoff_s` x 2^(n-1), capped at `backoff_max_s`; a retry needs at least
    `min_remaining_s` of the request's deadline left after the delay. A request is resumed
    at most `max_resumes` times (each resumed hop has `max_attempts` of its own), the n-th
    resume waiting as attempt n+1 does."""

    max_attempts: int = 4
    backoff_s: float = 0.02
    backoff_max_s: float = 0.5
    min_remaining_s: float = 0.5
    max_resumes: int = 3

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.max_resumes < 0:
            raise ValueError(f"max_resumes must be >= 0, got {self.max_resumes}")
        for f in ("backoff_s", "backoff_max_s", "min_remaining_s"):
            if getattr(self, f) < 0:
                raise ValueError(f"{f} must be >= 0, got {getattr(self, f)}")

    def delay_s(self, attempt: int) -> float:
        """The wait after failed attempt `attempt` (1-based)."""
        # Exponent capped so a huge attempt number cannot overflow a float.
        return min(self.backoff_max_s, self.backoff_s * 2.0 ** min(max(0, attempt - 1), 60))

    def decide(self, attempt: int, code: str, remaining_s: float | None,
               streamed: bool) -> RetryDecision:
        """Attempt number `attempt` (1-based) failed with status `code` (a grpc.StatusCode
        name); `remaining_s` is the request's deadline left (None: none); `streamed` says the
        hop already sent tokens to the client."""
        if attempt < 1:
            raise ValueError(f"attempt is 1-based, got {attempt}")
        if code not in RETRYABLE_CODES:
            return RetryDecision(False, 0.0, f"{code} is not retryable")
        if streamed:
            return RetryDecision(False, 0.0, "tokens already reached the client")
        if attempt >= self.max_attempts:
            return RetryDecision(False, 0.0, f"{attempt} of {self.max_attempts} attempts used")
        delay = self.delay_s(attempt)
        if remaining_s is not None and remaining_s < self.min_remaining_s + delay:
            return RetryDecision(False, 0.0, f"only {remaining_s:.3f}s of the deadline left")
        return RetryDecision(True, delay, f"{code}: attempt {attempt + 1} of "
                                          f"{self.max_attempts} after {delay:.3f}s")

    def decide_resume(self, resumes: int, code: str, remaining_s: float | None,
                      client_left: bool) -> RetryDecision:
        """A decode stream that already sent tokens to the client broke with status `code`;
        `resumes` is how many times this request was resumed before; `client_left` says the
        client cancelled or disconnected (then the break is its own doing)."""
        if resumes < 0:
            raise ValueError(f"resumes must be >= 0, got {resumes}")
        if client_left:
            return RetryDecision(False, 0.0, "the client left")
        if code not in RESUMABLE_CODES:
            return RetryDecision(False, 0.0, f"{code} is not resumable")
        if resumes >= self.max_resumes:
            return RetryDecision(False, 0.0, f"{resumes} of {self.max_resumes} resumes used")
        delay = self.delay_s(resumes + 1)
        if remaining_s is not None and remaining_s < self.min_remaining_s + delay:
            return RetryDecision(False, 0.0, f"only {remaining_s:.3f}s of the deadline left")
        return RetryDecision(True, delay, f"{code}: resume {resumes + 1} of "
                                          f"{self.max_resumes} after {delay:.3f}s")

    @staticmethod
    def prefill_fallback(code: str | None) -> bool:
        """Whether a decode worker prefills the prompt itself after the prefill hop gave up
        with status `code` (None: no prefill worker in the pool). The same statuses as a
        retry: they say the prefill pool cannot take it now, not that the request is bad."""
        return code is None or code in RETRYABLE_CODES
