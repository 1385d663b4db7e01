"""The router's control API (pdserve.v1.RouterControl) and the request signals it reports.

Owns `RequestSignals`, the bounded ring of finished requests' samples (TTFT, mean time per
output token, tokens and the max_tokens allowed, offloaded, retries, how it ended, its path and
prefill deflection) with the cumulative offload, retry and admitted-output counters, and
`RouterControlServicer`: membership for the controller and operators (list, register, move
between states), the controller's offload budgets, and the windowed signals.
Must not route requests or decide transitions: `pool.WorkerSet` carries out membership, and
`membership.py` decides what each move means.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from pdserve import rpc
from pdserve.core.identity import WORKER
from pdserve.proto import router_pb2 as rpb
from pdserve.proto import router_pb2_grpc as rpb_grpc
from pdserve.proto import worker_pb2 as wpb
from pdserve.proto import worker_pb2_grpc as wpb_grpc
from pdserve.router.membership import InvalidBudgetError, Member, UnknownMemberError
from pdserve.router.pool import WorkerSet
from pdserve.wire import (PROTO_OF_ROLE, PROTO_OF_STATE, STATE_OF_PROTO,  # noqa: F401
                          role_from_proto, role_to_proto)

log = logging.getLogger(__name__)

DEFAULT_WINDOW_S = 30.0
MAX_SAMPLES = 4096
# How long RegisterWorker waits for a worker's GetStats (its role).
REGISTER_TIMEOUT_S = 5.0


def tpot_of(e2e_s: float, ttft_s: float, output_tokens: int) -> float:
    """Mean time per output token after the first; 0 with a single token (no gap to time)."""
    return (e2e_s - ttft_s) / (output_tokens - 1) if output_tokens > 1 else 0.0


@dataclass(frozen=True)
class Sample:
    """One finished request."""

    finished_s: float  # the router's clock when it ended
    ttft_s: float  # 0 if no token was sent
    tpot_s: float
    prompt_tokens: int
    output_tokens: int
    offloaded: bool
    retries: int
    finish: str  # "stop", "length", "abort" or an error status name
    path: str = ""  # the route that served it (`route.Route.kind`; "": none was planned)
    # The prefill deflection, when an offload budget fit it: DECODE or PREFILL ("": none fit),
    # and the estimated times to first token it weighed (None: not estimated).
    deflection: str = ""
    prefill_ttft_estimate_s: float | None = None
    decode_ttft_estimate_s: float | None = None
    max_tokens: int = 0  # the most output tokens it was allowed (0: not known)


class RequestSignals:
    """Finished requests (the last `max_samples`) and cumulative counters. Thread-safe."""

    def __init__(self, max_samples: int = MAX_SAMPLES) -> None:
        if max_samples < 1:
            raise ValueError(f"max_samples must be >= 1, got {max_samples}")
        self._lock = threading.Lock()
        self._samples: deque[Sample] = deque(maxlen=max_samples)  # bounded: oldest go first
        self.in_flight = 0
        self.offloaded_requests_total = 0
        self.offloaded_tokens_total = 0
        self.retries_total = 0
        self.admitted_output_tokens_total = 0

    def expect_output(self, max_tokens: int) -> None:
        """An admitted request's parameters are read: it may decode up to `max_tokens`."""
        with self._lock:
            self.admitted_output_tokens_total += max(0, max_tokens)

    def started(self) -> None:
        with self._lock:
            self.in_flight += 1

    def finished(self, sample: Sample) -> None:
        with self._lock:
            self.in_flight -= 1
            self._samples.append(sample)

    def retried(self) -> None:
        with self._lock:
            self.retries_total += 1

    def offloaded(self, prompt_tokens: int) -> None:
        with self._lock:
            self.offloaded_requests_total += 1
            self.offloaded_tokens_total += prompt_tokens

    def window(self, now: float, window_s: float) -> list[Sample]:
        """Samples that finished within `window_s` before `now`, oldest first."""
        with self._lock:
            return [s for s in self._samples if now - s.finished_s <= window_s]

    def __len__(self) -> int:
        with self._lock:
            return len(self._samples)


