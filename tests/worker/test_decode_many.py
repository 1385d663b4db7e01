"""Many decodes over one stream (`DecodeMany`), against a real decode worker process on loopback,
through the router's side of it (`router/decode_mux.py`): each request gets exactly the engine's
tokens, as a Decode call of its own would; one engine step's tokens for the whole batch arrive
together in one message; one request's cancel, bad field or deadline ends only it; a worker
that dies ends every request on its stream with UNAVAILABLE (what the router resumes on)."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from pdserve import rpc
from pdserve.core.identity import WORKER
from pdserve.engine.sampling import SamplingParams
from pdserve.proto import common_pb2
from pdserve.proto import worker_pb2 as wpb
from pdserve.proto import worker_pb2_grpc as wpb_grpc
from pdserve.router.decode_mux import DecodeMuxes
from tests.helpers import stop_process
from tests.worker.test_local_prefill import (  # noqa: F401  (fixtures)
    collect, prompt, reference, start_worker, stats, store,
)


@pytest.fixture(scope="module")
def worker(tiny_llama_dir, store):
    p, addr = start_worker(tiny_llama_dir, store, "decode")
    ch = rpc.make_channel(addr, WORKER)
    yield addr, wpb_grpc.WorkerStub(ch), p
    ch.close()
    if p.poll() is None:
        assert stop_process(p, timeout_s=15) == 0


def local(rid: str, ids: list[int], max_tokens: int, **sampling) -> wpb.DecodeRequest:
    return wpb.DecodeRequest(request_id=rid, prompt_token_ids=ids, prefill_locally=True,
                             sampling=common_pb2.SamplingParams(max_tokens=max_tokens,
                                                                ignore_eos=True, **sampling))


def wait_idle(stub) -> None:
    deadline = time.monotonic() + 30
    while stats(stub).num_running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stats(stub).num_running == 0


def test_a_batchs_tokens_cross_in_one_message_each_step_and_equal_the_engines(worker,
                                                                             reference):
    _, stub, _ = worker
    prompts = [prompt(9 + 3 * i, seed=100 + i) for i in range(6)]
    wants = [reference(ids, SamplingParams(max_tokens=16, ignore_eos=True))[0]
             for ids in prompts]
    up: list = [wpb.DecodeManyRequest(start=local(f"m{i}", ids, 16))
                for i, ids in enumerate(prompts)]
    got: dict[str, list[int]] = {f"m{i}": [] for i in range(len(prompts))}
    ended: set[str] = set()
    sizes = []
    steps_before = stats(stub).decode_steps
    stream = stub.DecodeMany(iter(up), timeout=120)
    for message in stream:
        sizes.append(len({e.request_id for e in message.events}))
        for e in message.events:
            assert e.status_code == 0 and e.HasField("chunk")
            assert e.request_id not in ended
            got[e.request_id] += e.chunk.token_ids
            if e.chunk.finish_reason:
                assert e.chunk.finish_reason == common_pb2.FINISH_REASON_LENGTH
                ended.add(e.request_id)
    # The caller closed its side: the stream ended once every request had.
    assert ended == set(got)
    assert [got[f"m{i}"] for i in range(len(prompts))] == wants
    # 96 tokens; a message per request per token would be 96 messages of one request each.
    # Here at most one per engine step (the steps that made first tokens, then the decode
    # steps), holding the tokens of every request that step made one for.
    steps = stats(stub).decode_steps - steps_before
    assert max(sizes) == len(prompts)
    assert len(sizes) <= steps + len(prompts), (sizes, steps)
    assert sum(sizes) >= 2 * len(sizes)
    wait_idle(stub)


def test_through_the_router_one_cancel_or_bad_field_ends_only_its_request(worker, reference):
    addr, stub, _ = worker
    muxes = DecodeMuxes()
    steps_before = stats(stub).decode_steps
    try:
        keep_ids, gone_ids = prompt(11, seed=200), prompt(13, seed=201)
        want, _ = reference(keep_ids, SamplingParams(max_tokens=24, ignore_eos=True))
        keep = muxes.start(addr, stub, local("keep", keep_ids, 24), timeout=120)
        gone = muxes.start(addr, stub, local("gone", gone_ids, 480), timeout=120)
        bad = muxes.start(addr, stub, local("bad", prompt(5, seed=202), 4, top_p=7.0),
                          timeout=120)
        first = next(gone)
        assert first.token_ids
        assert gone.cancel()
        with pytest.raises(grpc.RpcError) as err:
            next(gone)
        assert err.value.code() == grpc.StatusCode.CANCELLED
        with pytest.raises(grpc.RpcError) as err:
            collect(bad)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "top_p" in err.value.details()
        tokens, _, reasons = collect(keep)
        assert tokens == want and reasons[-1] == common_pb2.FINISH_REASON_LENGTH
        assert not keep.cancel()  # it ended: nothing to cancel
        # The same stream serves the next request; the cancelled one was freed on the worker.
        again = muxes.start(addr, stub, local("again", keep_ids, 24), timeout=120)
        assert collect(again)[0] == want
        wait_idle(stub)
        # Cancelled, it stopped decoding: it alone would have taken 479 more steps.
        assert stats(stub).decode_steps - steps_before < 200
    finally:
        muxes.close()


def test_a_relay_that_fell_behind_gets_the_steps_it_missed_in_one_chunk(worker, reference):
    """Under load the router's relay may read a request's chunks later than the worker made
    them: it then gets what is queued as one chunk (one message to its client), the same
    tokens in order, the finish reason on the last."""
    addr, stub, _ = worker
    muxes = DecodeMuxes()
    try:
        ids = prompt(11, seed=210)
        want, _ = reference(ids, SamplingParams(max_tokens=24, ignore_eos=True))
        before = stats(stub).requests_finished
        call = muxes.start(addr, stub, local("late", ids, 24), timeout=120)
        deadline = time.monotonic() + 60
        while stats(stub).requests_finished == before:  # every token made while nobody read
            assert time.monotonic() < deadline
            time.sleep(0.05)
        chunks = list(call)
        assert [t for c in chunks for t in c.token_ids] == want
        assert len(chunks) <= 3, [len(c.token_ids) for c in chunks]
        assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert all(not c.finish_reason for c in chunks[:-1])
    finally:
        muxes.close()


def test_a_deadline_ends_the_request_and_frees_it_on_the_worker(worker):
    addr, stub, _ = worker
    muxes = DecodeMuxes()
    try:
        call = muxes.start(addr, stub, local("slow", prompt(17, seed=300), 480), timeout=0.05)
        with pytest.raises(grpc.RpcError) as err:
            collect(call)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        wait_idle(stub)
    finally:
        muxes.close()


def test_a_worker_that_dies_ends_every_request_on_its_stream_unavailable(tiny_llama_dir, store):
    p, addr = start_worker(tiny_llama_dir, store, "decode")
    ch = rpc.make_channel(addr, WORKER)
    muxes = DecodeMuxes()
    try:
        stub = wpb_grpc.WorkerStub(ch)
        calls = [muxes.start(addr, stub, local(f"d{i}", prompt(8, seed=400 + i), 500),
                             timeout=120) for i in range(3)]
        for c in calls:
            next(c)  # all three are decoding
        errors = []

        def drain(c):
            try:
                collect(c)
            except grpc.RpcError as e:
                errors.append(e.code())

        def relay(c):  # relayed where its chunks arrive (`MuxCall.relay`): the same end
            try:
                c.relay(lambda chunk: bool(chunk.finish_reason))
            except grpc.RpcError as e:
                errors.append(e.code())

        relayed = muxes.start(addr, stub, local("r", prompt(8, seed=410), 500), timeout=120)
        next(relayed)
        readers = [threading.Thread(target=drain, args=(c,)) for c in calls]
        readers.append(threading.Thread(target=relay, args=(relayed,)))
        for t in readers:
            t.start()
        p.kill()
        for t in readers:
            t.join(timeout=30)
        assert errors == [grpc.StatusCode.UNAVAILABLE] * 4
        # A request started after that fails the same way at once (the router re-routes it).
        with pytest.raises(grpc.RpcError) as err:
            collect(muxes.start(addr, stub, local("late", prompt(8, seed=499), 4), timeout=30))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        muxes.close()
        ch.close()
        p.wait(timeout=30)


def test_a_request_id_already_running_on_the_stream_is_refused_and_free_once_it_ended(worker):
    _, stub, _ = worker
    ids = prompt(10, seed=500)
    ended = [threading.Event(), threading.Event()]

    def up():
        yield wpb.DecodeManyRequest(start=local("twice", ids, 40))
        yield wpb.DecodeManyRequest(start=local("twice", ids, 40))
        ended[0].wait(30)
        # Started again the moment its end arrives (as a retry on the same worker would be).
        yield wpb.DecodeManyRequest(start=local("twice", ids, 40))
        ended[1].wait(30)

    refused, finished = [], 0
    for message in stub.DecodeMany(up(), timeout=120):
        for e in message.events:
            if e.status_code:
                refused.append((e.status_code, e.status_details))
            elif e.chunk.finish_reason:
                ended[finished].set()
                finished += 1
    assert refused == [(grpc.StatusCode.INVALID_ARGUMENT.value[0],
                        "start.request_id: 'twice' is already running on this stream")]
    assert finished == 2
    wait_idle(stub)
