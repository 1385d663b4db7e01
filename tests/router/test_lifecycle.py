"""The door's adapter (`lifecycle.Door`) over a stand-in for the gRPC servicer context: every
refusal carries its status, a `retry-after` trailer and a counted reason; closing refuses new
requests with UNAVAILABLE; the shutdown deadline cancels worker calls, later ones included;
`/health`'s body tells membership's truth. No RPC is made (the WorkerSet has no poller)."""

from __future__ import annotations

import grpc
import pytest

from pdserve.metrics import RouterMetrics
from pdserve.proto import api_pb2
from pdserve.proto import worker_pb2 as wpb
from pdserve.router.admission import Admission, AdmissionConfig
from pdserve.router.control import RequestSignals
from pdserve.router.lifecycle import SHUTTING_DOWN, Door, abort_with_hint
from pdserve.router.membership import DRAINING
from tests.router.test_membership import make_workers


class Aborted(Exception):
    pass


class Context:
    """What the door uses of a gRPC servicer context: trailers, then abort (which raises)."""

    def __init__(self) -> None:
        self.trailers: tuple = ()
        self.code = None
        self.details = ""

    def set_trailing_metadata(self, md) -> None:
        self.trailers = tuple(md)

    def abort(self, code, details):
        self.code, self.details = code, details
        raise Aborted(details)


class Call:
    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


@pytest.fixture
def door():
    ws = make_workers()
    metrics = RouterMetrics("m")
    d = Door(Admission(AdmissionConfig(max_in_flight=1, max_predicted_ttft_s=1.0)), ws, metrics,
             RequestSignals(), clock=lambda: 5.0)
    yield d
    ws.close()


def rejected(d: Door, reason: str) -> float:
    return d.metrics.registry.get_sample_value(
        "pdserve:requests_rejected_total", {"model_name": "m", "reason": reason}) or 0.0


def test_overload_is_resource_exhausted_with_a_trailer_and_a_counted_reason(door):
    trip = door.enter("", Context(), 0.0)
    ctx = Context()
    with pytest.raises(Aborted):
        door.enter("", ctx, 0.0)
    assert ctx.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert ctx.trailers == (("retry-after", "1"),) and "retry after 1s" in ctx.details
    assert rejected(door, "in_flight") == 1
    door.leave(trip)
    assert door.in_flight == 0
    door.leave(door.enter("", Context(), 0.0))  # the slot is back


def test_closing_refuses_new_requests_with_unavailable_and_health_says_why(door):
    assert door.health()[0] and door.health()[1]["status"] == "ok"
    door.close()
    ctx = Context()
    with pytest.raises(Aborted):
        door.enter("", ctx, 0.0)
    assert ctx.code == grpc.StatusCode.UNAVAILABLE and ctx.details.startswith(SHUTTING_DOWN)
    assert dict(ctx.trailers)["retry-after"] == "1" and rejected(door, "shutting_down") == 1
    ok, body = door.health()
    assert not ok and body["status"] == "shutting_down" and body["reason"] == SHUTTING_DOWN


def test_health_body_counts_each_role_and_names_the_reason(door):
    ok, body = door.health()
    assert ok and body["active_workers"] == {"prefill": 2, "decode": 1} and body["members"] == 3
    door.workers.set_state("127.0.0.1:3", DRAINING)
    ok, body = door.health()
    assert not ok and body["status"] == "not_serving"
    assert body["reason"].startswith("no decode worker is active (3 members:")
    assert "127.0.0.1:3 decode draining" in body["reason"]


def test_the_deadline_cancels_worker_calls_in_flight_and_later_ones(door):
    first, later = Call(), Call()
    ctx = Context()
    with door.worker_call(first):
        door.stopping(ctx)  # before the deadline: nothing happens
        assert ctx.code is None
        assert door.expire() == 1
        assert first.cancelled
    with door.worker_call(later):
        assert later.cancelled  # made after the deadline: cancelled at once
    with pytest.raises(Aborted):
        door.stopping(ctx)
    assert ctx.code == grpc.StatusCode.UNAVAILABLE and ctx.details.startswith(SHUTTING_DOWN)


def test_predicted_ttft_refusal_frees_nothing_it_did_not_take(door):
    door = Door(Admission(AdmissionConfig(max_in_flight=4, max_predicted_ttft_s=1.0)),
                door.workers, door.metrics, RequestSignals(), clock=lambda: 5.0)
    for tokens, busy in ((0, 0.0), (1000, 1.0)):  # prefill pool: 2 workers x 1000 tokens/s
        door.workers.report("127.0.0.1:1", wpb.WorkerStats(
            role=wpb.ROLE_PREFILL, prompt_tokens_computed=tokens, busy_seconds=busy))
    a = door.enter("", Context(), 0.0)
    door.admit_prefill(a, list(range(1500)), Context())  # nothing queued before it: in
    assert door.admission.queued_tokens == 1500
    b = door.enter("", Context(), 0.0)
    ctx = Context()
    with pytest.raises(Aborted):
        door.admit_prefill(b, list(range(1000)), ctx)  # (1500 + 1000) / 2000 > 1 s
    assert ctx.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert float(dict(ctx.trailers)["retry-after"]) == pytest.approx(0.25)
    assert rejected(door, "predicted_ttft") == 1 and b.error == "RESOURCE_EXHAUSTED"
    door.leave(b)
    assert door.admission.queued_tokens == 1500 and door.in_flight == 1
    door.sent(a, api_pb2.GenerateResponse(token_ids=[7]))  # its first token: its prefill is done
    assert door.admission.queued_tokens == 0
    door.leave(a)
    assert door.in_flight == 0


def test_abort_with_hint_keeps_a_workers_own_hint():
    ctx = Context()
    with pytest.raises(Aborted):
        abort_with_hint(ctx, grpc.StatusCode.RESOURCE_EXHAUSTED,
                        "decode: waiting queue is full (256 requests); retry after 2s")
    assert dict(ctx.trailers)["retry-after"] == "2"
    ctx = Context()
    with pytest.raises(Aborted):
        abort_with_hint(ctx, grpc.StatusCode.INVALID_ARGUMENT, "max_tokens: must be >= 1")
    assert ctx.trailers == () and ctx.details == "max_tokens: must be >= 1"
