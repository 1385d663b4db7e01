"""Conditional disaggregation on a real cluster (tiny Llama, 1 prefill + 1 decode, loopback): a
prompt the decode worker caches all but a short tail of (a chat's next turn) is prefilled and
decoded there, with transformers' tokens; a cold prompt, or a long new tail, takes the
prefill worker as before."""

from __future__ import annotations

import pytest

from pdserve import rpc
from pdserve.launcher.local import LocalCluster
from pdserve.core.block_hash import prompt_block_hashes
from pdserve.core.identity import WORKER
from pdserve.proto import worker_pb2 as wpb
from pdserve.proto import worker_pb2_grpc as wpb_grpc
from tests.e2e.conftest import cluster_spec
from tests.e2e.test_cluster import generate, worker_stats, workers

N = 24


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir):
    with LocalCluster(cluster_spec(tiny_llama_dir, max_local_prefill_tokens=64)) as c:
        yield c


@pytest.fixture(scope="module")
def hf(tiny_llama_dir):
    from tests.engine.test_model_parity import hf_model

    return hf_model(tiny_llama_dir)


def greedy(hf, prompt):
    from tests.engine.test_model_parity import hf_greedy

    return hf_greedy(hf, prompt, N)


def run(cluster, prompt):
    ids, _, finish, usage = generate(cluster.router_address, token_ids=prompt, max_tokens=N,
                                     ignore_eos=True)
    assert finish
    return ids, usage


def counts(cluster):
    p, d = workers(cluster, "prefill")[0], workers(cluster, "decode")[0]
    sp, sd = worker_stats(p), worker_stats(d)
    return sp.prompt_tokens_computed, sd.local_prefill_requests, sd.local_prefill_tokens


def settle(cluster, tokens):
    """Wait until the decode worker has published every full block of `tokens` on its KV event
    stream, the one the router's index follows (the router reads the same batches)."""
    want = set(prompt_block_hashes(list(tokens), 16, ""))
    decode = workers(cluster, "decode")[0]
    with rpc.make_channel(decode, WORKER) as ch:
        for batch in wpb_grpc.WorkerStub(ch).WatchKvEvents(wpb.WatchKvEventsRequest(),
                                                           timeout=30):
            want -= {bytes(e.block_hash) for e in batch.events
                     if e.kind == wpb.KV_EVENT_KIND_STORED}
            if not want:
                return


def test_a_next_turn_is_prefilled_on_the_decode_worker_with_the_same_tokens(cluster, hf):
    first = list(range(400, 440))  # 40 tokens, cold: 2 full blocks of 16 (+8)
    before = counts(cluster)
    out1, usage1 = run(cluster, first)
    assert out1 == greedy(hf, first)
    mid = counts(cluster)
    assert mid[0] - before[0] == len(first) and mid[1] == before[1]  # the normal path
    assert usage1.cached_prompt_tokens == 0
    settle(cluster, first + out1[:-1])  # the last token's KV is never computed

    # The next turn: the conversation so far (prompt and answer) and a few new tokens. The
    # decode worker holds every full block of it but the tail.
    turn = first + out1 + list(range(500, 510))
    out2, usage2 = run(cluster, turn)
    assert out2 == greedy(hf, turn)
    after = counts(cluster)
    assert after[0] == mid[0], "the prefill worker computed nothing"
    assert after[1] == mid[1] + 1 and after[2] - mid[2] == len(turn)
    cached = (len(first) + N - 1) // 16 * 16  # decoded blocks: all but the last token's KV
    assert usage2.cached_prompt_tokens == cached
    assert len(turn) - cached <= 64


def test_a_long_new_tail_or_a_cold_prompt_takes_the_prefill_worker(cluster, hf):
    base = list(range(600, 632))  # 2 full blocks
    out = run(cluster, base)[0]
    settle(cluster, base + out[:-1])
    before = counts(cluster)
    long_tail = base + list(range(700, 780))  # 80 new tokens: over the bound of 64
    out, usage = run(cluster, long_tail)
    assert out == greedy(hf, long_tail)
    after = counts(cluster)
    assert after[1] == before[1], "not prefilled locally"
    # The prefill worker computed the tail (its own cache held the base's blocks).
    assert after[0] - before[0] == len(long_tail) - 16 * (len(base) // 16)
    cold = list(range(900, 910))  # shorter than the bound, but nothing of it is cached
    out, _ = run(cluster, cold)
    assert out == greedy(hf, cold)
    assert counts(cluster)[1] == before[1]