def member_proto(m: Member, now: float) -> rpb.WorkerMember:
    out = rpb.WorkerMember(
        address=m.address, role=role_to_proto(m.role), state=PROTO_OF_STATE[m.state],
        in_flight=m.in_flight, in_flight_tokens=m.in_flight_tokens,
        offload_in_flight_tokens=m.offload_tokens, offload_budget_tokens=m.offload_budget,
        last_seen_age_s=-1.0 if m.last_seen_s is None else max(0.0, now - m.last_seen_s),
        reason=m.reason, missed_polls=m.missed)
    if m.stats is not None:
        out.stats.CopyFrom(m.stats)
    return out


class RouterControlServicer(rpb_grpc.RouterControlServicer):
    def __init__(self, workers: WorkerSet, signals: RequestSignals,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.workers = workers
        self.signals = signals
        self.clock = clock

    def _members(self) -> list[rpb.WorkerMember]:
        now = self.clock()
        return [member_proto(m, now) for m in self.workers.members()]

    def ListWorkers(self, request, context):
        return rpb.ListWorkersResponse(workers=self._members())

    def RegisterWorker(self, request, context):
        if not request.address:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "address: required")
        if request.role not in (wpb.ROLE_UNSPECIFIED, *PROTO_OF_ROLE.values()):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"role: unknown value {request.role}")
        role = role_from_proto(request.role)
        stats = None
        if role is None:  # ask the worker which role it hosts
            try:
                with rpc.make_channel(request.address, WORKER) as ch:
                    stats = wpb_grpc.WorkerStub(ch).GetStats(wpb.GetStatsRequest(),
                                                             timeout=REGISTER_TIMEOUT_S)
            except grpc.RpcError as e:
                context.abort(grpc.StatusCode.UNAVAILABLE,
                              f"address: cannot reach worker {request.address} for its role: "
                              f"{e.code().name} {e.details()}")
            role = role_from_proto(stats.role)
            if role is None:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"address: worker {request.address} reports no role")
        self.workers.join(request.address, role)
        if stats is not None:
            self.workers.report(request.address, stats)
        return member_proto(self.workers.get(request.address), self.clock())

    def SetWorkerState(self, request, context):
        state = STATE_OF_PROTO.get(request.state)
        if state is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          "state: must be ACTIVE, DRAINING, GONE or FAILED")
        if request.role not in (wpb.ROLE_UNSPECIFIED, *PROTO_OF_ROLE.values()):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"role: unknown value {request.role}")
        try:
            m = self.workers.set_state(request.address, state, role_from_proto(request.role),
                                       request.reason)
        except UnknownMemberError as e:
            context.abort(grpc.StatusCode.NOT_FOUND, f"address: {e}")
        log.info("control: %s set to %s (%s) by %s", request.address, state,
                 request.reason or "no reason given", rpc.caller() or "an unauthenticated caller")
        return member_proto(m, self.clock())

    def SetOffloadBudgets(self, request, context):
        budgets: dict[str, tuple[int, int, float]] = {}
        for b in request.budgets:
            if b.address in budgets:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"budgets.address: {b.address} appears twice")
            budgets[b.address] = (b.max_tokens, b.chunk_tokens, b.step_s)
        try:
            self.workers.set_offload_budgets(budgets)
        except InvalidBudgetError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return rpb.SetOffloadBudgetsResponse()

    def GetSignals(self, request, context):
        if request.window_s < 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"window_s: must be >= 0, got {request.window_s}")
        now = self.clock()
        window = request.window_s or DEFAULT_WINDOW_S
        s = self.signals
        samples = [rpb.RequestSample(
            age_s=max(0.0, now - x.finished_s), ttft_s=x.ttft_s, tpot_s=x.tpot_s,
            prompt_tokens=x.prompt_tokens, output_tokens=x.output_tokens, offloaded=x.offloaded,
            retries=x.retries, finish=x.finish, path=x.path, deflection=x.deflection,
            prefill_ttft_estimate_s=x.prefill_ttft_estimate_s or 0.0,
            decode_ttft_estimate_s=x.decode_ttft_estimate_s or 0.0, max_tokens=x.max_tokens)
            for x in s.window(now, window)]
        return rpb.RouterSignals(
            samples=samples, workers=self._members(), in_flight_requests=s.in_flight,
            offloaded_requests_total=s.offloaded_requests_total,
            offloaded_tokens_total=s.offloaded_tokens_total, retries_total=s.retries_total,
            admitted_output_tokens_total=s.admitted_output_tokens_total)
