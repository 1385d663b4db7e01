"""Short query spans on a cached context (verification of drafts, short prefill chunks) go
through the batched decode attention; they must equal the one-call-per-sequence path."""

from __future__ import annotations

import pytest
import torch

import pdserve.engine.attention as attn
from pdserve.engine.attention import build_attention_metadata, paged_attention, write_kv


@pytest.mark.parametrize("spans", [
    [(5, 1), (9, 3), (17, 5)],  # a decode and two verifications of different lengths
    [(3, 4), (40, 4)],  # equal spans, different contexts
    [(1, 16), (7, 2), (12, 1)],  # the longest short span
])
def test_batched_short_spans_equal_per_sequence_attention(spans, monkeypatch):
    torch.manual_seed(0)
    bs, h, hkv, d = 4, 6, 2, 8
    blocks_per_seq = 16
    seqs = []
    for i, (computed, n) in enumerate(spans):
        table = list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))
        seqs.append((computed, n, table))
    t = sum(n for _, n, _ in seqs)
    slots_total = len(spans) * blocks_per_seq * bs
    k_cache = torch.randn(slots_total, hkv, d)
    v_cache = torch.randn(slots_total, hkv, d)
    q = torch.randn(t, h, d)
    k_new = torch.randn(t, hkv, d)
    v_new = torch.randn(t, hkv, d)

    def run():
        kc, vc = k_cache.clone(), v_cache.clone()
        meta = build_attention_metadata(seqs, bs, torch.device("cpu"))
        write_kv(kc, vc, k_new, v_new, meta.slot_mapping)
        return paged_attention(q, k_new, v_new, kc, vc, meta), meta

    batched, meta = run()
    assert meta.decode_idx is not None and not meta.prefills  # all went the batched way
    monkeypatch.setattr(attn, "SHORT_SPAN", 1)  # spans > 1 now take one call each
    plain, meta = run()
    assert len(meta.prefills) == sum(1 for _, n in spans if n > 1)
    torch.testing.assert_close(batched, plain, rtol=1e-5, atol=1e-5)
