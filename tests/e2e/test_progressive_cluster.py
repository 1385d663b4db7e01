"""Progressive KV transfer in the real cluster (`--progressive-kv`): the prefill worker streams
each layer's anchor and residual planes through the store, the decode worker joins on the
anchors and verifies once the residuals land (or joins exact when they already have). Output
must equal the plain whole-block transfer's token for token (invariant 3), also for prompts
longer than the prefill chunk budget (several spans) and for a repeated prompt (a cached prefix
moves as whole blocks, the rest streamed)."""

from __future__ import annotations

import urllib.request

from pdserve.launcher.local import LocalCluster
from tests.e2e.conftest import cluster_spec
from tests.e2e.test_cluster import generate, worker_stats, workers

CHUNK = 24  # max_num_batched_tokens: a prompt of 60 tokens prefills in 3 chunks


def _requests():
    long_prompt = [(7 * i + 3) % 500 + 10 for i in range(60)]
    return [
        (list(range(100, 109)), dict(max_tokens=20, ignore_eos=True)),
        ([5, 9, 100, 7, 3, 11, 42, 8, 19, 33, 2000, 17, 4], dict(max_tokens=16, ignore_eos=True,
                                                                 temperature=0.8, seed=11)),
        (long_prompt, dict(max_tokens=20, ignore_eos=True)),
        (long_prompt, dict(max_tokens=12, ignore_eos=True, temperature=0.7, seed=3)),  # prefix hit
        (long_prompt + [44, 45], dict(max_tokens=10, ignore_eos=True)),
    ]


def _run(progressive: bool, tiny_llama_dir: str):
    spec = cluster_spec(tiny_llama_dir, max_num_batched_tokens=CHUNK, progressive_kv=progressive)
    with LocalCluster(spec) as cluster:
        outs = [generate(cluster.router_address, token_ids=p, **s)[0] for p, s in _requests()]
        [decode] = workers(cluster, "decode")
        [prefill] = workers(cluster, "prefill")
        with urllib.request.urlopen(cluster.worker_metrics[decode], timeout=30) as r:
            metrics = r.read().decode()
        return outs, worker_stats(prefill), worker_stats(decode), metrics


def test_progressive_transfer_gives_the_same_tokens(tiny_llama_dir):
    want, _, plain_decode, _ = _run(False, tiny_llama_dir)
    got, prefill, decode, metrics = _run(True, tiny_llama_dir)
    assert got == want
    assert all(len(o) > 0 for o in got)
    n = len(_requests())
    # Plain: no stream at all.
    assert plain_decode.progressive_requests == 0
    # Progressive: every request went through the stream, and each ended in exactly one way.
    assert decode.progressive_requests == n
    assert (decode.progressive_anchor_joins + decode.progressive_exact_joins
            + decode.progressive_fallbacks) == n
    assert decode.progressive_fallbacks == 0  # loopback store, nothing lost
    assert prefill.kv_stream_fallbacks == 0 and prefill.kv_stream_put_failures == 0
    # Every (span, layer) pair of every request was stored: at least layers x requests, and
    # more than that since the long prompts prefilled in several chunks.
    assert prefill.kv_stream_layers_put > 2 * n
    # Drafts on anchors are verified only for anchor joins (timing decides how many there are).
    if decode.progressive_anchor_joins == 0:
        assert decode.anchor_num_drafts == 0
    assert decode.anchor_num_accepted_tokens <= decode.anchor_num_draft_tokens
    # Only a cached prefix goes as whole blocks (the repeated long prompt's leading blocks).
    assert prefill.kv_blocks_put < sum(-(-len(p) // 16) for p, _ in _requests())
    # The decode worker's /metrics carries the same counters.
    assert f"pdserve:progressive_requests_total{{model_name=" in metrics
    line = [x for x in metrics.splitlines() if x.startswith("pdserve:progressive_requests_total")]
    assert float(line[0].rsplit(" ", 1)[1]) == n
