"""Prefill offload onto a decode worker: `Decode(prefill_locally=True)` against a real worker
process (and a simple store process) on loopback. The worker computes the prompt in its own
batches, at most `prefill_chunk_tokens` a step, and streams every token, the first one
included: exactly what the engine gives in one process (invariant 1). Its stats and /metrics
count the work; a drain for a role switch is reported while it lasts. A request resumed here
(`resume_token_ids`: what a dead decode worker already sent) streams only the tokens after
those, the engine's own."""

from __future__ import annotations

import re
import sys
import threading
import time
import urllib.request

import grpc
import pytest

from pdserve import rpc
from pdserve.core.identity import WORKER
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling import SamplingParams
from pdserve.proto import common_pb2
from pdserve.proto import worker_pb2 as wpb
from pdserve.proto import worker_pb2_grpc as wpb_grpc
from tests.conftest import SMOLLM2_VOCAB_SIZE
from tests.helpers import free_port, process_output, start_process, stop_process

NUM_BLOCKS = 96


def prompt(n: int, seed: int) -> list[int]:
    """n distinct-per-seed token ids, so no two prompts share a cached block."""
    return [(seed * 7919 + i * 104729) % (SMOLLM2_VOCAB_SIZE - 3) + 3 for i in range(n)]


@pytest.fixture(scope="module")
def store(tiny_llama_dir):
    addr = f"127.0.0.1:{free_port()}"
    p = start_process([sys.executable, "-m", "pdserve.kvstore", "--address", addr], addr)
    yield addr
    stop_process(p)


def start_worker(model: str, store: str, role: str, *extra: str):
    addr = f"127.0.0.1:{free_port()}"
    p = start_process([sys.executable, "-m", "pdserve.worker", "--role", role, "--model", model,
                       "--address", addr, "--store-address", store, "--store-kind", "simple",
                       "--num-blocks", str(NUM_BLOCKS), "--threads", "1", *extra], addr,
                      timeout_s=120)
    return p, addr


@pytest.fixture(scope="module")
def decode_worker(tiny_llama_dir, store):
    p, addr = start_worker(tiny_llama_dir, store, "decode", "--metrics-port", "0")
    ch = rpc.make_channel(addr, WORKER)
    yield wpb_grpc.WorkerStub(ch), p
    ch.close()
    assert stop_process(p, timeout_s=15) == 0


@pytest.fixture(scope="module")
def stub(decode_worker):
    return decode_worker[0]


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    """reference(prompt, params) -> the engine's (tokens, logprobs) for that request alone."""
    engine = LLMEngine(EngineConfig(tiny_llama_dir, cache=CacheConfig(
        block_size_tokens=16, num_blocks=NUM_BLOCKS)))

    def ref(ids: list[int], params: SamplingParams):
        rid = engine.add_request(None, ids, params)
        tokens, lps = [], []
        while engine.has_work():
            for o in engine.step():
                assert o.request_id == rid
                tokens += o.new_token_ids
                lps += o.logprobs or []
        return tokens, lps
    return ref


def local_decode(stub, rid: str, ids: list[int], chunk: int = 0, resume=(), **sampling):
    return stub.Decode(wpb.DecodeRequest(
        request_id=rid, prompt_token_ids=ids, prefill_locally=True, prefill_chunk_tokens=chunk,
        resume_token_ids=resume, sampling=common_pb2.SamplingParams(**sampling)), timeout=120)


def collect(call) -> tuple[list[int], list, list[int]]:
    """(tokens, logprobs, finish reasons of every message) of a Decode stream."""
    tokens, lps, reasons = [], [], []
    for msg in call:
        tokens += msg.token_ids
        lps += msg.logprobs
        reasons.append(msg.finish_reason)
    return tokens, lps, reasons


def stats(stub) -> wpb.WorkerStats:
    return stub.GetStats(wpb.GetStatsRequest(), timeout=10)


