"""Admission at the front door: a bound on requests in flight, per tenant and overall, a
token-bucket rate limit per tenant, and a bound on the predicted time to first token. Pure: the
caller passes `now_s` and the measured prefill rate; no clock, no I/O.

Owns the decision "take this request now, or refuse it with a retry hint" (invariant 5: past a
bound the caller gets RESOURCE_EXHAUSTED / HTTP 429, never a queue that grows without limit),
the router's account of prefill work admitted and not yet done (`queued_tokens`), the TTFT
prediction over it (`predict_ttft`; the measured prefill rates it divides by come from
`pdserve.core.rates.RateMeter`, its correction from `ttft_calibration.TtftCalibration`).
Must not know gRPC or HTTP: `Overloaded` carries the message, the reason (the metric label)
and `retry_after_s`; the adapters (`lifecycle.Door`) map it to their status codes and headers.

The TTFT model: a request admitted now waits for the prefill work admitted before it (every
admitted request's uncached prompt tokens, from admission until its first token) and then for
its own; the prefill pool works through it at the sum of its workers' peak measured rates
(prompt tokens computed per busy second, from `WorkerStats`: the best rate each has shown, since
a queue lets a worker batch and a smoothed rate measured at light load would predict waits
several times too long). So the raw prediction is (queued + own) / rate, and the promise is
that times the factor measured from what admitted requests waited (`ttft_calibration`: the
queue drains slower than the peak rates say when workers also decode, and at another rate
when decode workers prefill too). Over `max_predicted_ttft_s` the request is refused,
and its retry hint is the time the queue needs to drain enough for it to fit:
predicted - max. A request is never refused for the TTFT with nothing queued before it
(waiting would not make it faster), nor before any rate is measured (the in-flight bound
still holds).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

from pdserve.router.ttft_calibration import CalibrationConfig, TtftCalibration

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
    # Correct the prediction by what admitted requests waited (None: the raw model alone).
    calibration: CalibrationConfig | None = CalibrationConfig()

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
    predicted_s: float  # this request's time to first token if admitted now: raw x factor
    queued_tokens: float  # prefill work admitted before it and not yet done
    own_tokens: int  # its own uncached prompt tokens
    tokens_per_s: float  # the prefill pool's measured rate
    factor: float = 1.0  # the measured correction (`ttft_calibration`)

    @property
    def raw_s(self) -> float:
        return (self.queued_tokens + self.own_tokens) / self.tokens_per_s


def predict_ttft(queued_tokens: float, own_tokens: int, tokens_per_s: float | None,
                 factor: float = 1.0) -> TtftPrediction | None:
    """(queued + own) / rate x factor; None without a usable rate (nothing measured yet)."""
    if tokens_per_s is None or not tokens_per_s > 0 or not math.isfinite(tokens_per_s):
        return None
    queued = max(0.0, float(queued_tokens))  # a float sum of adds and subtracts: no negatives
    own = max(0, int(own_tokens))
    return TtftPrediction((queued + own) / tokens_per_s * factor, queued, own,
                          float(tokens_per_s), factor)


@dataclass(eq=False)
class Ticket:
    """A request's prefill work in admission's queue, from `admit_prefill` to `prefilled`."""
    own_tokens: int
    prediction: TtftPrediction | None  # None: no rate measured when it was admitted
    admitted_s: float
    teaches: bool = False  # its wait corrects the prediction (`TtftCalibration.counts`)
    drained_at: float = 0.0  # admission's `drained` when it was admitted


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
        cal = self.config.calibration
        self.calibration = TtftCalibration(cal) if cal is not None else None
        self._waiting: dict[int, Ticket] = {}  # tickets that teach, until their first token
        self.drained = 0.0  # prompt tokens that ever left the queue
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

    def admit_prefill(self, own_tokens: int, tokens_per_s: float | None, now_s: float
                      ) -> Ticket:
        """Queue a request's prefill work (`own_tokens`, its uncached prompt tokens), or raise
        Overloaded when its predicted TTFT is over the bound."""
        c = self.config
        with self._lock:
            p = predict_ttft(self.queued_tokens, own_tokens, tokens_per_s,
                             self._factor(now_s))
            limit = c.max_predicted_ttft_s
            if limit > 0 and p is not None and p.queued_tokens > 0 and p.predicted_s > limit:
                self.rejected += 1
                wait = min(c.max_retry_after_s, max(0.1, p.predicted_s - limit))
                measured = f", x{p.factor:.2f} as measured" if p.factor != 1.0 else ""
                raise Overloaded(f"predicted time to first token {p.predicted_s:.2f}s is over "
                                 f"the limit of {limit:g}s ({p.queued_tokens:.0f} prompt tokens "
                                 f"queued at {p.tokens_per_s:.0f} tokens/s{measured})",
                                 round(wait, 3), PREDICTED_TTFT)
            own = max(0, int(own_tokens))
            self.queued_tokens += own
            t = Ticket(own, p, now_s, drained_at=self.drained)
            if (self.calibration is not None and p is not None
                    and self.calibration.counts(p.predicted_s, limit)):
                t.teaches = True
                self._waiting[id(t)] = t
            return t

    def prefilled(self, ticket: Ticket, now_s: float, answered: bool = True) -> None:
        """A request's prefill work is done (`answered`: its first token exists) or was given
        up (it failed, or its client left)."""
        with self._lock:
            self.queued_tokens = max(0.0, self.queued_tokens - ticket.own_tokens)
            self.drained += ticket.own_tokens
            taught = self._waiting.pop(id(ticket), None) is not None
            cal, p = self.calibration, ticket.prediction
            if taught and answered and cal is not None and p is not None:
                cal.observe(p.raw_s, now_s - ticket.admitted_s, now_s)

    def factor(self, now_s: float) -> float:
        """The correction admission applies now (1: the raw model)."""
        with self._lock:
            return self._factor(now_s)

    def _factor(self, now_s: float) -> float:
        cal = self.calibration
        if cal is None:
            return 1.0
        # Tickets that teach all carry a prediction (`admit_prefill`).
        waiting = [(t.prediction, t.admitted_s, t.drained_at) for t in self._waiting.values()
                   if t.prediction is not None]
        drain = None
        if waiting:
            p, at, drained_at = waiting[0]  # the oldest
            done = self.drained - drained_at
            drain = (now_s - at, done / p.tokens_per_s, done / max(1.0, p.queued_tokens))
        return cal.factor(now_s, [(p.raw_s, now_s - at) for p, at, _ in waiting], drain)
