"""A worker that stops answering without dying (SIGSTOP: a paused VM, a starved core), with real
processes on loopback: a 1P1D cluster of its own over the tiny cluster's model and store.

While the prefill worker is paused, every request succeeds with the tokens the unpaused cluster
gave: those it held are taken back when the router finds it gone (missed health polls) and,
like those sent after, prefilled by the decode worker; no client sees a gRPC library's words;
the other worker's stats stay fresh while the paused one's polls wait.
After SIGCONT it is back in its pool and prefills again. The pause the field reported (70 s)
and a decode worker paused mid-stream (it hands its stream on to the other decode worker,
exactly) run with the long scenarios; a worker caught by the deadline on a call's first
answer, with every suite.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from pdserve import rpc
from pdserve.core.identity import ROUTER, WORKER
from pdserve.proto import api_pb2, common_pb2
from pdserve.proto import api_pb2_grpc as api_grpc
from pdserve.proto import router_pb2 as rpb
from pdserve.proto import router_pb2_grpc as rpb_grpc
from pdserve.proto import worker_pb2 as wpb
from pdserve.proto import worker_pb2_grpc as wpb_grpc
from tests.e2e.test_admission import (grpc_call, prompt_ids, start_router, start_worker,
                                      wait_for)
from tests.helpers import free_port, stop_process


def member(control: str, address: str) -> rpb.WorkerMember:
    with rpc.make_channel(control, ROUTER) as ch:
        workers = rpb_grpc.RouterControlStub(ch).ListWorkers(rpb.ListWorkersRequest(),
                                                              timeout=10).workers
    return next(w for w in workers if w.address == address)


def state_of(control: str, address: str) -> int:
    return member(control, address).state


def worker_stats(address: str) -> wpb.WorkerStats:
    """The worker's own stats, asked directly (not through the router)."""
    with rpc.make_channel(address, WORKER) as ch:
        return wpb_grpc.WorkerStub(ch).GetStats(wpb.GetStatsRequest(), timeout=10)


def back_and_prefilling(router, prefill: str, prompt: list[int], expected, timeout_s: float):
    """The paused worker is back in its pool and prefills again, with the same tokens."""
    wait_for("the worker back in its pool",
             lambda: state_of(router.control, prefill) == rpb.MEMBER_STATE_ACTIVE,
             timeout_s=timeout_s)
    before = worker_stats(prefill).requests_finished
    assert grpc_call(router.address, prompt, 8) == expected
    assert worker_stats(prefill).requests_finished == before + 1


@pytest.mark.scenario  # the field's 70 s pause: with the long scenarios (.ci/scenarios)
def test_a_paused_prefill_worker_costs_no_request_and_rejoins(tiny_cluster, pause_s=70):
    prefill, decode = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    procs = [start_worker(tiny_cluster, prefill, "prefill"),
             start_worker(tiny_cluster, decode)]
    # Polled every 0.2 s; two polls in a row unanswered (5 s each) and it is gone.
    router = start_router(tiny_cluster, "--max-missed-polls", "2", prefill=[prefill],
                          decode=[decode])
    prompts = [prompt_ids(tiny_cluster, f"Request number {i} arrives during a pause. ")
               for i in range(6)]
    try:
        expected = [grpc_call(router.address, p, 8) for p in prompts]
        assert all(kind == "ok" for kind, _ in expected)
        os.kill(procs[0].pid, signal.SIGSTOP)
        paused_at = time.monotonic()
        try:
            # Three sent at once to the paused worker (the router has not noticed yet), three
            # more once it has: every one answered, exactly.
            results: list = [None] * len(prompts)

            def send(i: int) -> None:
                results[i] = grpc_call(router.address, prompts[i], 8)
            early = [threading.Thread(target=send, args=(i,)) for i in range(3)]
            for t in early:
                t.start()
            wait_for("the router takes the paused worker out of its pool",
                     lambda: state_of(router.control, prefill) == rpb.MEMBER_STATE_GONE,
                     timeout_s=pause_s)
            for i in range(3, len(prompts)):
                send(i)
            # The paused worker's polls wait out their timeout; the other worker's stats stay
            # as fresh as the poll interval (0.2 s) meanwhile.
            ages = []
            for _ in range(10):
                ages.append(member(router.control, decode).last_seen_age_s)
                time.sleep(0.3)
            assert max(ages) < 2.0, ages
            for t in early:
                t.join(pause_s)
            assert results == expected
            assert time.monotonic() - paused_at < pause_s, "the requests waited out the pause"
            time.sleep(max(0.0, pause_s - (time.monotonic() - paused_at)))
        finally:
            os.kill(procs[0].pid, signal.SIGCONT)
        back_and_prefilling(router, prefill, prompts[0], expected[0], 60)
    finally:
        assert stop_process(router.proc, timeout_s=60) == 0
        for p in procs:
            stop_process(p, timeout_s=60)


