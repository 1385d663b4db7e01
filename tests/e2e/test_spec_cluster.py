"""Speculative decoding in the disaggregated cluster: the decode worker drafts (n-gram) after
pulling KV from the store, and the output equals the cluster's without speculation."""

from __future__ import annotations

import urllib.request

from pdserve.launcher.local import LocalCluster
from pdserve.engine.tokenizer import Tokenizer
from tests.e2e.conftest import cluster_spec
from tests.e2e.test_cluster import generate, worker_stats, workers


def test_ngram_speculation_in_the_cluster_gives_the_same_tokens(tiny_cluster, tiny_llama_dir):
    tok = Tokenizer.from_path(tiny_llama_dir)
    prompts = [tok.encode(t) for t in ("one two three one two three one two three one two",
                                       "a b c d a b c d a b c d a b", "Hello there, hello there")]
    want = [generate(tiny_cluster.router_address, token_ids=p, max_tokens=40, ignore_eos=True)[0]
            for p in prompts]
    with LocalCluster(cluster_spec(tiny_llama_dir, spec_method="ngram",
                                   spec_schedule=False)) as spec_cluster:
        got = [generate(spec_cluster.router_address, token_ids=p, max_tokens=40,
                        ignore_eos=True)[0] for p in prompts]
        [decode] = workers(spec_cluster, "decode")
        assert worker_stats(decode).kv_blocks_fetched > 0  # it pulled KV from the store
        with urllib.request.urlopen(spec_cluster.worker_metrics[decode], timeout=30) as r:
            text = r.read().decode()
        ws = worker_stats(decode)
    assert got == want
    def value(prefix: str) -> list[float]:
        return [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line.startswith(prefix)]

    [draft_tokens] = value("pdserve:spec_decode_num_draft_tokens_total")
    [n_drafts] = value("pdserve:spec_decode_num_drafts_total")
    [accepted] = value("pdserve:spec_decode_num_accepted_tokens_total")
    assert draft_tokens > 0  # it did speculate
    # Per draft position: as many series as positions, non-increasing (accepting position i
    # needs i - 1 accepted), summing to the accepted total; the mean acceptance length agrees.
    per_pos = value("pdserve:spec_decode_num_accepted_tokens_per_pos_total")
    assert len(per_pos) == 4 and sum(per_pos) == accepted
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:]))
    [mean_len] = value("pdserve:spec_decode_mean_acceptance_length")
    assert abs(mean_len - (1 + accepted / n_drafts)) < 1e-9
    # GetStats carries the same counters.
    assert ws.spec_decode_num_draft_tokens >= draft_tokens
    assert sum(ws.spec_decode_num_accepted_tokens_per_pos) == ws.spec_decode_num_accepted_tokens


def test_trained_drafter_in_the_cluster_gives_the_same_tokens(tiny_cluster, tiny_llama_dir,
                                                              tmp_path, monkeypatch):
    """An EAGLE-style drafter on the decode worker: it has no hidden states for a request it
    just pulled from the store, builds them from its own decode steps, then drafts."""
    from pdserve.engine.spec.train import train_draft

    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))
    draft = str(tmp_path / "eagle")
    train_draft(tiny_llama_dir, "eagle", draft, epochs=4, max_new_tokens=16, window=8,
                draft_vocab_size=256, seed=0, batch_size=2, progress=False,
                prompts=[f"Say something about {w}." for w in ("cats", "rain", "maps", "tea")],
                eval_prompts=["Say something about ice."])
    tok = Tokenizer.from_path(tiny_llama_dir)
    prompts = [tok.encode(t) for t in ("Say something about cats.", "a b c d a b c d a b",
                                       "Hello there, hello there")]
    want = [generate(tiny_cluster.router_address, token_ids=p, max_tokens=30, ignore_eos=True)[0]
            for p in prompts]
    with LocalCluster(cluster_spec(tiny_llama_dir, spec_method="eagle", draft_path=draft,
                                   spec_schedule=False)) as spec_cluster:
        got = [generate(spec_cluster.router_address, token_ids=p, max_tokens=30,
                        ignore_eos=True)[0] for p in prompts]
        [decode] = workers(spec_cluster, "decode")
        ws = worker_stats(decode)
    assert got == want
    assert ws.kv_blocks_fetched > 0
    assert ws.spec_decode_num_draft_tokens > 0
