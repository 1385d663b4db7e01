"""Every router of the cluster, as the controller reads and steers them.

Owns `merge_signals`, the pure rule that makes one cluster view of several routers' signals
(their finished requests together, their counters summed, each worker once with every
router's load on it summed and the freshest stats); `share_budgets`, the pure split of an
offload budget among the routers (each applies its share alone); and `Routers`, which finds
the routers (one named, or every router in the cluster's membership table on the store master),
keeps a channel to each, and moves workers where the cluster's membership lives (the table,
which every router follows, or the one named router). Must not decide anything: the
controller's policy does.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Sequence

import grpc

from pdserve import rpc
from pdserve.core.identity import ROUTER
from pdserve.kvstore.master.members import ROUTER_KIND
from pdserve.kvstore.members_client import MembersClient
from pdserve.proto import router_pb2 as rpb
from pdserve.proto import router_pb2_grpc as rpb_grpc
from pdserve.wire import PROTO_OF_STATE, role_to_proto

log = logging.getLogger(__name__)


def merge_signals(parts: Sequence[rpb.RouterSignals]) -> rpb.RouterSignals:
    """One view of the cluster from each router's signals. Pure."""
    out = rpb.RouterSignals()
    workers: dict[str, rpb.WorkerMember] = {}
    for p in parts:
        out.samples.extend(p.samples)
        out.in_flight_requests += p.in_flight_requests
        out.offloaded_requests_total += p.offloaded_requests_total
        out.offloaded_tokens_total += p.offloaded_tokens_total
        out.retries_total += p.retries_total
        out.admitted_output_tokens_total += p.admitted_output_tokens_total
        for w in p.workers:
            m = workers.get(w.address)
            if m is None:
                workers[w.address] = m = rpb.WorkerMember()
                m.CopyFrom(w)
                continue
            m.in_flight += w.in_flight
            m.in_flight_tokens += w.in_flight_tokens
            m.offload_in_flight_tokens += w.offload_in_flight_tokens
            m.offload_budget_tokens += w.offload_budget_tokens
            fresher = w.HasField("stats") and (
                not m.HasField("stats") or 0 <= w.last_seen_age_s < m.last_seen_age_s
                or m.last_seen_age_s < 0)
            if fresher:
                m.stats.CopyFrom(w.stats)
                m.last_seen_age_s = w.last_seen_age_s
                m.missed_polls = w.missed_polls
    out.workers.extend(workers[a] for a in sorted(workers))
    return out


def share_budgets(budgets: Sequence, routers: int) -> list[rpb.OffloadBudget]:
    """Each router's share of the controller's offload budgets: max_tokens / routers, rounded
    up (so every router may still offload), the chunk size and the predicted step carrying one
    chunk (each router's prefill deflection estimates with it) as they are. Pure."""
    n = max(1, routers)
    return [rpb.OffloadBudget(address=b.address, max_tokens=math.ceil(b.max_tokens / n),
                              chunk_tokens=b.chunk_tokens, step_s=b.step_s) for b in budgets]


class Routers:
    def __init__(self, named: str = "", masters: str = "", rpc_timeout_s: float = 10.0) -> None:
        if not named and not masters:
            raise ValueError("a router or the store master(s) is required")
        self.named = named
        self.table = MembersClient(masters) if masters else None
        self.rpc_timeout_s = rpc_timeout_s
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}

    def addresses(self) -> list[str]:
        """The routers to read and steer now: the named one, and every router in the table."""
        out = [self.named] if self.named else []
        if self.table is not None:
            view = self.table.watch(0, "", 0.0)
            out += [m.address for m in view.members
                    if m.kind == ROUTER_KIND and m.address not in out]
        return out

    def stub(self, address: str) -> rpb_grpc.RouterControlStub:
        with self._lock:
            ch = self._channels.get(address)
            if ch is None:
                ch = self._channels[address] = rpc.make_channel(address, ROUTER)
            return rpb_grpc.RouterControlStub(ch)

    def each(self, call, addresses: Sequence[str] | None = None) -> list:
        """`call(stub)` on every router (or on `addresses`); the answers of those that
        answered. Raises the last error when none did (a router that died is in the table
        until it expires)."""
        out, last = [], None
        for a in self.addresses() if addresses is None else addresses:
            try:
                out.append(call(self.stub(a)))
            except grpc.RpcError as e:
                log.warning("router %s: %s %s", a, e.code().name, e.details())
                last = e
        if not out and last is not None:
            raise last
        return out

    def move(self, address: str, state: str, role: str | None, reason: str) -> None:
        """Move a worker where the cluster's membership lives: the table when there is one
        (every router follows it), else the named router."""
        if self.table is not None:
            self.table.set_state(address, state, role or "", reason, self.rpc_timeout_s)
            return
        self.stub(self.named).SetWorkerState(rpb.SetWorkerStateRequest(
            address=address, state=PROTO_OF_STATE[state], role=role_to_proto(role),
            reason=reason), timeout=self.rpc_timeout_s)

    def close(self) -> None:
        with self._lock:
            for ch in self._channels.values():
                ch.close()
            self._channels.clear()
        if self.table is not None:
            self.table.close()
