"""The C paged-attention kernel equals the PyTorch reference on decode rows: random caches,
ragged contexts, GQA, block boundaries, shuffled block tables, spans of several query tokens
(speculative verification), every thread count and chunking of a context."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.engine import paged_attn_cpu
from pdserve.engine.attention import (SHORT_SPAN, build_attention_metadata, paged_attention,
                                      write_kv)

pytestmark = pytest.mark.skipif(not paged_attn_cpu.available(),
                                reason="paged attention C kernel: no C compiler")

CPU = torch.device("cpu")


def make_case(spans: list[tuple[int, int]], h: int, hkv: int, d: int, bs: int, seed: int = 0,
              dtype: torch.dtype = torch.float32):
    """(computed, new) per sequence -> metadata, caches with the new K/V written, q. Each
    sequence's blocks are scattered over a pool with spare blocks, in shuffled order."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    need = [-(-(c + n) // bs) for c, n in spans]
    ids = list(range(sum(need) + 7))
    rng.shuffle(ids)
    seqs, at = [], 0
    for (c, n), k in zip(spans, need):
        seqs.append((c, n, ids[at:at + k]))
        at += k
    slots = len(ids) * bs
    t = sum(n for _, n in spans)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    k_cache, v_cache = rand(slots, hkv, d), rand(slots, hkv, d)
    q, k_new, v_new = rand(t, h, d), rand(t, hkv, d), rand(t, hkv, d)
    meta = build_attention_metadata(seqs, bs, CPU)
    meta.seqs = seqs  # for a test that builds it again
    write_kv(k_cache, v_cache, k_new, v_new, meta.slot_mapping)
    return meta, q, k_new, v_new, k_cache, v_cache


def reference(meta, q, k_new, v_new, k_cache, v_cache, monkeypatch) -> torch.Tensor:
    with monkeypatch.context() as m:
        m.setenv("PDSERVE_PAGED_ATTN", "torch")
        return paged_attention(q, k_new, v_new, k_cache, v_cache, meta)


def kernel(meta, q, k_cache, v_cache, threads: int, split: int = 0, isa: int = 2) -> torch.Tensor:
    out = torch.full_like(q, float("nan"))  # rows the kernel does not write stay NaN
    paged_attn_cpu.decode(q, k_cache, v_cache, out, meta.decode.spans(), threads=threads,
                          split=split, min_parallel_work=0,  # threads even on tiny cases
                          max_isa=isa)
    return out


SHAPES = [(9, 3, 64), (4, 2, 16), (8, 1, 40), (4, 4, 128), (6, 2, 32)]  # (heads, kv heads, dim)


@pytest.mark.parametrize("h,hkv,d", SHAPES)
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("isa", [0, 1, 2])  # each build this CPU can run (2: its widest)
def test_decode_rows_match_reference(h, hkv, d, threads, isa, monkeypatch):
    bs = 16
    # Contexts on both sides of block boundaries, the shortest a decode has (a cached token and
    # the new one), a long one; ragged.
    ctx = [2, 15, 16, 17, 31, 32, 33, 100, 255, 600]
    spans = [(c - 1, 1) for c in ctx]
    case = make_case(spans, h, hkv, d, bs, seed=h * d + threads)
    ref = reference(*case, monkeypatch)
    meta, q, _, _, kc, vc = case
    for split in (0, 1, 2, 5):
        out = kernel(meta, q, kc, vc, threads, split, isa)
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize("width", [16, 8])
def test_both_vector_width_builds_match_reference(width, monkeypatch):
    """The 16-float build (AVX-512 CPUs and others) and the 8-float one (AVX2 CPUs pick it),
    each with every ISA body this CPU runs, whichever build this CPU would load itself."""
    lib = paged_attn_cpu.library(width)
    assert lib.pa_vector_width() == width
    monkeypatch.setattr(paged_attn_cpu, "_lib", lib)
    ctx = [2, 17, 33, 100, 255]
    for h, hkv, d in SHAPES[:3]:
        case = make_case([(c - 1, 1) for c in ctx], h, hkv, d, 16, seed=width + d)
        ref = reference(*case, monkeypatch)
        meta, q, _, _, kc, vc = case
        for isa in (0, 1, 2):
            for threads, split in ((1, 0), (2, 3)):
                torch.testing.assert_close(kernel(meta, q, kc, vc, threads, split, isa), ref,
                                           rtol=0, atol=1e-5)


