"""The retry rule as a pure core: which statuses re-route, how often, how long to wait; when a
decode stream that broke is resumed on another worker; when a decode worker prefills."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdserve.router.retry import RESUMABLE_CODES, RETRYABLE_CODES, RetryPolicy

CODES = ["OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
         "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
         "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS",
         "UNAUTHENTICATED"]


@pytest.mark.parametrize("code", ["UNAVAILABLE", "FAILED_PRECONDITION", "RESOURCE_EXHAUSTED"])
def test_worker_refusals_are_retried(code):
    d = RetryPolicy().decide(1, code, remaining_s=10.0, streamed=False)
    assert d.retry and d.delay_s == pytest.approx(0.02) and code in d.reason


@pytest.mark.parametrize("code", ["INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "CANCELLED",
                                  "INTERNAL", "UNKNOWN"])
def test_request_faults_are_never_retried(code):
    d = RetryPolicy().decide(1, code, remaining_s=None, streamed=False)
    assert not d.retry and d.delay_s == 0.0


def test_never_after_tokens_reached_the_client():
    d = RetryPolicy().decide(1, "UNAVAILABLE", remaining_s=None, streamed=True)
    assert not d.retry and "client" in d.reason


def test_attempts_are_bounded_and_backoff_doubles_up_to_its_cap():
    p = RetryPolicy(max_attempts=6, backoff_s=0.1, backoff_max_s=0.35)
    delays = [p.decide(a, "UNAVAILABLE", None, False).delay_s for a in range(1, 6)]
    assert delays == pytest.approx([0.1, 0.2, 0.35, 0.35, 0.35])
    assert not p.decide(6, "UNAVAILABLE", None, False).retry


def test_not_when_the_deadline_cannot_cover_the_wait_and_a_useful_attempt():
    p = RetryPolicy(backoff_s=0.1, min_remaining_s=0.5)
    assert p.decide(1, "UNAVAILABLE", remaining_s=0.61, streamed=False).retry
    d = p.decide(1, "UNAVAILABLE", remaining_s=0.59, streamed=False)
    assert not d.retry and "deadline" in d.reason


@given(attempt=st.integers(1, 10_000), code=st.sampled_from(CODES),
       remaining=st.none() | st.floats(0, 1e6, allow_nan=False),
       streamed=st.booleans(), max_attempts=st.integers(1, 10),
       backoff=st.floats(0, 5), cap=st.floats(0, 5), floor=st.floats(0, 5))
def test_a_retry_always_honours_every_bound(attempt, code, remaining, streamed, max_attempts,
                                            backoff, cap, floor):
    p = RetryPolicy(max_attempts, backoff, cap, floor)
    d = p.decide(attempt, code, remaining, streamed)
    if d.retry:
        assert code in RETRYABLE_CODES and not streamed and attempt < max_attempts
        assert 0.0 <= d.delay_s <= cap
        assert remaining is None or remaining >= floor + d.delay_s
    else:
        assert d.delay_s == 0.0 and d.reason
    if code in RETRYABLE_CODES and not streamed and attempt < max_attempts and remaining is None:
        assert d.retry  # nothing else may stop it


def test_bad_policies_and_attempts_are_refused():
    with pytest.raises(ValueError, match="max_attempts"):
        RetryPolicy(max_attempts=0)
    with pytest.raises(ValueError, match="backoff_s"):
        RetryPolicy(backoff_s=-1)
    with pytest.raises(ValueError, match="1-based"):
        RetryPolicy().decide(0, "UNAVAILABLE", None, False)
    with pytest.raises(ValueError, match="max_resumes"):
        RetryPolicy(max_resumes=-1)
    with pytest.raises(ValueError, match="resumes"):
        RetryPolicy().decide_resume(-1, "UNAVAILABLE", None, False)


# ---- resume: a decode stream that broke after the client got tokens --------------------------

@pytest.mark.parametrize("code", ["UNAVAILABLE", "UNKNOWN", "INTERNAL", "CANCELLED"])
def test_a_stream_broken_by_a_dead_worker_is_resumed(code):
    d = RetryPolicy().decide_resume(0, code, remaining_s=10.0, client_left=False)
    assert d.retry and d.delay_s == pytest.approx(0.02) and code in d.reason


@pytest.mark.parametrize("code", ["INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED",
                                  "FAILED_PRECONDITION", "PERMISSION_DENIED", "OK"])
def test_a_verdict_on_the_request_is_not_resumed(code):
    d = RetryPolicy().decide_resume(0, code, remaining_s=None, client_left=False)
    assert not d.retry and d.delay_s == 0.0 and "not resumable" in d.reason


@pytest.mark.parametrize("code", ["CANCELLED", "UNAVAILABLE"])
def test_never_when_the_client_left(code):
    d = RetryPolicy().decide_resume(0, code, remaining_s=None, client_left=True)
    assert not d.retry and "client" in d.reason


def test_resumes_are_bounded_back_off_and_need_the_deadline():
    p = RetryPolicy(backoff_s=0.1, backoff_max_s=0.3, min_remaining_s=0.5, max_resumes=3)
    assert [p.decide_resume(n, "UNAVAILABLE", None, False).delay_s
            for n in range(3)] == pytest.approx([0.1, 0.2, 0.3])
    d = p.decide_resume(3, "UNAVAILABLE", None, False)
    assert not d.retry and "3 of 3" in d.reason
    assert p.decide_resume(0, "INTERNAL", remaining_s=0.61, client_left=False).retry
    d = p.decide_resume(0, "INTERNAL", remaining_s=0.59, client_left=False)
    assert not d.retry and "deadline" in d.reason
    assert not RetryPolicy(max_resumes=0).decide_resume(0, "UNAVAILABLE", None, False).retry


@given(resumes=st.integers(0, 10_000), code=st.sampled_from(CODES),
       remaining=st.none() | st.floats(0, 1e6, allow_nan=False), client_left=st.booleans(),
       max_resumes=st.integers(0, 10), backoff=st.floats(0, 5), cap=st.floats(0, 5),
       floor=st.floats(0, 5))
def test_a_resume_always_honours_every_bound(resumes, code, remaining, client_left,
                                             max_resumes, backoff, cap, floor):
    p = RetryPolicy(backoff_s=backoff, backoff_max_s=cap, min_remaining_s=floor,
                    max_resumes=max_resumes)
    d = p.decide_resume(resumes, code, remaining, client_left)
    if d.retry:
        assert code in RESUMABLE_CODES and not client_left and resumes < max_resumes
        assert 0.0 <= d.delay_s <= cap
        assert remaining is None or remaining >= floor + d.delay_s
    else:
        assert d.delay_s == 0.0 and d.reason
    if code in RESUMABLE_CODES and not client_left and resumes < max_resumes and remaining is None:
        assert d.retry  # nothing else may stop it


@pytest.mark.parametrize("code", [None, "UNAVAILABLE", "FAILED_PRECONDITION",
                                  "RESOURCE_EXHAUSTED"])
def test_a_prompt_no_prefill_worker_takes_is_prefilled_on_a_decode_worker(code):
    assert RetryPolicy.prefill_fallback(code)


@pytest.mark.parametrize("code", ["INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "CANCELLED",
                                  "INTERNAL", "UNKNOWN"])
def test_a_prefill_that_failed_for_the_request_itself_is_not(code):
    assert not RetryPolicy.prefill_fallback(code)


@pytest.mark.parametrize("code, details, said", [
    # A worker's own words pass as they are.
    ("INVALID_ARGUMENT", "max_tokens: must be >= 1", "max_tokens: must be >= 1"),
    ("RESOURCE_EXHAUSTED", "queue full: 64 requests waiting", "queue full: 64 requests waiting"),
    # The gRPC library's never reach a client.
    ("CANCELLED", "Channel closed!", "the call to the worker was cut off"),
    ("UNAVAILABLE", "failed to connect to all addresses; last error: UNKNOWN: "
     "ipv4:127.0.0.1:1: Connection refused", "the worker cannot be reached"),
    ("UNAVAILABLE", "Socket closed", "the worker cannot be reached"),
    ("DEADLINE_EXCEEDED", "Deadline Exceeded", "the worker did not answer in time"),
    ("INTERNAL", "Received RST_STREAM with error code 2", "the call to the worker failed "
     "(INTERNAL)"),
    ("UNKNOWN", "", "the call to the worker failed (UNKNOWN)"),
])
def test_a_workers_failure_is_told_in_pdserves_words(code, details, said):
    from pdserve.router.retry import worker_message

    assert worker_message(code, details) == said


def test_calls_to_a_worker_the_router_gives_up_on_are_cancelled_with_the_reason():
    from concurrent.futures import Future

    from pdserve.router.worker_calls import WorkerCalls

    calls = WorkerCalls()
    a, b, c = Future(), Future(), Future()
    with calls.tracking("w1", a) as ta, calls.tracking("w1", b) as tb, \
            calls.tracking("w2", c) as tc:
        assert calls.in_flight("w1") == 2
        assert calls.end("w1", "stopped answering") == 2
        assert a.cancelled() and b.cancelled() and not c.cancelled()
        assert ta.why == tb.why == "stopped answering" and tc.why is None
    assert ta.why == "stopped answering"  # kept past the block, for the caller to read
    assert calls.in_flight("w1") == calls.in_flight("w2") == 0
    assert calls.end("w1", "again") == 0  # ended calls are no longer tracked


def test_a_call_without_a_first_answer_in_time_is_ended_and_its_worker_reported():
    import threading
    from concurrent.futures import Future

    from pdserve.router.worker_calls import WorkerCalls

    stalled: list = []
    done = threading.Event()
    calls = WorkerCalls(on_stall=lambda a, why, s: (stalled.append((a, why, s)), done.set()))
    quiet, answered, other = Future(), Future(), Future()
    with calls.tracking("w1", quiet, 0.2) as tq, calls.tracking("w2", other) as to:
        with calls.tracking("w3", answered, 0.2):
            pass  # its answer came before the deadline: the block was left
        assert done.wait(5)
    assert quiet.cancelled() and tq.why == "did not answer within 0.2s"
    assert not answered.cancelled() and not other.cancelled() and to.why is None
    assert stalled == [("w1", "did not answer within 0.2s", 0.2)]


def test_how_long_a_first_answer_may_take():
    from pdserve.router.worker_calls import FIRST_ANSWER_FACTOR, first_answer_deadline

    assert first_answer_deadline(0, None, 30.0) == 30.0  # nothing to compute: the least
    assert first_answer_deadline(500, 100.0, 30.0) == 30.0  # 4 x 5 s predicted < 30 s
    assert first_answer_deadline(4000, 100.0, 30.0) == FIRST_ANSWER_FACTOR * 40.0
    assert first_answer_deadline(4000, None, 30.0) is None  # nothing measured: no cut
    assert first_answer_deadline(4000, 100.0, 0.0) is None  # off