@pytest.mark.parametrize("n_prompt,chunk", [(5, 0), (60, 0), (60, 8), (37, 1)])
def test_local_prefill_streams_the_engines_tokens(stub, reference, n_prompt, chunk):
    ids = prompt(n_prompt, seed=n_prompt * 10 + chunk)
    want, _ = reference(ids, SamplingParams(max_tokens=12, ignore_eos=True))
    before = stats(stub)
    got, _, reasons = collect(local_decode(stub, f"p{n_prompt}-{chunk}", ids, chunk,
                                           max_tokens=12, ignore_eos=True))
    assert got == want and len(got) == 12
    assert reasons[-1] == common_pb2.FINISH_REASON_LENGTH
    assert set(reasons[:-1]) <= {common_pb2.FINISH_REASON_UNSPECIFIED}
    after = stats(stub)
    assert after.local_prefill_requests - before.local_prefill_requests == 1
    assert after.local_prefill_tokens - before.local_prefill_tokens == n_prompt
    # A fresh prompt: every one of its tokens ran through the model on this worker.
    assert after.prompt_tokens_computed - before.prompt_tokens_computed == n_prompt
    assert after.busy_seconds > before.busy_seconds
    assert after.decode_steps - before.decode_steps >= 11  # tokens 2..12 each took a step
    assert 0 < after.decode_step_seconds <= after.busy_seconds
    assert not after.draining and after.role == wpb.ROLE_DECODE


def test_capped_prompt_mixed_into_a_running_decode_keeps_both_outputs(stub, reference):
    long_params = dict(max_tokens=200, ignore_eos=True)
    runner = prompt(7, seed=1)
    offloaded = prompt(60, seed=2)
    want_runner, _ = reference(runner, SamplingParams(**long_params))
    want_offloaded, _ = reference(offloaded, SamplingParams(max_tokens=10, ignore_eos=True))
    call = local_decode(stub, "runner", runner, **long_params)
    first = next(call)  # the runner is decoding now
    got_offloaded, _, _ = collect(local_decode(stub, "offloaded", offloaded, 8, max_tokens=10,
                                               ignore_eos=True))
    rest, _, reasons = collect(call)
    assert list(first.token_ids) + rest == want_runner
    assert reasons[-1] == common_pb2.FINISH_REASON_LENGTH
    assert got_offloaded == want_offloaded


def test_logprobs_stop_tokens_and_a_first_token_that_ends_it(stub, reference):
    ids = prompt(20, seed=3)
    want, want_lps = reference(ids, SamplingParams(max_tokens=6, ignore_eos=True, logprobs=2))
    got, lps, _ = collect(local_decode(stub, "lp", ids, 4, max_tokens=6, ignore_eos=True,
                                       logprobs=2))
    assert got == want and [lp.token_id for lp in lps] == got
    for lp, w in zip(lps, want_lps):
        assert lp.logprob == pytest.approx(w.logprob, abs=1e-5)
        assert [t.token_id for t in lp.top] == [t for t, _ in w.top]
    # The request ends at a stop token, the first token included in the stream.
    got, _, reasons = collect(local_decode(stub, "stop", ids, max_tokens=6, ignore_eos=True,
                                           stop_token_ids=[want[2]]))
    assert got == want[:want.index(want[2]) + 1]
    assert reasons[-1] == common_pb2.FINISH_REASON_STOP
    got, _, reasons = collect(local_decode(stub, "one", ids, max_tokens=1))
    assert got == want[:1] and reasons == [common_pb2.FINISH_REASON_LENGTH]


