"""Routing policies as pure cores: the workers' loads in, a choice out; no I/O, no clock.

The controller's simulator runs these unchanged. A policy sees only `WorkerLoad`s (the router's
view of each worker), never sockets or stubs.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerLoad:
    address: str
    in_flight: int  # requests the router has sent and not yet seen finish
    healthy: bool = True


class NoWorkerError(RuntimeError):
    """No healthy worker of the needed role (mapped to UNAVAILABLE)."""


class RoundRobin:
    def __init__(self) -> None:
        self._next = 0

    def choose(self, workers: list[WorkerLoad]) -> int:
        live = [i for i, w in enumerate(workers) if w.healthy]
        if not live:
            raise NoWorkerError("no healthy worker")
        pick = live[self._next % len(live)]
        self._next += 1
        return pick


class LeastLoaded:
    """Fewest requests in flight; ties go to the lowest index, so the choice is deterministic."""

    def choose(self, workers: list[WorkerLoad]) -> int:
        live = [(w.in_flight, i) for i, w in enumerate(workers) if w.healthy]
        if not live:
            raise NoWorkerError("no healthy worker")
        return min(live)[1]


POLICIES = {"round_robin": RoundRobin, "least_loaded": LeastLoaded}
