"""A request relayed where its chunks arrive (`MuxCall.relay`), against a real decode worker
process on loopback: the request's function gets the engine's tokens in order on the stream's
reader thread (those that queued before it was attached first), and the request's own thread
only waits for the end; a stop cuts the worker's decode short; the deadline, a cancel from
another thread, a failing function and the worker's death each end it with the status
iterating the call would have raised, and the worker frees the request (a worker that dies:
`test_decode_many.py`)."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from pdserve.engine.sampling import SamplingParams
from pdserve.proto import common_pb2
from pdserve.router.decode_mux import DecodeMuxes
from tests.worker.test_decode_many import local, wait_idle, worker  # noqa: F401  (fixture)
from tests.worker.test_local_prefill import (  # noqa: F401  (fixtures)
    prompt, reference, stats, store,
)


class Recorder:
    """An `on_chunk` that keeps what it got and on which thread; done on a finish reason, or
    once it holds `stop_after` tokens."""

    def __init__(self, stop_after: int | None = None) -> None:
        self.tokens: list[int] = []
        self.reasons: list[int] = []
        self.threads: set[str] = set()
        self.stop_after = stop_after

    def __call__(self, chunk) -> bool:
        self.threads.add(threading.current_thread().name)
        self.tokens += chunk.token_ids
        self.reasons.append(chunk.finish_reason)
        if self.stop_after is not None and len(self.tokens) >= self.stop_after:
            return True
        return bool(chunk.finish_reason)


def test_relayed_on_the_reader_thread_with_the_backlog_first_it_gets_the_engines_tokens(
        worker, reference):
    addr, stub, _ = worker
    muxes = DecodeMuxes()
    try:
        ids = prompt(12, seed=600)
        want, _ = reference(ids, SamplingParams(max_tokens=40, ignore_eos=True))
        call = muxes.start(addr, stub, local("relayed", ids, 40), timeout=120)
        deadline = time.monotonic() + 60
        while call._q.qsize() < 3:  # some chunks queued before the relay is attached
            assert time.monotonic() < deadline
            time.sleep(0.01)
        got = Recorder()
        assert call.relay(got) is True
        assert got.tokens == want
        assert got.reasons[-1] == common_pb2.FINISH_REASON_LENGTH
        assert not any(got.reasons[:-1])
        # The backlog on this thread, the rest where they arrived: the stream's reader.
        assert got.threads == {threading.current_thread().name, f"decode-mux-{addr}"}
        assert not call.cancel()  # it ended
    finally:
        muxes.close()


def test_a_relay_done_before_the_finish_reason_stops_the_workers_decode(worker, reference):
    addr, stub, _ = worker
    muxes = DecodeMuxes()
    try:
        steps_before = stats(stub).decode_steps
        ids = prompt(10, seed=610)
        want, _ = reference(ids, SamplingParams(max_tokens=6, ignore_eos=True))
        got = Recorder(stop_after=6)  # as a stop string would, long before max_tokens
        call = muxes.start(addr, stub, local("stopped", ids, 480), timeout=120)
        assert call.relay(got) is True
        assert got.tokens[:6] == want and not any(got.reasons)
        wait_idle(stub)
        assert stats(stub).decode_steps - steps_before < 200  # not the 480 it was given
    finally:
        muxes.close()


def test_a_relay_ends_with_the_deadline_a_cancel_or_its_own_error_and_the_worker_frees_it(
        worker):
    addr, stub, _ = worker
    muxes = DecodeMuxes()
    try:
        call = muxes.start(addr, stub, local("late", prompt(17, seed=620), 480), timeout=0.3)
        with pytest.raises(grpc.RpcError) as err:
            call.relay(Recorder())
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

        call = muxes.start(addr, stub, local("left", prompt(17, seed=621), 480), timeout=120)
        got = Recorder()
        threading.Timer(0.3, call.cancel).start()  # the client left, seen on another thread
        with pytest.raises(grpc.RpcError) as err:
            call.relay(got)
        assert err.value.code() == grpc.StatusCode.CANCELLED
        assert 0 < len(got.tokens) < 480

        def fails(chunk) -> bool:
            raise ValueError("the relay's own fault")

        call = muxes.start(addr, stub, local("fails", prompt(17, seed=622), 480), timeout=120)
        with pytest.raises(ValueError, match="the relay's own fault"):
            call.relay(fails)
        wait_idle(stub)  # all three freed on the worker
    finally:
        muxes.close()
