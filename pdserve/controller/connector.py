"""How the controller's loop reaches a cluster: the live one, through the router's control API
and the workers (the simulator has its own connector, `sim/control.py`).

Owns `Connector`, what `service.Controller`'s tick asks of a cluster (its signals; which
workers are switching; the offload budgets set; a flip or a migration of running decodes
started in the background, its outcome handed back; a worker whose flip failed re-admitted); `OperatorFlips`, what an operator's flip
needs besides (a flip carried out before returning: the live cluster's, which has operators);
and `LiveConnector`, which does both with `routers.Routers` (every router of the cluster: their
signals as one, a share of the budgets to each, moves where the membership lives) and a
`flip.Flipper` (flips on threads of their own, waited for on close), as Dynamo's planner acts
through its connectors.
Must not decide anything: the controller's policy does.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from pdserve.controller.flip import Flipper, FlipOutcome, MigrateOutcome
from pdserve.controller.routers import Routers, merge_signals, share_budgets
from pdserve.proto import router_pb2 as rpb

# The flip's outcome and the reason it was started, handed back to the controller.
Done = Callable[[FlipOutcome, str], None]
Migrated = Callable[[MigrateOutcome], None]
# Longest a migration call may take: pre-copy of every moved sequence's blocks, then the stop.
MIGRATE_TIMEOUT_S = 30.0


class Connector(Protocol):
    def signals(self, window_s: float) -> rpb.RouterSignals:
        """The router's signals over the last `window_s` (members, samples, counters)."""

    def switching(self) -> dict[str, str]:
        """Workers being flipped now, and the role each is switching to."""

    def set_budgets(self, budgets: Sequence) -> None:
        """The offload budgets (`policy.OffloadBudget`s, each with the step time the router's
        prefill deflection estimates with) the router applies from now on."""

    def start_flip(self, address: str, to_role: str, reason: str, drain_timeout_s: float,
                   done: Done, migrate: bool = True) -> None:
        """Begin a flip; `done(outcome, reason)` once it ended (or never: not started, e.g.
        the worker is no longer where the decision saw it). `migrate`: a decode worker's
        running requests move to the other decode workers with their KV."""

    def migrate(self, address: str, count: int, reason: str, done: Migrated) -> None:
        """Begin moving `count` running decodes off a decode worker, keeping its role;
        `done(outcome)` once they moved (or never: not started)."""

    def readmit(self, address: str, reason: str) -> str | None:
        """A worker whose flip failed back into the pool of its role; that role, or None."""

    def close(self, wait_s: float) -> None:
        """Flips in flight get `wait_s` to end, then the connector lets go of the cluster."""


@runtime_checkable
class OperatorFlips(Protocol):
    def flip(self, address: str, to_role: str, drain_timeout_s: float, reason: str,
             migrate: bool = True) -> FlipOutcome:
        """A flip carried out before returning (an operator's); FlipBusy if one is under way.
        `migrate`: a decode worker's running requests move to the other decode workers."""


class LiveConnector:
    def __init__(self, routers: Routers, rpc_timeout_s: float = 10.0) -> None:
        self.routers = routers
        self.rpc_timeout_s = rpc_timeout_s
        self.flipper = Flipper(routers.move, rpc_timeout_s)
        self._lock = threading.Lock()
        self._threads: set[threading.Thread] = set()  # bounded: a flip per worker at most

    def signals(self, window_s: float) -> rpb.RouterSignals:
        request = rpb.GetSignalsRequest(window_s=window_s)
        return merge_signals(self.routers.each(
            lambda r: r.GetSignals(request, timeout=self.rpc_timeout_s)))

    def switching(self) -> dict[str, str]:
        return self.flipper.busy()

    def set_budgets(self, budgets: Sequence) -> None:
        routers = self.routers.addresses()
        request = rpb.SetOffloadBudgetsRequest(budgets=share_budgets(budgets, len(routers)))
        self.routers.each(lambda r: r.SetOffloadBudgets(request, timeout=self.rpc_timeout_s),
                          routers)

    def flip(self, address: str, to_role: str, drain_timeout_s: float, reason: str,
             migrate: bool = True) -> FlipOutcome:
        return self.flipper.flip(address, to_role, drain_timeout_s, reason, migrate)

    def start_flip(self, address: str, to_role: str, reason: str, drain_timeout_s: float,
                   done: Done, migrate: bool = True) -> None:
        """On a thread of its own (a drain may take seconds)."""
        self._background(f"flip-{address}", lambda: done(
            self.flip(address, to_role, drain_timeout_s, reason, migrate), reason))

    def migrate(self, address: str, count: int, reason: str, done: Migrated) -> None:
        """On a thread of its own (a pre-copy may take seconds)."""
        self._background(f"migrate-{address}", lambda: done(
            self.flipper.migrate(address, count, reason, MIGRATE_TIMEOUT_S)))

    def _background(self, name: str, work: Callable[[], None]) -> None:
        def run() -> None:
            try:
                work()
            finally:
                with self._lock:
                    self._threads.discard(threading.current_thread())

        t = threading.Thread(target=run, name=name, daemon=True)
        with self._lock:
            self._threads.add(t)
        t.start()

    def readmit(self, address: str, reason: str) -> str | None:
        return self.flipper.readmit(address, reason)

    def close(self, wait_s: float) -> None:
        """Flips in flight may take `wait_s` to end and be logged before the channel closes
        (closing it under a flip cancels the controller's side of it while the worker may
        still switch: the audit would say failed for a flip that happened)."""
        deadline = time.monotonic() + wait_s
        with self._lock:
            threads = list(self._threads)
        for t in threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        self.flipper.close()
        self.routers.close()
