"""Failed authentications of this process, counted by service and reason.

Owns the process-wide count (`record`, `snapshot`) and its Prometheus face
(`pdserve:auth_failures_total{service,reason}`, a collector any registry of this process can
add). A refusal is counted where it is decided: the gRPC guard (`pdserve.rpc`), the router's
public doors (API keys), the store's data plane (a TLS handshake that fails). Labels are a
service name and a fixed reason, never a credential. Must not decide anything.
"""

from __future__ import annotations

import threading

from prometheus_client.core import CounterMetricFamily

_lock = threading.Lock()
# (service, reason) -> count. Bounded: services and reasons are fixed sets, and an unknown
# method's service is folded into one label by the caller.
_counts: dict[tuple[str, str], int] = {}
_MAX_LABELS = 256


def record(service: str, reason: str) -> None:
    with _lock:
        key = (service, reason)
        if key not in _counts and len(_counts) >= _MAX_LABELS:
            key = ("other", reason)
        _counts[key] = _counts.get(key, 0) + 1


def snapshot() -> dict[tuple[str, str], int]:
    with _lock:
        return dict(_counts)


class AuthFailureCollector:
    """`pdserve:auth_failures_total{service,reason}` for a registry's scrape."""

    def collect(self):
        family = CounterMetricFamily(
            "pdserve:auth_failures", "Calls refused for want of a valid credential or the right "
            "to call, by service and reason", labels=["service", "reason"])
        for (service, reason), n in sorted(snapshot().items()):
            family.add_metric([service, reason], n)
        yield family

    def describe(self):
        return []
