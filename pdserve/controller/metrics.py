"""The controller's Prometheus metrics (`pdserve:<name>`), in a registry of its own.

Owns the metric definitions: decisions by action and reason, role switches by direction and
their duration (drain + switch), workers by role and state, prefill tokens offloaded to decode
workers, the pressure per role, and each tick's time by part. Must not decide anything.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdserve.core.roles import ROLES, WORKER_STATES as STATES
from pdserve.security.failures import AuthFailureCollector

_SWITCH_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_TICK_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                   0.25, 0.5, 1.0, 2.5)


class ControllerMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        r.register(AuthFailureCollector())
        self.decisions = Counter("pdserve:controller_decisions",
                                 "Controller decisions by action and reason.",
                                 ["action", "reason"], registry=r)
        self.role_switches = Counter("pdserve:role_switches",
                                     "Completed role switches by direction.", ["from", "to"],
                                     registry=r)
        self.role_switch_failures = Counter("pdserve:role_switch_failures",
                                            "Role switches that failed or timed out.",
                                            ["from", "to"], registry=r)
        self.role_switch_seconds = Histogram("pdserve:role_switch_seconds",
                                             "Drain plus switch time of a role switch.",
                                             buckets=_SWITCH_BUCKETS_S, registry=r)
        self.workers = Gauge("pdserve:workers", "Workers by role and state.", ["role", "state"],
                             registry=r)
        self.offloaded_tokens = Counter("pdserve:prefill_offloaded_tokens",
                                        "Prompt tokens prefilled on decode workers.", registry=r)
        self.tick_seconds = Histogram(
            "pdserve:controller_tick_seconds",
            "One tick, by part: observe (the router's signals and the cluster view), decide "
            "(the policy), whole (both, the audit and the flips' start).", ["part"],
            buckets=_TICK_BUCKETS_S, registry=r)
        self.pressure = Gauge("pdserve:pressure",
                              "Pressure per role (1.0: queued work just meets the SLO share).",
                              ["role"], registry=r)
        self._offloaded_seen: int | None = None

    def set_workers(self, counts: dict[tuple[str, str], int]) -> None:
        for role in ROLES:
            for state in STATES:
                self.workers.labels(role, state).set(counts.get((role, state), 0))

    def offloaded_total(self, total: int) -> None:
        """The router's cumulative count; the counter follows its increases (a router restart
        resets the base, never the counter)."""
        if self._offloaded_seen is not None and total >= self._offloaded_seen:
            self.offloaded_tokens.inc(total - self._offloaded_seen)
        elif self._offloaded_seen is None and total > 0:
            self.offloaded_tokens.inc(total)
        self._offloaded_seen = total
