"""A request's life in the router, from the door to its last token, and the router's closing.

Owns, for every Generate call:
- the door (`Door.enter`, `admit_prefill`): once `close()` ran, UNAVAILABLE "router shutting
  down" with a retry hint (a client or load balancer goes to another router); while no request
  can be served (`membership.health_of`), UNAVAILABLE naming why; admission
  (`admission.Admission`: the in-flight and tenant bounds at arrival, the predicted-TTFT bound
  over the pool's measured prefill rate once the prompt is tokenized), refused with
  RESOURCE_EXHAUSTED and a `retry-after` trailer; each refusal counted by reason in
  `pdserve:requests_rejected_total`;
- its record (`Trip`: what its metrics, its sample for the controller and resuming it need)
  and the bookkeeping along the way: its path and prefill deflection (`routed`, the latter
  counted in `pdserve:deflections_total`), queue time at the first pick, TTFT and inter-token
  gaps as responses go out, end-to-end latency, tokens, the finish reason, the sample in
  `control.RequestSignals`;
- its worker calls in flight, which `expire()` cancels when the shutdown deadline passes, so
  the request ends with UNAVAILABLE "router shutting down", not gRPC's "Cancelling all calls";
and the shutdown schedule (`shutdown_plan`, pure).
Must not route or retry: `service.py` does; `server.py` runs the shutdown.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import grpc

from pdserve.core import finish as fin
from pdserve.metrics import RouterMetrics
from pdserve.proto import common_pb2
from pdserve.router.admission import Admission, Overloaded
from pdserve.router.control import RequestSignals, Sample, tpot_of
from pdserve.router.pool import WorkerSet
from pdserve.wire import finish_from_proto

log = logging.getLogger(__name__)
_UNSET = common_pb2.FINISH_REASON_UNSPECIFIED

SHUTTING_DOWN = "router shutting down"
# Retry hints, in seconds: a shutting-down router (another router serves at once), and a
# cluster that cannot serve now (no worker, or one failed: membership polls each second).
SHUTDOWN_RETRY_AFTER_S = 1.0
UNAVAILABLE_RETRY_AFTER_S = 1.0
_RETRY = re.compile(r"retry after (\d+(?:\.\d+)?)s")
# A quarter of the grace, at most 2 s and at least half a second (all of a shorter grace), is
# kept to end late requests with a clear status and stop the servers, so the process exits
# within the grace and a busy host still ends every late call itself.
_STOP_RESERVE_S = 2.0
_STOP_RESERVE_MIN_S = 0.5


@dataclass(frozen=True)
class ShutdownPlan:
    requests_until_s: float  # requests in flight may run until then; later ones are ended
    stop_by_s: float  # the servers are stopped by then


def stop_reserve_s(grace_s: float) -> float:
    """How much of the grace ends late requests and stops the servers."""
    return min(grace_s, max(_STOP_RESERVE_MIN_S, min(_STOP_RESERVE_S, grace_s / 4)))


def shutdown_plan(now_s: float, grace_s: float) -> ShutdownPlan:
    """The grace split in two: requests in flight may finish until `requests_until_s`; the rest
    of it (`stop_reserve_s`) ends the late ones and stops the servers."""
    if not grace_s >= 0:
        raise ValueError(f"grace_s must be >= 0, got {grace_s}")
    reserve = stop_reserve_s(grace_s)
    return ShutdownPlan(max(now_s, now_s + grace_s - reserve), now_s + grace_s)


def abort_with_hint(context, code: grpc.StatusCode, message: str,
                    retry_after_s: float | None = None):
    """End the call with `code`; RESOURCE_EXHAUSTED and UNAVAILABLE carry a retry hint in the
    `retry-after` trailer (seconds) and the message, as every refusal of this router does
    (default: the message's own "retry after Ns", a worker's, else 1 s)."""
    if retry_after_s is None and code in (grpc.StatusCode.UNAVAILABLE,
                                          grpc.StatusCode.RESOURCE_EXHAUSTED):
        m = _RETRY.search(message)
        retry_after_s = float(m.group(1)) if m else UNAVAILABLE_RETRY_AFTER_S
    if retry_after_s is not None:
        context.set_trailing_metadata((("retry-after", f"{retry_after_s:g}"),))
        if "retry after" not in message:
            message = f"{message}; retry after {retry_after_s:g}s"
    context.abort(code, message)


@dataclass
class Trip:
    """One admitted request: what its metrics and sample need, and what resuming it needs."""

    arrival: float
    tenant: str = ""
    waiting: bool = True  # no worker took it yet
    prompt_tokens: int = 0
    prompt_ids: list[int] = field(default_factory=list)  # once tokenized
    max_tokens: int = 0  # once its parameters are read
    retries: int = 0  # re-routes, resumes and the prefill fallback
    resumes: int = 0
    offloaded: bool = False
    path: str = ""  # the route that serves it (`route.Route.kind`)
    deflection: Any = None  # the prefill deflection when an offload budget fit (`deflect.py`)
    error: str = ""  # the status name the client got, when it failed
    # Every token sent to the client, the first one included: a resumed decode recomputes them.
    emitted: list[int] = field(default_factory=list)
    ticket: Any = None  # its prefill work in admission's queue until its first token
    predicted_ttft_s: float | None = None  # what admission predicted for it (None: nothing)
    first_s: float | None = None  # when its first token went out
    last_s: float | None = None  # when its last tokens went out
    sent: int = 0  # tokens sent
    finish: str | None = None
    # Several choices (`choices.py`): the first one's `lead` says where its prompt is decoded;
    # the others `follow` it there.
    lead: Any = None
    follow: Any = None
    # Where a decode relayed on its stream's reader thread sends its messages (the client's own
    # stream, after what `Generate` yields does to each); None: they are yielded.
    emit: Callable[[Any], None] | None = None
    moved_s: float | None = None  # its decode moved: when its last tokens before went out


def _deflection_note(d) -> str:
    """The finish line's words for a prefill deflection ("": none was made)."""
    if d is None:
        return ""

    def est(s: float | None) -> str:
        return "?" if s is None else f"{s:.3f}s"

    return (f", deflected to {d.choice} (estimated TTFT prefill {est(d.prefill_ttft_s)}, "
            f"decode {est(d.decode_ttft_s)})")