def test_prompt_logprobs_come_with_the_first_token_even_for_a_cached_prompt(stub, tiny_llama_dir):
    ids = prompt(40, seed=5)
    engine = LLMEngine(EngineConfig(tiny_llama_dir, cache=CacheConfig(
        block_size_tokens=16, num_blocks=NUM_BLOCKS)))
    want = engine.prompt_logits(ids).float().log_softmax(-1)
    collect(local_decode(stub, "warm", ids, max_tokens=2))  # its blocks are cached here now
    msgs = list(local_decode(stub, "plp", ids, 16, max_tokens=3, prompt_logprobs=1))
    assert [len(m.prompt_logprobs) for m in msgs] == [len(ids) - 1] + [0] * (len(msgs) - 1)
    for i, lp in enumerate(msgs[0].prompt_logprobs):  # token i + 1, scored at position i
        assert lp.token_id == ids[i + 1]
        assert lp.logprob == pytest.approx(want[i, ids[i + 1]].item(), abs=1e-4)
        assert [t.token_id for t in lp.top] == [int(want[i].argmax())]


@pytest.mark.parametrize("sampling", [dict(), dict(temperature=0.8, seed=99)],
                         ids=["greedy", "seeded"])
def test_a_resumed_request_streams_only_what_follows(stub, reference, sampling):
    ids = prompt(25, seed=11)
    params = dict(max_tokens=20, ignore_eos=True, **sampling)
    want, _ = reference(ids, SamplingParams(**params))
    before = stats(stub)
    got, _, reasons = collect(local_decode(stub, f"resumed-{len(sampling)}", ids, 4,
                                           resume=want[:13], **params))
    assert got == want[13:] and reasons[-1] == common_pb2.FINISH_REASON_LENGTH
    after = stats(stub)
    # The resumed tokens ran through the model with the prompt.
    assert after.local_prefill_tokens - before.local_prefill_tokens == 25 + 13


