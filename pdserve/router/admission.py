"""Admission at the front door: a bound on requests in flight, per tenant and overall, a
token-bucket rate limit per tenant, and a bound on the predicted time to first token. Pure: the
caller passes `now_s` and the measured prefill rate; no clock, no I/O.

Owns the decision "take this request now, or refuse it with a retry hint" (invariant 5: past a
bound the caller gets RESOURCE_EXHAUSTED / HTTP 429, never a queue that grows without limit),
the router's account of prefill work admitted and not yet done (`queued_tokens`), the TTFT
prediction over it (`predict_ttft`; the measured prefill rates it divides by come from
`pdserve.core.rates.RateMeter`). Must not know gRPC or HTTP: `Overloaded` carries the message, the reason
(the metric label) and `retry_after_s`; the adapters (`lifecycle.Door`) map it to their status
codes and headers.

The TTFT model: a request admitted now waits for the prefill work admitted before it (every
admitted request's uncached prompt tokens, from admission until its first token) and then for
its own; the prefill pool works through it at the sum of its workers' peak measured rates
(prompt tokens computed per busy second, from `WorkerStats`: the best rate each has shown, since
a queue lets a worker batch and a smoothed rate measured at light load would predict waits
several times too long). So
predicted TTFT = (queued + own) / rate. Over `max_predicted_ttft_s` the request is refused,
and its retry hint is the time the queue needs to drain enough for it to fit:
predicted - max. A request is never refused for the TTFT with nothing queued before it
(waiting would not make it faster), nor before any rate is measured (the in-flight bound
still holds).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

# Overloaded.reason values: the `reason` label of pdserve:requests_rejected_total.
IN_FLIGHT = "in_flight"
TENANT_IN_FLIGHT = "tenant_in_flight"
TENANT_RATE = "tenant_rate"
PREDICTED_TTFT = "predicted_ttft"


class Overloaded(Exception):
    """The request is refused for now; retry after `retry_after_s` seconds."""

    def __init__(self, message: str, retry_after_s: float, reason: str = IN_FLIGHT) -> None:
        super().__init__(f"{message}; retry after {retry_after_s:g}s")
        self.retry_after_s = retry_after_s
        self.reason = reason


@dataclass(frozen=True)
class AdmissionConfig:
    # Requests the router holds at once (prefilling, decoding or waiting for a worker).
    max_in_flight: int = 256
    # Of those, at most this many for one tenant (0: no per-tenant bound).
    max_in_flight_per_tenant: int = 0
    # Requests per second one tenant may start, with bursts up to `tenant_burst` (0: no limit).
    tenant_rate_rps: float = 0.0
    tenant_burst: int = 1
    # Retry hint when the in-flight bound is hit (a request takes about this long to finish).
    busy_retry_after_s: float = 1.0
    # Tenants remembered for rate limiting; the least recently seen are forgotten past it.
    max_tenants: int = 10_000
    # Refuse a request whose predicted TTFT is over this (0: no TTFT bound).
    max_predicted_ttft_s: float = 0.0
    # No retry hint is longer than this: a prediction far out is not worth trusting.
    max_retry_after_s: float = 60.0

    def __post_init__(self) -> None:
        if self.max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {self.max_in_flight}")
        if self.max_in_flight_per_tenant < 0:
            raise ValueError("max_in_flight_per_tenant must be >= 0")
        if not (self.tenant_rate_rps >= 0 and math.isfinite(self.tenant_rate_rps)):
            raise ValueError(f"tenant_rate_rps must be >= 0, got {self.tenant_rate_rps}")
        if self.tenant_burst < 1:
            raise ValueError(f"tenant_burst must be >= 1, got {self.tenant_burst}")
        if self.max_tenants < 1:
            raise ValueError("max_tenants must be >= 1")
        if not (self.max_predicted_ttft_s >= 0 and math.isfinite(self.max_predicted_ttft_s)):
            raise ValueError(f"max_predicted_ttft_s must be >= 0, got "
                             f"{self.max_predicted_ttft_s}")
        if not self.max_retry_after_s > 0:
            raise ValueError(f"max_retry_after_s must be > 0, got {self.max_retry_after_s}")


@dataclass(frozen=True)
class TtftPrediction:
    predicted_s: float  # this request's time to first token if admitted now
    queued_tokens: float  # prefill work admitted before it and not yet done
    own_tokens: int  # its own uncached prompt tokens
    tokens_per_s: float  # the prefill pool's measured rate


def predict_ttft(queued_tokens: float, own_tokens: int, tokens_per_s: float | None
                 ) -> TtftPrediction | None:
    """(queued + own) / rate; None without a usable rate (nothing measured yet)."""
    if tokens_per_s is None or not tokens_per_s > 0 or not math.isfinite(tokens_per_s):
        return None
    queued = max(0.0, float(queued_tokens))  # a float sum of adds and subtracts: no negatives
    own = max(0, int(own_tokens))
    return TtftPrediction((queued + own) / tokens_per_s, queued, own, float(tokens_per_s))


@dataclass
class _Bucket:
    tokens: float
    at_s: float


class Admission:
    """Counts requests in flight; `admit` takes one (or raises Overloaded), `release` gives it
    back. `admit_prefill` adds a request's prefill work to the queue (or raises Overloaded),
    `prefilled` takes it off. Thread-safe (the gRPC server calls it from many threads)."""

    def __init__(self, config: AdmissionConfig | None = None) -> None:
        self.config = config or AdmissionConfig()
        self._lock = threading.Lock()
        self.in_flight = 0
        self.queued_tokens = 0.0
        self._per_tenant: dict[str, int] = {}
        self._buckets: dict[str, _Bucket] = {}  # insertion order = least recently seen first
        self.rejected = 0

    def admit(self, tenant: str, now_s: float) -> None:
        c = self.config
        with self._lock:
            if self.in_flight >= c.max_in_flight:
                self.rejected += 1
                raise Overloaded(f"the router holds {self.in_flight} requests, its limit",
                                 c.busy_retry_after_s, IN_FLIGHT)
            held = self._per_tenant.get(tenant, 0)
            if c.max_in_flight_per_tenant and held >= c.max_in_flight_per_tenant:
                self.rejected += 1
                raise Overloaded(f"tenant {tenant or 'default'!r} has {held} requests in flight, "
                                 "its limit", c.busy_retry_after_s, TENANT_IN_FLIGHT)
            if c.tenant_rate_rps > 0:
                self._take_token(tenant, now_s)
            self.in_flight += 1
            self._per_tenant[tenant] = held + 1

    def _take_token(self, tenant: str, now_s: float) -> None:
        c = self.config
        b = self._buckets.pop(tenant, None) or _Bucket(float(c.tenant_burst), now_s)
        b.tokens = min(float(c.tenant_burst), b.tokens + (now_s - b.at_s) * c.tenant_rate_rps)
        b.at_s = now_s
        self._buckets[tenant] = b  # re-inserted: most recently seen
        while len(self._buckets) > c.max_tenants:
            del self._buckets[next(iter(self._buckets))]
        if b.tokens < 1.0:
            self.rejected += 1
            wait = (1.0 - b.tokens) / c.tenant_rate_rps
            raise Overloaded(f"tenant {tenant or 'default'!r} is over its rate of "
                             f"{c.tenant_rate_rps:g} requests/s", round(max(wait, 0.001), 3),
                             TENANT_RATE)
        b.tokens -= 1.0

    def release(self, tenant: str) -> None:
        with self._lock:
            self.in_flight -= 1
            n = self._per_tenant.get(tenant, 0) - 1
            if n > 0:
                self._per_tenant[tenant] = n
            else:
                self._per_tenant.pop(tenant, None)

    def admit_prefill(self, own_tokens: int, tokens_per_s: float | None
                      ) -> TtftPrediction | None:
        """Queue a request's prefill work (`own_tokens`, its uncached prompt tokens), or raise
        Overloaded when its predicted TTFT is over the bound; the prediction (None: no rate)."""
        c = self.config
        with self._lock:
            p = predict_ttft(self.queued_tokens, own_tokens, tokens_per_s)
            limit = c.max_predicted_ttft_s
            if limit > 0 and p is not None and p.queued_tokens > 0 and p.predicted_s > limit:
                self.rejected += 1
                wait = min(c.max_retry_after_s, max(0.1, p.predicted_s - limit))
                raise Overloaded(f"predicted time to first token {p.predicted_s:.2f}s is over "
                                 f"the limit of {limit:g}s ({p.queued_tokens:.0f} prompt tokens "
                                 f"queued at {p.tokens_per_s:.0f} tokens/s)",
                                 round(wait, 3), PREDICTED_TTFT)
            self.queued_tokens += max(0, int(own_tokens))
            return p

    def prefilled(self, own_tokens: int) -> None:
        """A request's prefill work is done (its first token exists) or was given up."""
        with self._lock:
            self.queued_tokens = max(0.0, self.queued_tokens - max(0, int(own_tokens)))


