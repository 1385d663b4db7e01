"""The safe role flip: drain, switch, verify, re-admit; or out of both pools and reported.

Owns the I/O of one flip, in this order:
1. the routers stop assigning to the worker (membership DRAINING, where the cluster's membership
   lives: the table every router follows, or the one router);
2. `SetRole(drain=True, migrate=True)` on the worker: a decode worker's running requests move
   to other decode workers with their KV, a prefill worker's finish first; new ones are
   refused (and re-routed by the router);
3. `GetStats` must show the new role and `role_switches` up by exactly one;
4. the routers admit the worker in its new pool (membership ACTIVE in the new role).
A router that has not yet seen the drain may still send the worker a request: the draining
worker refuses it and that router re-routes it. Any failure or timeout on the way leaves the
worker FAILED in the membership: out of
both pools, never half-switched, and the result says why. Only one flip per worker at a time.
Must not decide which worker to flip (the policy does) or keep statistics (the service does).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

import grpc

from pdserve import rpc
from pdserve.core.identity import WORKER
from pdserve.core.roles import ACTIVE, DRAINING, FAILED
from pdserve.proto import worker_pb2 as wpb
from pdserve.proto import worker_pb2_grpc as wpb_grpc
from pdserve.wire import role_from_proto, role_to_proto

log = logging.getLogger(__name__)


class FlipBusy(RuntimeError):
    """The worker is already being flipped."""


@dataclass(frozen=True)
class FlipOutcome:
    address: str
    from_role: str
    to_role: str
    ok: bool
    seconds: float  # drain + switch
    error: str = ""
    drained_requests: int = 0
    moved_requests: int = 0  # of those, decodes moved to other decode workers with their KV


@dataclass(frozen=True)
class MigrateOutcome:
    """Running decodes moved off a decode worker, keeping its role (the controller's balance)."""

    address: str
    requested: int
    moved: int  # streams ended there with their KV in the store; the router resumed each
    seconds: float
    error: str = ""


# Moves a worker in the cluster's membership: (address, state, role or None, reason).
Move = Callable[[str, str, "str | None", str], None]


class Flipper:
    def __init__(self, move: Move, rpc_timeout_s: float = 10.0) -> None:
        self.move = move
        self.rpc_timeout_s = rpc_timeout_s
        self._lock = threading.Lock()
        self._busy: dict[str, str] = {}  # address -> the role it is switching to
        self._channels: dict[str, grpc.Channel] = {}

    def busy(self) -> dict[str, str]:
        """Workers being flipped now, and the role each is switching to."""
        with self._lock:
            return dict(self._busy)

    def _worker(self, address: str) -> wpb_grpc.WorkerStub:
        with self._lock:
            ch = self._channels.get(address)
            if ch is None:
                ch = self._channels[address] = rpc.make_channel(address, WORKER)
        return wpb_grpc.WorkerStub(ch)

    def flip(self, address: str, to_role: str, drain_timeout_s: float,
             reason: str = "", migrate: bool = True) -> FlipOutcome:
        """Carry out one flip (blocking: drain time included). FlipBusy if one is under way.
        `migrate`: a decode worker's running requests move to other decode workers (the caller
        knows one is left to take them), rather than finishing in place."""
        with self._lock:
            if address in self._busy:
                raise FlipBusy(f"{address} is already switching")
            self._busy[address] = to_role
        start = time.monotonic()
        from_role = "?"
        try:
            worker = self._worker(address)
            before = worker.GetStats(wpb.GetStatsRequest(), timeout=self.rpc_timeout_s)
            from_role = role_from_proto(before.role) or "?"
            if from_role == to_role:
                self.move(address, ACTIVE, to_role, "already in that role")
                return FlipOutcome(address, from_role, to_role, True, 0.0)
            self.move(address, DRAINING, None, f"switching to {to_role}: {reason}")
            resp = worker.SetRole(wpb.SetRoleRequest(role=role_to_proto(to_role), drain=True,
                                                     drain_timeout_s=drain_timeout_s,
                                                     migrate=migrate),
                                  timeout=drain_timeout_s + self.rpc_timeout_s)
            after = worker.GetStats(wpb.GetStatsRequest(), timeout=self.rpc_timeout_s)
            if after.role != role_to_proto(to_role) or after.role_switches != before.role_switches + 1:
                raise _Unverified(f"after SetRole the worker reports role "
                                  f"{role_from_proto(after.role) or after.role} and "
                                  f"{after.role_switches - before.role_switches} switches")
            self.move(address, ACTIVE, to_role, f"switched to {to_role}")
            seconds = time.monotonic() - start
            log.info("flipped %s %s -> %s in %.2fs (%d drained, %d of them moved): %s",
                     address, from_role, to_role, seconds, resp.drained_requests,
                     resp.moved_requests, reason)
            return FlipOutcome(address, from_role, to_role, True, seconds,
                               drained_requests=resp.drained_requests,
                               moved_requests=resp.moved_requests)
        except (grpc.RpcError, _Unverified) as e:
            error = (f"{e.code().name}: {e.details()}" if isinstance(e, grpc.RpcError)
                     else str(e))
            log.warning("flip of %s to %s failed: %s; out of both pools", address, to_role,
                        error)
            try:
                self.move(address, FAILED, None, f"flip failed: {error}")
            except grpc.RpcError as e2:
                error += f"; and the membership could not be told: {e2.details()}"
            return FlipOutcome(address, from_role, to_role, False, time.monotonic() - start,
                               error)
        finally:
            with self._lock:
                self._busy.pop(address, None)

    def migrate(self, address: str, count: int, reason: str, timeout_s: float
                ) -> MigrateOutcome:
        """Move `count` running decodes off `address` (blocking: pre-copy and stop included);
        a failed call moves nothing the router does not resume, and is reported, not raised."""
        start = time.monotonic()
        try:
            resp = self._worker(address).Migrate(wpb.MigrateRequest(count=count, reason=reason),
                                                 timeout=timeout_s)
            return MigrateOutcome(address, count, resp.moved_requests,
                                  time.monotonic() - start)
        except grpc.RpcError as e:
            log.warning("migration off %s failed: %s: %s", address, e.code().name, e.details())
            return MigrateOutcome(address, count, 0, time.monotonic() - start,
                                  f"{e.code().name}: {e.details()}")

    def readmit(self, address: str, reason: str) -> str | None:
        """A FAILED worker back into the pool of the role it reports; its role name, or None
        when it does not answer or is still draining."""
        try:
            s = self._worker(address).GetStats(wpb.GetStatsRequest(), timeout=self.rpc_timeout_s)
        except grpc.RpcError:
            return None
        role = role_from_proto(s.role)
        if role is None or s.draining:
            return None
        self.move(address, ACTIVE, role, reason)
        return role

    def close(self) -> None:
        with self._lock:
            for ch in self._channels.values():
                ch.close()
            self._channels.clear()


class _Unverified(Exception):
    """GetStats after the switch does not show the new role and exactly one more switch."""
