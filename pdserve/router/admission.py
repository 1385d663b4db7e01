"""Admission at the front door: a bound on requests in flight, per tenant and overall, and a
token-bucket rate limit per tenant. Pure: the caller passes `now_s`; no clock, no I/O.

Owns the decision "take this request now, or refuse it with a retry hint" (invariant 5: past a
bound the caller gets RESOURCE_EXHAUSTED / HTTP 429, never a queue that grows without limit).
Must not know gRPC or HTTP: `Overloaded` carries the message and `retry_after_s`; the adapters
map it to their status codes and headers.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass


class Overloaded(Exception):
    """The request is refused for now; retry after `retry_after_s` seconds."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(f"{message}; retry after {retry_after_s:g}s")
        self.retry_after_s = retry_after_s


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


@dataclass
class _Bucket:
    tokens: float
    at_s: float


class Admission:
    """Counts requests in flight; `admit` takes one (or raises Overloaded), `release` gives it
    back. Thread-safe (the gRPC server calls it from many threads)."""

    def __init__(self, config: AdmissionConfig | None = None) -> None:
        self.config = config or AdmissionConfig()
        self._lock = threading.Lock()
        self.in_flight = 0
        self._per_tenant: dict[str, int] = {}
        self._buckets: dict[str, _Bucket] = {}  # insertion order = least recently seen first
        self.rejected = 0

    def admit(self, tenant: str, now_s: float) -> None:
        c = self.config
        with self._lock:
            if self.in_flight >= c.max_in_flight:
                self.rejected += 1
                raise Overloaded(f"the router holds {self.in_flight} requests, its limit",
                                 c.busy_retry_after_s)
            held = self._per_tenant.get(tenant, 0)
            if c.max_in_flight_per_tenant and held >= c.max_in_flight_per_tenant:
                self.rejected += 1
                raise Overloaded(f"tenant {tenant or 'default'!r} has {held} requests in flight, "
                                 "its limit", c.busy_retry_after_s)
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
                             f"{c.tenant_rate_rps:g} requests/s", round(max(wait, 0.001), 3))
        b.tokens -= 1.0

    def release(self, tenant: str) -> None:
        with self._lock:
            self.in_flight -= 1
            n = self._per_tenant.get(tenant, 0) - 1
            if n > 0:
                self._per_tenant[tenant] = n
            else:
                self._per_tenant.pop(tenant, None)