class Door:
    """Admission and the shutdown gate for the gRPC service. Thread-safe."""

    def __init__(self, admission: Admission, workers: WorkerSet, metrics: RouterMetrics,
                 signals: RequestSignals, clock: Callable[[], float] = time.monotonic) -> None:
        self.admission = admission
        self.workers = workers
        self.metrics = metrics
        self.signals = signals
        self.clock = clock
        self._lock = threading.Lock()
        self._closed = False
        self._expired = False
        self._calls: set = set()  # worker calls in flight: at most a few per admitted request

    # ---- a request's way through ----------------------------------------------------------------
    def enter(self, tenant: str, context, arrival_s: float) -> Trip:
        """Admit a request that arrived at `arrival_s`, or end its call with the refusal."""
        if self._closed:
            self.metrics.rejected("shutting_down")
            abort_with_hint(context, grpc.StatusCode.UNAVAILABLE, SHUTTING_DOWN,
                            SHUTDOWN_RETRY_AFTER_S)
        h = self.workers.health()
        if not h.serving:  # it would fail at its first pick, after work done for nothing
            self.metrics.rejected("not_serving")
            abort_with_hint(context, grpc.StatusCode.UNAVAILABLE, h.summary)
        try:
            self.admission.admit(tenant, arrival_s)
        except Overloaded as e:
            self._refuse(context, e)
        self.metrics.waiting.inc()
        self.signals.started()
        return Trip(arrival_s, tenant)

    def expect_output(self, trip: Trip, max_tokens: int) -> None:
        """Its parameters are read: the decode work it may bring counts in the signals."""
        trip.max_tokens = max_tokens
        self.signals.expect_output(max_tokens)

    def admit_prefill(self, trip: Trip, prompt_ids, context) -> None:
        """Queue the request's prefill work unless its predicted TTFT is over the bound (then
        end its call with the refusal)."""
        cfg = self.admission.config
        if cfg.max_predicted_ttft_s <= 0:
            return
        if trip.follow is not None:
            # A further choice computes only the prompt's last partial block, on the decode
            # worker that holds the rest (`choices.py`).
            bs = self.workers.block_size_tokens
            own = len(prompt_ids) - (len(prompt_ids) - 1) // bs * bs
        else:
            cached = self.workers.cached_prefix_tokens(prompt_ids, trip.tenant)
            # One token is always computed, however much of the prompt is cached.
            own = max(1, len(prompt_ids) - cached)
        try:
            t = self.admission.admit_prefill(own, self.workers.prefill_rate(peak=True),
                                             self.clock())
        except Overloaded as e:
            trip.error = "RESOURCE_EXHAUSTED"
            self._refuse(context, e)
        trip.ticket = t
        trip.predicted_ttft_s = t.prediction.predicted_s if t.prediction is not None else None
        if t.prediction is not None:
            self.metrics.ttft_factor.set(t.prediction.factor)

    def routed(self, trip: Trip, route) -> None:
        """`route.plan` chose `route` for the request: its path, and the prefill deflection
        (the first made for it), counted by choice."""
        trip.path = route.kind
        d = route.deflection
        if d is not None and trip.deflection is None:
            trip.deflection = d
            self.metrics.deflected(d.choice)
            log.debug("deflection: %s (%s)", d.choice, d.reason)

    def picked(self, trip: Trip) -> None:
        """A worker took the request: it leaves the queue (counted once, at the first pick)."""
        if not trip.waiting:
            return
        self.metrics.queue_time.observe(self.clock() - trip.arrival)
        self.metrics.waiting.dec()
        self.metrics.running.inc()
        trip.waiting = False

    def _prefilled(self, trip: Trip, answered: bool) -> None:
        if trip.ticket is not None:
            self.admission.prefilled(trip.ticket, self.clock(), answered)
            trip.ticket = None

    def sent(self, trip: Trip, resp) -> None:
        """A response goes to the client: its tokens' timing, and at the end the request's."""
        m, now = self.metrics, self.clock()
        if resp.token_ids:
            trip.sent += len(resp.token_ids)
            if trip.last_s is None:
                trip.first_s = now
                self._prefilled(trip, True)  # its prefill is done: its work leaves the queue
                m.ttft.observe(now - trip.arrival)
                if trip.predicted_ttft_s:  # how far admission's promise was from what happened
                    m.ttft_over_predicted.observe((now - trip.arrival) / trip.predicted_ttft_s)
            else:
                gap = (now - trip.last_s) / len(resp.token_ids)
                for _ in resp.token_ids:
                    m.itl.observe(gap)
                if trip.moved_s is not None:  # the first tokens after its decode moved
                    m.migration_stall.observe(now - trip.moved_s)
                    trip.moved_s = None
            trip.last_s = now
        if resp.finish_reason == _UNSET:
            return
        trip.finish = finish_from_proto(resp.finish_reason)
        u = resp.usage
        m.e2e.observe(now - trip.arrival)
        m.prompt_tokens.inc(u.prompt_tokens)
        m.generation_tokens.inc(u.completion_tokens)
        m.prefix_queries.inc(u.prompt_tokens)
        m.prefix_hits.inc(u.cached_prompt_tokens)
        m.finished(trip.finish)
        log.info("finished: %s, %d prompt tokens (%d cached), %d generated, %.3f s, %s%s%s%s",
                 trip.finish, u.prompt_tokens, u.cached_prompt_tokens, u.completion_tokens,
                 now - trip.arrival, trip.path or "no path",
                 ", offloaded" if trip.offloaded else "", _deflection_note(trip.deflection),
                 f", {trip.retries} retries" if trip.retries else "")

    def leave(self, trip: Trip) -> None:
        """The request ended (finished, failed, or its client left): its sample, its slot."""
        m = self.metrics
        (m.waiting if trip.waiting else m.running).dec()
        if trip.finish is None:
            m.finished(fin.ABORT)
        end = self.clock()
        ttft = 0.0 if trip.first_s is None else trip.first_s - trip.arrival
        if trip.offloaded:
            self.signals.offloaded(trip.prompt_tokens)
        d = trip.deflection
        self.signals.finished(Sample(
            end, ttft, tpot_of(end - trip.arrival, ttft, trip.sent), trip.prompt_tokens,
            trip.sent, trip.offloaded, trip.retries, trip.finish or trip.error or fin.ABORT,
            trip.path, "" if d is None else d.choice, None if d is None else d.prefill_ttft_s,
            None if d is None else d.decode_ttft_s, trip.max_tokens))
        self._prefilled(trip, False)  # a request that ended before its first token
        self.admission.release(trip.tenant)

    def _refuse(self, context, e: Overloaded):
        self.metrics.rejected(e.reason)
        abort_with_hint(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(e), e.retry_after_s)

    @contextmanager
    def worker_call(self, call):
        """Hold a worker call (a future or a stream) so that `expire()` can cancel it."""
        with self._lock:
            self._calls.add(call)
            expired = self._expired
        if expired:
            call.cancel()
        try:
            yield call
        finally:
            with self._lock:
                self._calls.discard(call)

    def result(self, call, context):
        """The answer of a unary worker call (a future), cancelled at the shutdown deadline."""
        with self.worker_call(call):
            try:
                return call.result()
            except grpc.FutureCancelledError:
                self.stopping(context)  # only `expire` cancels these
                raise

    def stopping(self, context) -> None:
        """After the shutdown deadline: end the call with UNAVAILABLE "router shutting down"
        (its worker call was cancelled by `expire`, not by anything a retry could fix)."""
        if self._expired:
            abort_with_hint(context, grpc.StatusCode.UNAVAILABLE, SHUTTING_DOWN,
                            SHUTDOWN_RETRY_AFTER_S)

    # ---- shutdown -------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def in_flight(self) -> int:
        return self.admission.in_flight

    def health(self) -> tuple[bool, dict]:
        """(serving, the body of HTTP /health): the same truth as the gRPC health service
        (membership's `health_of`, NOT_SERVING once shutting down), with the counts behind it."""
        h = self.workers.health()
        a = self.admission
        if self._closed:
            status, reason = "shutting_down", SHUTTING_DOWN
        else:
            status, reason = ("ok" if h.serving else "not_serving"), h.reason
        rate, peak = self.workers.prefill_rate(), self.workers.prefill_rate(peak=True)
        return status == "ok", {
            "status": status, "reason": reason,
            "active_workers": {"prefill": h.prefill_active, "decode": h.decode_active},
            "members": h.members, "in_flight": a.in_flight,
            "max_in_flight": a.config.max_in_flight,
            "queued_prefill_tokens": round(a.queued_tokens),
            "prefill_tokens_per_s": None if rate is None else round(rate, 1),
            "prefill_peak_tokens_per_s": None if peak is None else round(peak, 1),
            "max_predicted_ttft_s": a.config.max_predicted_ttft_s,
            "predicted_ttft_factor": round(a.factor(self.clock()), 3)}

    def close(self) -> None:
        """Admit nothing more; requests in flight go on."""
        self._closed = True

    def wait_idle(self, until_s: float, poll_s: float = 0.05) -> bool:
        """Wait until no request is in flight or the clock reaches `until_s`; True if idle."""
        while self.admission.in_flight > 0:
            left = until_s - self.clock()
            if left <= 0:
                return False
            time.sleep(min(poll_s, left))
        return True

    def expire(self) -> int:
        """The deadline passed: cancel every worker call in flight (and any made later); their
        requests end with UNAVAILABLE "router shutting down". How many were cancelled."""
        with self._lock:
            self._expired = True
            calls = list(self._calls)
        for c in calls:
            c.cancel()
        return len(calls)