def test_a_prefill_worker_that_answers_polls_but_not_calls_is_caught_by_the_deadline(
        tiny_cluster):
    """Its polls cannot find it (a worker gone only after 1,000 missed polls): the deadline on
    a call's first answer does. The request is prefilled by the decode worker once the
    deadline passes, the worker leaves its pool at once and, after SIGCONT, its polls bring
    it back only once the hold (as long as the deadline) has passed."""
    prefill, decode = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    procs = [start_worker(tiny_cluster, prefill, "prefill"),
             start_worker(tiny_cluster, decode)]
    # Every prompt goes to the prefill worker while it serves (none is prefilled where the
    # decode worker caches it).
    router = start_router(tiny_cluster, "--max-missed-polls", "1000", "--first-answer-min-s",
                          "3", "--max-local-prefill-tokens", "0", prefill=[prefill],
                          decode=[decode])
    prompts = [prompt_ids(tiny_cluster, f"Call {i} that gets no answer at first. ")
               for i in range(4)]
    try:
        # A deadline needs the worker's prefill rate measured: long prompts first (each its
        # own, so none is a cached prefix).
        n = iter(range(10_000))
        seen: list = []

        def measured() -> bool:
            seen[:] = [grpc_call(router.address, prompt_ids(
                tiny_cluster, f"{next(n)}: measure my prefill rate. " * 30), 1)[0],
                member(router.control, prefill).stats]
            return seen[0] == "ok" and seen[1].busy_seconds >= 0.1
        try:
            wait_for("the prefill worker's rate measured", measured, timeout_s=120)
        except AssertionError:
            raise AssertionError(f"last call {seen[0]}; the worker's stats {seen[1]}") from None
        expected = [grpc_call(router.address, p, 8) for p in prompts]
        assert all(kind == "ok" for kind, _ in expected)
        os.kill(procs[0].pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            assert grpc_call(router.address, prompts[1], 8) == expected[1]
            took = time.monotonic() - t0
            assert 3.0 <= took < 30.0, took  # the deadline, then the decode worker's prefill
            m = member(router.control, prefill)
            assert m.state == rpb.MEMBER_STATE_GONE and "did not answer within 3s" in m.reason
            t0 = time.monotonic()  # out of its pool: the next one does not wait for it
            assert grpc_call(router.address, prompts[2], 8) == expected[2]
            assert time.monotonic() - t0 < 3.0
        finally:
            os.kill(procs[0].pid, signal.SIGCONT)
        back_and_prefilling(router, prefill, prompts[3], expected[3], 30)
    finally:
        assert stop_process(router.proc, timeout_s=60) == 0
        for p in procs:
            stop_process(p, timeout_s=60)


@pytest.mark.scenario  # a 20 s pause: with the long scenarios (.ci/scenarios)
def test_a_decode_worker_paused_mid_stream_hands_its_streams_on_exactly(tiny_cluster):
    """Paused while it decodes a stream: the router finds it gone by its missed polls, the
    stream resumes on the other decode worker from the tokens already sent, and the client
    gets the tokens the unpaused cluster gave, long before the pause ends."""
    prefill = f"127.0.0.1:{free_port()}"
    decode = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    procs = [start_worker(tiny_cluster, prefill, "prefill"),
             *(start_worker(tiny_cluster, d) for d in decode)]
    router = start_router(tiny_cluster, "--max-missed-polls", "2",
                          "--max-local-prefill-tokens", "0", prefill=[prefill], decode=decode)
    prompt = prompt_ids(tiny_cluster, "A long answer, paused halfway. ")
    max_tokens = 480
    paused = None
    try:
        expected = grpc_call(router.address, prompt, max_tokens)
        assert expected[0] == "ok" and len(expected[1][0]) == max_tokens
        req = api_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(
            max_tokens=max_tokens, ignore_eos=True))
        req.token_ids.ids.extend(prompt)
        got: list[int] = []
        with rpc.make_channel(router.address, rpc.PUBLIC) as ch:
            stream = api_grpc.GenerationStub(ch).Generate(req, timeout=300)
            got += next(stream).token_ids  # the prefill worker's first token
            got += next(stream).token_ids  # the decode worker is on it now
            busy = [d for d in decode if worker_stats(d).num_running]
            assert len(busy) == 1, busy
            paused = procs[1 + decode.index(busy[0])]
            os.kill(paused.pid, signal.SIGSTOP)
            t0 = time.monotonic()
            for r in stream:
                got += r.token_ids
            took = time.monotonic() - t0
        assert (got, len(got)) == (expected[1][0], max_tokens)
        assert took < 20.0, took  # handed on once the polls missed, not after the pause
        assert state_of(router.control, busy[0]) == rpb.MEMBER_STATE_GONE
        os.kill(paused.pid, signal.SIGCONT)
        paused = None
        wait_for("the decode worker back in its pool",
                 lambda: state_of(router.control, busy[0]) == rpb.MEMBER_STATE_ACTIVE,
                 timeout_s=60)
        kind, (ids, _) = grpc_call(router.address, prompt, 8)
        assert kind == "ok" and ids == expected[1][0][:8]
    finally:
        if paused is not None:
            os.kill(paused.pid, signal.SIGCONT)
        assert stop_process(router.proc, timeout_s=60) == 0
        for p in procs:
            stop_process(p, timeout_s=60)