@pytest.mark.parametrize("block_size", [1, 4, 16, 32])
def test_block_sizes(block_size, monkeypatch):
    case = make_case([(3, 1), (40, 1), (64, 1), (9, 1)], 9, 3, 64, block_size, seed=block_size)
    ref = reference(*case, monkeypatch)
    meta, q, _, _, kc, vc = case
    for split in (0, 3):
        torch.testing.assert_close(kernel(meta, q, kc, vc, 2, split), ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize("spans", [
    [(5, 1), (9, 3), (17, 5)],  # a decode and two verifications of different lengths
    [(3, 4), (40, 4)],  # equal spans, different contexts
    [(1, SHORT_SPAN), (7, 2), (12, 1)],  # the longest short span
    [(15, 2), (16, 16), (47, 9), (200, 6)],  # spans across block boundaries
])
@pytest.mark.parametrize("h,hkv,d", [(9, 3, 64), (6, 2, 20)])
def test_speculative_spans_are_causal_over_their_last_positions(spans, h, hkv, d, monkeypatch):
    case = make_case(spans, h, hkv, d, 16, seed=len(spans) + d)
    meta, q, _, _, kc, vc = case
    assert meta.decode is not None and not meta.prefills
    ref = reference(*case, monkeypatch)
    for threads, split in ((1, 1), (2, 0), (2, 4)):
        torch.testing.assert_close(kernel(meta, q, kc, vc, threads, split), ref, rtol=0, atol=1e-5)


def test_mixed_batch_through_paged_attention(monkeypatch):
    """Prefill chunks (fresh and on a cached prefix) next to decodes: the kernel fills the decode
    rows, the reference the prefill rows, and the whole output equals the reference's."""
    spans = [(0, 20), (30, 1), (64, 40), (7, 3), (0, 5), (99, 1)]
    case = make_case(spans, 9, 3, 64, 16, seed=7)
    meta, q, kn, vn, kc, vc = case
    assert meta.decode is not None and len(meta.prefills) == 3
    ref = reference(*case, monkeypatch)
    monkeypatch.setenv("PDSERVE_PAGED_ATTN", "c")
    calls = []
    real = paged_attn_cpu.decode
    monkeypatch.setattr(paged_attn_cpu, "decode", lambda *a, **k: calls.append(1) or real(*a, **k))
    fresh = build_attention_metadata(meta.seqs, 16, CPU)  # the mode is decided once per step
    out = paged_attention(q, kn, vn, kc, vc, fresh)
    assert calls == [1]
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)


def test_bfloat16_cache_stays_within_bf16_rounding(monkeypatch):
    case = make_case([(30, 1), (77, 1), (5, 3)], 9, 3, 64, 16, seed=3, dtype=torch.bfloat16)
    meta, q, kn, vn, kc, vc = case
    exact = reference(meta, q.float(), kn.float(), vn.float(), kc.float(), vc.float(), monkeypatch)
    for isa in (0, 1, 2):
        out = kernel(meta, q, kc, vc, 2, isa=isa)
        assert out.dtype == torch.bfloat16
        # Rounding the output to bf16 is the only error left: half a bf16 ulp of |x| <= 2.
        torch.testing.assert_close(out.float(), exact, rtol=2 ** -8, atol=2 ** -8)


def test_rows_and_blocks_outside_the_tensors_are_refused():
    meta, q, _, _, kc, vc = make_case([(10, 1), (20, 1)], 4, 2, 16, 16)
    with pytest.raises(ValueError, match="row 2 of 1"):
        paged_attn_cpu.decode(q[:1], kc, vc, torch.empty_like(q[:1]), meta.decode.spans())
    with pytest.raises(ValueError, match="past the cache"):
        paged_attn_cpu.decode(q, kc[:16], vc[:16], torch.empty_like(q), meta.decode.spans())
    with pytest.raises(ValueError, match="fp32/bf16"):
        paged_attn_cpu.decode(q.half(), kc.half(), vc.half(), torch.empty_like(q.half()),
                              meta.decode.spans())
