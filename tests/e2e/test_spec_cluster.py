"""Speculative decoding in the disaggregated cluster: the decode worker drafts (n-gram) after
pulling KV from the store, and the output equals the cluster's without speculation."""

from __future__ import annotations

import urllib.request

from pdserve.controller.launcher import LocalCluster
from pdserve.engine.tokenizer import Tokenizer
from tests.e2e.conftest import cluster_spec
from tests.e2e.test_cluster import generate, worker_stats, workers


def test_ngram_speculation_in_the_cluster_gives_the_same_tokens(tiny_cluster, tiny_llama_dir):
    tok = Tokenizer.from_path(tiny_llama_dir)
    prompts = [tok.encode(t) for t in ("one two three one two three one two three one two",
                                       "a b c d a b c d a b c d a b", "Hello there, hello there")]
    want = [generate(tiny_cluster.router_address, token_ids=p, max_tokens=40, ignore_eos=True)[0]
            for p in prompts]
    with LocalCluster(cluster_spec(tiny_llama_dir, spec_method="ngram")) as spec_cluster:
        got = [generate(spec_cluster.router_address, token_ids=p, max_tokens=40,
                        ignore_eos=True)[0] for p in prompts]
        [decode] = workers(spec_cluster, "decode")
        assert worker_stats(decode).kv_blocks_fetched > 0  # it pulled KV from the store
        with urllib.request.urlopen(spec_cluster.worker_metrics[decode], timeout=30) as r:
            text = r.read().decode()
    assert got == want
    drafts = [line for line in text.splitlines()
              if line.startswith("pdserve:spec_decode_num_draft_tokens_total")]
    assert drafts and float(drafts[0].rsplit(" ", 1)[1]) > 0  # it did speculate