def test_resume_tokens_need_local_prefill_and_room_in_max_tokens(stub, reference):
    ids = prompt(9, seed=12)
    with pytest.raises(grpc.RpcError) as err:
        collect(stub.Decode(wpb.DecodeRequest(
            request_id="kv-resume", prompt_token_ids=ids, first_token_id=5,
            resume_token_ids=[5, 6], sampling=common_pb2.SamplingParams(max_tokens=4)),
            timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("resume_token_ids")
    with pytest.raises(grpc.RpcError) as err:
        collect(local_decode(stub, "full", ids, resume=[5, 6, 7, 8], max_tokens=4))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("resume_token_ids")
    assert stats(stub).num_running == 0


def test_a_cancelled_client_frees_the_request(stub):
    before = stats(stub)
    call = local_decode(stub, "cancelled", prompt(30, seed=4), 4, max_tokens=400,
                        ignore_eos=True)
    next(call)
    call.cancel()
    deadline = time.monotonic() + 30
    s = stats(stub)
    while s.num_running or s.num_free_blocks != s.num_total_blocks:
        assert time.monotonic() < deadline, f"still held after the client left: {s}"
        time.sleep(0.05)
        s = stats(stub)
    # Aborted, not run out: far fewer than its 399 decode steps ran.
    assert s.decode_steps - before.decode_steps < 200, s.decode_steps - before.decode_steps


def test_bad_chunk_and_the_prefill_role_are_refused(stub, tiny_llama_dir, store):
    with pytest.raises(grpc.RpcError) as err:
        collect(local_decode(stub, "neg", prompt(5, seed=5), -1, max_tokens=2))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prefill_chunk_tokens" in err.value.details()
    p, addr = start_worker(tiny_llama_dir, store, "prefill")
    try:
        with rpc.make_channel(addr, WORKER) as ch:
            with pytest.raises(grpc.RpcError) as err:
                collect(local_decode(wpb_grpc.WorkerStub(ch), "x", prompt(5, seed=6),
                                     max_tokens=2))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        assert stop_process(p, timeout_s=15) == 0


def test_metrics_export_the_offload_counters(decode_worker):
    stub, p = decode_worker
    collect(local_decode(stub, "metrics", prompt(9, seed=7), max_tokens=2))
    url = re.search(r"metrics=(\S+)", process_output(p)[0]).group(1)
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    s = stats(stub)

    def value(name: str) -> float:
        return float(re.search(rf"^pdserve:{name}{{[^}}]*}} (\S+)$", text, re.M).group(1))

    assert value("local_prefill_requests_total") == s.local_prefill_requests >= 1
    assert value("local_prefill_tokens_total") == s.local_prefill_tokens
    assert value("prompt_tokens_computed_total") == s.prompt_tokens_computed
    assert 0 < value("engine_busy_seconds_total") <= s.busy_seconds
    # Every decode step is in the step histogram: its count and sum are GetStats' counters at
    # the scrape, and its buckets are cumulative up to +Inf.
    count = value("decode_step_seconds_count")
    assert count >= 1 and count <= s.decode_steps
    assert 0 < value("decode_step_seconds_sum") <= s.decode_step_seconds
    buckets = [(le, float(n)) for le, n in re.findall(
        r'^pdserve:decode_step_seconds_bucket{le="([^"]+)",[^}]*} (\S+)$', text, re.M)]
    assert buckets[-1] == ("+Inf", count)
    assert all(a[1] <= b[1] for a, b in zip(buckets, buckets[1:]))


def test_draining_is_reported_and_refuses_new_requests(stub):
    call = local_decode(stub, "held", prompt(40, seed=8), 1, max_tokens=400, ignore_eos=True)
    next(call)  # in flight: the drain waits for it
    switched: list = []
    t = threading.Thread(target=lambda: switched.append(stub.SetRole(
        wpb.SetRoleRequest(role=wpb.ROLE_PREFILL, drain=True, drain_timeout_s=60), timeout=90)))
    t.start()
    deadline = time.monotonic() + 10
    while not stats(stub).draining and time.monotonic() < deadline:
        time.sleep(0.01)
    assert stats(stub).draining
    with pytest.raises(grpc.RpcError) as err:
        collect(local_decode(stub, "late", prompt(5, seed=9), max_tokens=2))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    call.cancel()  # the drain ends when the request in flight does
    t.join(timeout=30)
    assert switched and switched[0].role == wpb.ROLE_PREFILL
    s = stats(stub)
    assert not s.draining and s.role == wpb.ROLE_PREFILL
    stub.SetRole(wpb.SetRoleRequest(role=wpb.ROLE_DECODE, drain=True), timeout=30)


def test_a_prompt_prefilled_here_is_a_prefix_hit_for_any_prefill_worker(
        stub, reference, tiny_llama_dir, store):
    ids = prompt(60, seed=4242)
    want, _ = reference(ids, SamplingParams(max_tokens=4, ignore_eos=True))
    before = stats(stub).kv_blocks_put
    got, _, _ = collect(local_decode(stub, "published", ids, max_tokens=4, ignore_eos=True))
    assert got == want
    full = (len(ids) - 1) // 16  # the blocks before the last prompt token a prefill looks up
    deadline = time.monotonic() + 60
    while stats(stub).kv_blocks_put - before < full:  # put after the first token, off its path
        assert time.monotonic() < deadline, "the prompt's blocks never reached the store"
        time.sleep(0.05)
    assert stats(stub).kv_blocks_put - before == full
    p, addr = start_worker(tiny_llama_dir, store, "prefill")
    try:
        with rpc.make_channel(addr, WORKER) as ch:
            w = wpb_grpc.WorkerStub(ch)
            r = w.Prefill(wpb.PrefillRequest(
                request_id="again", prompt_token_ids=ids,
                sampling=common_pb2.SamplingParams(max_tokens=4, ignore_eos=True)), timeout=120)
            s = w.GetStats(wpb.GetStatsRequest(), timeout=10)
        assert r.first_token_id == want[0]
        # The prefill worker took those blocks from the store and computed only the rest.
        assert r.num_cached_tokens == full * 16
        assert s.kv_blocks_from_store == full
        assert s.prompt_tokens_computed == len(ids) - full * 16
    finally:
        assert stop_process(p, timeout_s=15) == 0
