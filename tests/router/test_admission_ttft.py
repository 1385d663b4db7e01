"""The router's door as pure cores: the predicted-TTFT bound and its queue, measured prefill
rates, health from membership, the status a failed hop gives the client, the shutdown schedule,
and the config's bounds sized above admission. No clock, no RPC."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.core.errors import ConfigError
from pdserve.core.rates import RateMeter
from pdserve.proto import worker_pb2 as wpb
from pdserve.router.admission import (
    IN_FLIGHT, PREDICTED_TTFT, Admission, AdmissionConfig, Overloaded, predict_ttft,
)
from pdserve.router.config import MIN_SPARE_THREADS, RouterConfig
from pdserve.router.lifecycle import shutdown_plan
from pdserve.router.membership import (
    ACTIVE, DECODE, DRAINING, GONE, PREFILL, Member, Membership, health_of,
)
from pdserve.router.retry import client_status


# ---- predicted TTFT -----------------------------------------------------------------------------

def test_prediction_is_queued_plus_own_over_the_rate_and_needs_a_rate():
    p = predict_ttft(900.0, 100, 500.0)
    assert p.predicted_s == pytest.approx(2.0) and p.queued_tokens == 900 and p.own_tokens == 100
    assert predict_ttft(-3.0, 100, 100.0).predicted_s == pytest.approx(1.0)  # no negative work
    for rate in (None, 0.0, -1.0, math.inf, math.nan):
        assert predict_ttft(10.0, 10, rate) is None


def test_over_the_bound_is_refused_with_the_drain_time_as_the_hint():
    a = Admission(AdmissionConfig(max_predicted_ttft_s=1.0))
    first = a.admit_prefill(800, 1000.0, 0.0)  # 0.8 s: in
    with pytest.raises(Overloaded) as e:
        a.admit_prefill(700, 1000.0, 0.0)  # (800 + 700) / 1000 = 1.5 s
    assert e.value.reason == PREDICTED_TTFT
    assert e.value.retry_after_s == pytest.approx(0.5)  # until 500 tokens have drained
    assert "retry after 0.5s" in str(e.value) and "predicted time to first token" in str(e.value)
    assert a.queued_tokens == 800 and a.rejected == 1
    a.prefilled(first, 0.5)
    a.admit_prefill(700, 1000.0, 0.5)  # the queue drained: it fits now
    assert a.queued_tokens == 700


def test_a_request_with_nothing_queued_before_it_or_no_rate_is_never_refused():
    a = Admission(AdmissionConfig(max_predicted_ttft_s=0.1))
    a.admit_prefill(5000, 1000.0, 0.0)  # 5 s alone: waiting would not make it faster
    a.admit_prefill(5000, None, 0.0)  # nothing measured yet: only the in-flight bound holds
    off = Admission(AdmissionConfig(max_predicted_ttft_s=0.0))
    for _ in range(10):
        off.admit_prefill(10_000, 1.0, 0.0)
    assert off.queued_tokens == 100_000


def test_the_hint_is_capped_and_the_config_checks_its_fields():
    a = Admission(AdmissionConfig(max_predicted_ttft_s=1.0, max_retry_after_s=30.0))
    a.admit_prefill(10**6, 1.0, 0.0)
    with pytest.raises(Overloaded) as e:
        a.admit_prefill(1, 1.0, 0.0)
    assert e.value.retry_after_s == 30.0
    for bad in (-1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="max_predicted_ttft_s"):
            AdmissionConfig(max_predicted_ttft_s=bad)
    with pytest.raises(ValueError, match="max_retry_after_s"):
        AdmissionConfig(max_retry_after_s=0.0)


def test_in_flight_refusals_name_their_reason():
    a = Admission(AdmissionConfig(max_in_flight=1))
    a.admit("", 0.0)
    with pytest.raises(Overloaded) as e:
        a.admit("", 0.0)
    assert e.value.reason == IN_FLIGHT and e.value.retry_after_s > 0


@settings(max_examples=200, deadline=None)
@given(limit=st.floats(0.05, 20.0), rate=st.one_of(st.none(), st.floats(1.0, 1e5)),
       ops=st.lists(st.tuples(st.booleans(), st.integers(1, 4000)), max_size=60))
def test_the_queue_is_exactly_the_work_admitted_and_not_done(limit, rate, ops):
    a = Admission(AdmissionConfig(max_predicted_ttft_s=limit, max_retry_after_s=60.0,
                                  calibration=None))
    held = []
    for add, tokens in ops:
        if add or not held:
            before = a.queued_tokens
            try:
                t = a.admit_prefill(tokens, rate, 0.0)
            except Overloaded as e:
                # Refused only over the bound, with something queued, and a hint in (0, cap].
                assert rate is not None and before > 0
                assert (before + tokens) / rate > limit
                assert 0 < e.retry_after_s <= 60.0
                assert a.queued_tokens == before
                continue
            held.append(t)
            if t.prediction is not None and before > 0:
                assert t.prediction.predicted_s <= limit + 1e-9
        else:
            a.prefilled(held.pop(0), 0.0)
        assert a.queued_tokens == pytest.approx(sum(t.own_tokens for t in held))


# ---- measured prefill rates ---------------------------------------------------------------------

def test_rates_come_from_counter_deltas_and_restarts_start_over():
    r = RateMeter(alpha=0.5, min_busy_s=0.1)
    assert r.observe("a", 100, 1.0) is None  # the baseline
    assert r.observe("a", 150, 1.05) is None  # 50 ms of busy time is timer noise
    assert r.observe("a", 1100, 2.0) == pytest.approx(1000.0)
    assert r.observe("a", 1600, 3.0) == pytest.approx(750.0)  # EWMA of 1000 and 500
    assert r.observe("a", 10, 0.1) is None and r.rate("a") is None  # restarted
    r.observe("b", 0, 0.0)
    r.observe("b", 2000, 1.0)
    r.observe("c", 0, 0.0)
    assert r.pool_rate(["b", "c"]) == pytest.approx(4000.0)  # c counted at b's rate
    assert r.pool_rate(["c"]) is None and r.pool_rate([]) is None
    r.forget("b")
    assert r.pool_rate(["b"]) is None


def test_the_pool_rate_follows_prefill_members_polled_stats():
    from tests.router.test_membership import make_workers

    ws = make_workers()
    try:
        for t, (tokens, busy) in enumerate(((0, 0.0), (3000, 1.0))):
            ws.report("127.0.0.1:1", wpb.WorkerStats(role=wpb.ROLE_PREFILL,
                                                     prompt_tokens_computed=tokens,
                                                     busy_seconds=busy), now=float(t))
        assert ws.prefill_rate() == pytest.approx(6000.0)  # :2 not measured yet: at :1's rate
        ws.set_state("127.0.0.1:2", DRAINING)
        assert ws.prefill_rate() == pytest.approx(3000.0)
        ws.report("127.0.0.1:1", wpb.WorkerStats(role=wpb.ROLE_DECODE), now=3.0)
        assert ws.prefill_rate() is None  # switched to decode by hand: no prefill rate left
        assert ws.cached_prefix_tokens([1, 2, 3]) == 0  # no KV index: nothing known cached
    finally:
        ws.close()


# ---- health -------------------------------------------------------------------------------------

def _member(address, role, state=ACTIVE, draining=False, reason=""):
    m = Member(address, role, state, reason=reason)
    m.stats = wpb.WorkerStats(draining=draining)
    return m


def test_serving_exactly_when_a_decode_worker_takes_requests():
    h = health_of([])
    assert not h.serving and "no worker has joined" in h.reason
    h = health_of([_member("p:1", PREFILL)])
    assert not h.serving and h.prefill_active == 1 and h.decode_active == 0
    assert h.summary == "no decode worker is active"  # what a client is told: no addresses
    assert h.reason.startswith("no decode worker is active (1 members: p:1 prefill active")
    h = health_of([_member("d:1", DECODE)])  # decode workers prefill prompts themselves
    assert h.serving and h.decode_active == 1 and h.prefill_active == 0
    assert "prefill prompts themselves" in h.reason
    h = health_of([_member("p:1", PREFILL), _member("d:1", DECODE, draining=True)])
    assert not h.serving and "d:1 decode active draining" in h.reason
    stale = _member("d:1", DECODE, draining=True)
    stale.last_seen_s, stale.changed_s = 5.0, 6.0  # polled before the controller moved it
    assert health_of([stale]).serving
    stale.last_seen_s = 7.0  # polled since: it drains
    assert not health_of([stale]).serving
    h = health_of([_member("d:1", DECODE, GONE, reason="missed 3 consecutive health polls")])
    assert not h.serving and "d:1 decode gone: missed 3 consecutive health polls" in h.reason
    many = [_member(f"d:{i}", DECODE, DRAINING) for i in range(20)]
    h = health_of(many)
    assert not h.serving and h.members == 20 and h.reason.endswith("; and 12 more)")


def test_membership_serving_is_its_health():
    m = Membership()
    m.join("p:1", PREFILL, 0.0)
    assert not m.serving() and not m.health().serving
    m.join("d:1", DECODE, 0.0)
    assert m.serving() and m.health().decode_active == 1


# ---- statuses, shutdown, config -----------------------------------------------------------------

def test_a_failed_hop_is_unavailable_unless_the_request_or_the_queues_are_at_fault():
    for code in ("INVALID_ARGUMENT", "OUT_OF_RANGE", "RESOURCE_EXHAUSTED"):
        assert client_status(code) == code
    for code in ("UNAVAILABLE", "INTERNAL", "UNKNOWN", "DEADLINE_EXCEEDED",
                 "FAILED_PRECONDITION", "CANCELLED", "ABORTED", "NOT_FOUND"):
        assert client_status(code) == "UNAVAILABLE"


@given(now=st.floats(0, 1e6), grace=st.floats(0, 3600))
def test_the_shutdown_plan_ends_requests_before_it_stops_within_the_grace(now, grace):
    p = shutdown_plan(now, grace)
    assert now <= p.requests_until_s <= p.stop_by_s == pytest.approx(now + grace)
    # Within a nanosecond: two instants near `now` differ by at least its float spacing.
    # A quarter of the grace, within [0.5 s, 2 s], and never more than the grace itself.
    want = min(grace, max(0.5, min(2.0, grace / 4)))
    assert p.stop_by_s - p.requests_until_s == pytest.approx(want, abs=1e-9)
    with pytest.raises(ValueError, match="grace_s"):
        shutdown_plan(now, -1.0)


def test_config_sizes_every_bound_above_admission_and_refuses_otherwise():
    c = RouterConfig(model_path="m", max_in_flight=100)
    assert c.rpc_threads >= 100 + MIN_SPARE_THREADS
    assert c.http_max_connections >= 100 + MIN_SPARE_THREADS
    assert c.max_concurrent_rpcs >= c.rpc_threads + c.http_max_connections
    assert c.max_predicted_ttft_s == 10.0 and c.shutdown_grace_s == 30.0
    with pytest.raises(ConfigError, match=r"^rpc_threads: must be >= max_in_flight \+ 4 = 104"):
        RouterConfig(model_path="m", max_in_flight=100, rpc_threads=64)
    with pytest.raises(ConfigError, match="^http_max_connections: must be >= max_in_flight"):
        RouterConfig(model_path="m", max_in_flight=100, http_max_connections=100)
    with pytest.raises(ConfigError, match="^max_concurrent_rpcs: must be >= rpc_threads"):
        RouterConfig(model_path="m", max_in_flight=10, rpc_threads=20, http_max_connections=20,
                     max_concurrent_rpcs=39)
    RouterConfig(model_path="m", max_in_flight=10, rpc_threads=20, http_max_connections=20,
                 max_concurrent_rpcs=40)
    for field, bad in (("max_predicted_ttft_s", -1.0), ("max_predicted_ttft_s", math.inf),
                       ("shutdown_grace_s", -0.5), ("shutdown_grace_s", math.nan)):
        with pytest.raises(ConfigError, match=f"^{field}"):
            RouterConfig(model_path="m", **{field: bad})


def test_the_peak_rate_is_the_best_sample_and_starts_over_with_the_worker():
    """Light load (one short prompt per step) measures a fraction of what a batching worker
    does; the peak keeps the best, which the TTFT bound divides by."""
    r = RateMeter(alpha=0.5, min_busy_s=0.1)
    r.observe("a", 0, 0.0)
    r.observe("a", 300, 1.0)  # one prompt a step: 300 tokens/s
    r.observe("a", 3300, 2.0)  # a queue let it batch: 3000 tokens/s
    r.observe("a", 3600, 3.0)  # light again
    assert r.rate("a") == pytest.approx(0.5 * 300 + 0.5 * (0.5 * 3000 + 0.5 * 300))
    assert r.peak("a") == pytest.approx(3000.0)
    assert r.pool_rate(["a", "b"], peak=True) == pytest.approx(6000.0)
    r.observe("a", 10, 0.1)  # restarted: its peak is gone with its rate
    assert r.peak("a") is None and r.pool_rate(["a"], peak=True) is None
