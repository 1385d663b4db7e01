"""A colocated simulated cluster (no prefill worker): the decode worker prefills every prompt
itself, as the live router's prefill fallback has it do, and its times are the profile's."""

from __future__ import annotations

import pytest

from pdserve.sim.config import SimConfig
from pdserve.core.step_profile import load_profile
from pdserve.sim.run import simulate
from pdserve.sim.trace import SimRequest, load_trace

H100 = load_profile("h100-llama2-7b")


def test_one_request_alone_costs_one_prefill_and_one_decode_step_per_later_token():
    r = simulate(SimConfig(prefill_workers=0, decode_workers=1),
                 [SimRequest("a", 1.0, 1000, 5)], H100)
    assert r.status == ["ok"]
    assert r.prefill_worker == r.decode_worker == ["w0000"]
    assert r.ttft_s[0] == pytest.approx(H100.prefill_s(1000), rel=1e-9)
    decode = sum(H100.decode_s(1, 1000 + j) for j in range(4))
    assert r.end_s[0] - 1.0 - r.ttft_s[0] == pytest.approx(decode, rel=1e-9)
    assert r.counts["kv_transfers"] == 0 and r.counts["kv_bytes"] == 0
    assert r.counts["prompt_tokens_computed"] == 1000


def test_a_0p1d_cluster_serves_every_request_on_its_one_worker():
    reqs = load_trace("synthetic:poisson:rate=4,n=120,in=1024,out=64", seed=3)
    reqs = [r for r in reqs if r.prompt_tokens <= 4096]
    r = simulate(SimConfig(prefill_workers=0, decode_workers=1, max_num_batched_tokens=4096),
                 reqs, H100)
    s = r.summary()
    assert s["finished"] == len(reqs) and s["rejected"] == 0
    assert r.counts["kv_transfers"] == 0
    assert r.counts["prompt_tokens_computed"] == sum(q.prompt_tokens for q in reqs)
    for i, q in enumerate(reqs):
        assert r.prefill_worker[i] == r.decode_worker[i] == "w0000"
        # a step that holds the whole prompt takes at least the prompt's prefill alone
        assert r.ttft_s[i] >= H100.prefill_s(q.prompt_tokens) * (1 - 1e-9)
        itl = r.itl_s(i)
        if itl is not None:  # every later token waits for at least one decode step
            assert itl >= H100.decode_s(1, q.prompt_tokens) * (1 - 1e-9)
        assert r.end_s[i] > q.arrival_s + r.ttft_s[i] or q.output_tokens == 1


def test_colocation_spreads_requests_over_several_decode_workers():
    reqs = load_trace("synthetic:poisson:rate=8,n=80,in=512,out=32", seed=1)
    r = simulate(SimConfig(prefill_workers=0, decode_workers=2), reqs, H100)
    assert r.summary()["finished"] == len(reqs)
    assert set(r.decode_worker) == {"w0000", "w0001"}
    assert r.prefill_worker == r.decode_worker


def test_colocated_and_disaggregated_serve_the_same_tokens():
    reqs = load_trace("synthetic:poisson:rate=2,n=40,in=512,out=32", seed=2)
    a = simulate(SimConfig(prefill_workers=0, decode_workers=1), reqs, H100)
    b = simulate(SimConfig(prefill_workers=1, decode_workers=1), reqs, H100)
    assert a.summary()["finished"] == b.summary()["finished"] == len(reqs)
    assert a.counts["prompt_tokens_computed"] == b.counts["prompt_tokens_computed"]
    assert b.counts["kv_transfers"] == len([q for q in reqs if q.output_tokens > 1])
