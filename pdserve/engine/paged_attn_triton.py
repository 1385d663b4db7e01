"""The Triton paged-attention kernel for decode rows on CUDA.

Owns the GPU twin of `paged_attn_cpu`: one step's decode spans (each sequence's query rows, query
count, context length and block table, the same `paged_attn_cpu.DecodeSpans` the C kernel takes)
against one layer's paged K/V cache [slots, Hkv, D], read in place through the block tables (no
gather, no padding, no mask tensors). `attention.py` owns the reference and decides when this
runs; this module must not decide which blocks a sequence owns.

Work. One program is (sequence, kv head, split of the context): the query heads sharing that kv
head times the span's query slots are the rows of one [rows, D] tile, so each K/V vector is read
once for all of them (GQA); query slot i of a span of Q sees keys 0 .. ctx_len - Q + i. Keys are
visited in tiles of BLOCK_N positions, each position's slot found through the block table, so any
block size works; softmax is online (running max, sum, rescaled accumulator) in fp32. With few
sequences (batch 1 at a long context) one program per sequence would leave most of the GPU idle,
so the context is cut into splits whose partials (max, sum, accumulator) a second kernel merges;
the split count is a run-time argument, so a step whose count differs compiles nothing new.
fp32 products use IEEE precision (not TF32): greedy fp32 tokens must equal the reference's;
bf16/fp16 tiles multiply natively with fp32 accumulation, the probabilities rounded to the cache
dtype for the second product, as flash attention does.
Supports fp32, bf16 and fp16 caches. On CPU the kernels run under `TRITON_INTERPRET=1` (set
before this module is imported: `triton.jit` reads it at decoration), which the tests use.
Only long-standing Triton APIs are used (Triton 3.x: `tl.dot(input_precision=...)`, `tl.trans`).
"""

from __future__ import annotations

import functools
import json
import math
import os
import subprocess
import sys
import time

import torch
import triton
import triton.language as tl

from pdserve.engine.paged_attn_cpu import DecodeSpans

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BLOCK_N = 32  # key positions per tile
MIN_ROWS = 16  # tl.dot wants tiles of at least 16 rows
# Key positions a split should at least cover: below this, the merge costs more than it saves.
MIN_SPLIT_TOKENS = 256
MAX_SPLITS = 64


@triton.jit
def _decode_split(q_ptr, k_ptr, v_ptr, out_ptr, meta_ptr, part_ml_ptr, part_acc_ptr,
                  nseq, width, stride_qt, stride_qh, stride_ot, stride_oh, stride_ks, stride_kh,
                  scale_log2, nsplit,
                  G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BS: tl.constexpr,
                  SPLIT: tl.constexpr, F32: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    row0 = tl.load(meta_ptr + b)
    qlen = tl.load(meta_ptr + nseq + b)
    ctx = tl.load(meta_ptr + 2 * nseq + b)
    table = meta_ptr + 3 * nseq + b.to(tl.int64) * width

    m_idx = tl.arange(0, BLOCK_M)  # row m is query slot m // G of head kvh * G + m % G
    slot_i = m_idx // G
    head = kvh * G + m_idx % G
    row_ok = slot_i < qlen
    d_idx = tl.arange(0, BLOCK_D)
    d_ok = d_idx < D
    q_rows = (row0 + slot_i).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + d_idx[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if F32:
        q = q.to(tl.float32)
    last = ctx - qlen + slot_i  # the last key position each row sees

    # Each sequence's context is cut into nsplit runs of whole tiles (the last may be short or
    # empty), so the launch depends on no host-side length: a captured graph can replay it.
    split_len = tl.cdiv(tl.cdiv(ctx, nsplit), BLOCK_N) * BLOCK_N
    lo = sp * split_len
    hi = tl.minimum(lo + split_len, ctx)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    n_idx = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        pos = start + n_idx
        pos_ok = pos < hi
        blk = tl.load(table + pos // BS, mask=pos_ok, other=0)
        slot = blk.to(tl.int64) * BS + pos % BS
        kv_off = slot[:, None] * stride_ks + kvh * stride_kh + d_idx[None, :]
        kv_ok = pos_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + kv_off, mask=kv_ok, other=0.0)
        if F32:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale_log2
        s = tl.where(pos_ok[None, :] & (pos[None, :] <= last[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row that has seen no visible key yet keeps m = -inf: subtract 0 there, not -inf.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + kv_off, mask=kv_ok, other=0.0)
        if F32:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    if not SPLIT:
        o = acc / l_i[:, None]
        tl.store(out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + d_idx[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        part = ((b.to(tl.int64) * tl.num_programs(1) + kvh) * nsplit + sp) * BLOCK_M
        tl.store(part_ml_ptr + 2 * part + m_idx, m_i)
        tl.store(part_ml_ptr + 2 * part + BLOCK_M + m_idx, l_i)
        tl.store(part_acc_ptr + (part + m_idx[:, None]) * BLOCK_D + d_idx[None, :], acc)


@triton.jit
def _merge_splits(out_ptr, meta_ptr, part_ml_ptr, part_acc_ptr, nseq, stride_ot, stride_oh,
                  nsplit, G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_M: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    row0 = tl.load(meta_ptr + b)
    qlen = tl.load(meta_ptr + nseq + b)
    m_idx = tl.arange(0, BLOCK_M)
    slot_i = m_idx // G
    head = kvh * G + m_idx % G
    row_ok = slot_i < qlen
    d_idx = tl.arange(0, BLOCK_D)
    d_ok = d_idx < D
    base = (b.to(tl.int64) * tl.num_programs(1) + kvh) * nsplit
    big = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for sp in range(nsplit):
        big = tl.maximum(big, tl.load(part_ml_ptr + 2 * (base + sp) * BLOCK_M + m_idx))
    big = tl.where(big == float("-inf"), 0.0, big)  # padding rows only: every real row sees key 0
    l_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for sp in range(nsplit):
        part = (base + sp) * BLOCK_M
        w = tl.exp2(tl.load(part_ml_ptr + 2 * part + m_idx) - big)
        l_sum += w * tl.load(part_ml_ptr + 2 * part + BLOCK_M + m_idx)
        acc += w[:, None] * tl.load(part_acc_ptr + (part + m_idx[:, None]) * BLOCK_D + d_idx[None, :])
    o = acc / tl.where(l_sum == 0.0, 1.0, l_sum)[:, None]
    q_rows = (row0 + slot_i).to(tl.int64)
    tl.store(out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + d_idx[None, :],
             o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


# The interpreter's tl.dot multiplies bf16 tiles wrongly, so there every product runs in fp32
# (the numbers differ from the GPU's bf16 products only by rounding).
INTERPRETED = type(_decode_split).__name__ == "InterpretedFunction"


def choose_splits(nseq: int, n_kv_heads: int, max_ctx: int, programs_wanted: int) -> int:
    """How many splits to cut each context into: enough programs to fill the GPU
    (`programs_wanted`, about twice its multiprocessors), each split at least MIN_SPLIT_TOKENS
    keys, at most MAX_SPLITS. A pure function of the step's shape."""
    by_work = max(1, max_ctx // MIN_SPLIT_TOKENS)
    by_fill = max(1, -(-programs_wanted // max(1, nseq * n_kv_heads)))
    return max(1, min(by_work, by_fill, MAX_SPLITS))


@functools.lru_cache(maxsize=None)
def _programs_wanted(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter: more programs only cost time
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count


class DecodeMeta:
    """One step's spans on the kernel's device: built once per step, used by every layer."""

    def __init__(self, spans: DecodeSpans, device: torch.device) -> None:
        self.spans = spans
        self.ints = spans.ints.to(device, non_blocking=True)
        self.max_ctx = max(spans.ints[2 * spans.nseq: 3 * spans.nseq].tolist(), default=0)


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether these tensors are ones the kernel takes (CUDA, or CPU under the interpreter;
    fp32, bf16 or fp16, one dtype)."""
    return q.device == k_cache.device and q.dtype == k_cache.dtype and q.dtype in DTYPES


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
           meta: DecodeMeta, splits: int | None = None) -> None:
    """Attention of the spans' rows of q [T, H, D] over the paged cache [slots, Hkv, D] into the
    same rows of out [T, H, D]; other rows of out are left alone. `splits`: pieces each context
    is cut into (default: `choose_splits`)."""
    sp = meta.spans
    sp.check(q, k_cache, v_cache, out, "paged attention Triton kernel", supports(q, k_cache),
             "fp32/bf16/fp16 (one device)")
    _, h, d = q.shape
    hkv = k_cache.shape[1]
    if h % hkv:
        raise ValueError(f"paged attention Triton kernel: {h} query heads over {hkv} kv heads")
    if sp.nseq == 0:
        return
    g = h // hkv
    block_m = max(MIN_ROWS, triton.next_power_of_2(g * sp.max_q))
    block_d = max(16, triton.next_power_of_2(d))
    if splits is None:
        splits = choose_splits(sp.nseq, hkv, meta.max_ctx, _programs_wanted(q.device))
    splits = max(1, min(splits, MAX_SPLITS))
    if splits > 1:
        n_part = sp.nseq * hkv * splits * block_m
        part_ml = torch.empty(2 * n_part, dtype=torch.float32, device=q.device)
        part_acc = torch.empty(n_part * block_d, dtype=torch.float32, device=q.device)
    else:
        part_ml = part_acc = out  # not touched
    scale_log2 = (1.0 / math.sqrt(d)) * 1.4426950408889634  # softmax in base 2
    _decode_split[(sp.nseq, hkv, splits)](
        q, k_cache, v_cache, out, meta.ints, part_ml, part_acc,
        sp.nseq, sp.width, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), scale_log2, splits,
        G=g, D=d, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=BLOCK_N, BS=sp.block_size,
        SPLIT=splits > 1, F32=q.dtype == torch.float32 or INTERPRETED)
    if splits > 1:
        _merge_splits[(sp.nseq, hkv)](
            out, meta.ints, part_ml, part_acc, sp.nseq, out.stride(0), out.stride(1), splits,
            G=g, D=d, BLOCK_D=block_d, BLOCK_M=block_m)


# Tolerances of `self_check` against the reference, by dtype: the reference rounds through the
# cache dtype at different points than the kernel does.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}
# (heads, kv heads, head dim, block size, [(cached, new) per sequence]): SmolLM2-135M's heads,
# Llama-3-8B's heads with a long ragged batch, a GQA span batch of verification steps.
CHECK_SHAPES = [
    (9, 3, 64, 16, [(1, 1), (40, 1), (300, 1)]),
    (32, 8, 128, 16, [(c, 1) for c in (17, 200, 900, 2047, 4000, 31, 64, 1500)]),
    (8, 2, 64, 32, [(20, 4), (100, 16), (64, 1), (7, 3)]),
]
# The interpreter is slow: on CPU, the same kinds of case at small sizes.
CPU_CHECK_SHAPES = [
    (9, 3, 64, 16, [(1, 1), (40, 1)]),
    (8, 2, 16, 32, [(20, 4), (7, 16)]),
]


def random_case(spans: list[tuple[int, int]], h: int, hkv: int, d: int, bs: int,
                dtype: torch.dtype, device: torch.device, seed: int = 0):
    """(cached, new) per sequence -> (metadata, q, k_new, v_new, k_cache, v_cache): random values, each
    sequence's blocks scattered over a pool with spare blocks in shuffled order, the new tokens'
    K/V written; for checks against the reference."""
    from pdserve.engine.attention import build_attention_metadata, write_kv
    gen = torch.Generator().manual_seed(seed)
    need = [-(-(c + n) // bs) for c, n in spans]
    ids = torch.randperm(sum(need) + 7, generator=gen).tolist()
    seqs, at = [], 0
    for (c, n), k in zip(spans, need):
        seqs.append((c, n, ids[at:at + k]))
        at += k
    t = sum(n for _, n in spans)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    k_cache, v_cache = rand(len(ids) * bs, hkv, d), rand(len(ids) * bs, hkv, d)
    q, k_new, v_new = rand(t, h, d), rand(t, hkv, d), rand(t, hkv, d)
    meta = build_attention_metadata(seqs, bs, device)
    write_kv(k_cache, v_cache, k_new, v_new, meta.slot_mapping)
    return meta, q, k_new, v_new, k_cache, v_cache


def decode_rows(d) -> list[int]:
    """The flat-batch rows a decode batch's spans own."""
    return [r + i for r, n in zip(d.rows, d.q_lens) for i in range(n)]


def _timed(fn, device: torch.device, repeats: int) -> float:
    fn()  # compile / warm up
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) / repeats * 1e3


def self_check(device: str | torch.device = "cuda", dtypes=DTYPES, shapes=None,
               repeats: int = 20) -> dict:
    """The kernel against the PyTorch reference on CHECK_SHAPES (on CPU: CPU_CHECK_SHAPES; or
    `shapes`) in each dtype, and CUDA prefill's SDPA call against the mask path:
    {"device", "triton", "torch", "ok", "interpreter", "cases": [{shape, dtype, max_abs_err, tol,
    ok, kernel_ms, reference_ms}], "prefill": [...]}; the times are per call (one layer of one
    step), measured in the same run, on CUDA only (the interpreter's times mean nothing). On CPU
    the kernels need the interpreter: a process that did not set TRITON_INTERPRET=1 before
    importing this module runs the check in a child process that does."""
    from pdserve.engine.attention import decode_reference
    device = torch.device(device)
    if device.type == "cpu" and not INTERPRETED:
        return _self_check_in_interpreter(dtypes, shapes)
    cases = []
    default = CHECK_SHAPES if device.type == "cuda" else CPU_CHECK_SHAPES
    for i, (h, hkv, d, bs, spans) in enumerate(shapes or default):
        for dtype in dtypes:
            meta_all, q, _, _, kc, vc = random_case(spans, h, hkv, d, bs, dtype, device, seed=i)
            dec = meta_all.decode
            rows = torch.tensor(decode_rows(dec), device=device)
            meta = DecodeMeta(dec.spans(), device)
            out, ref = torch.zeros_like(q), torch.zeros_like(q)
            decode(q, kc, vc, out, meta)
            decode_reference(q, kc, vc, ref, dec)
            err = (out[rows].float() - ref[rows].float()).abs().max().item()
            case = {"shape": {"heads": h, "kv_heads": hkv, "head_dim": d, "block_size": bs,
                              "spans": spans}, "dtype": str(dtype).removeprefix("torch."),
                    "max_abs_err": err, "tol": TOLERANCE[dtype], "ok": err <= TOLERANCE[dtype]}
            if device.type == "cuda":
                case["kernel_ms"] = _timed(lambda: decode(q, kc, vc, out, meta), device, repeats)
                case["reference_ms"] = _timed(lambda: decode_reference(q, kc, vc, ref, dec),
                                              device, repeats)
            cases.append(case)
    prefill = [_prefill_case(lq, lk, dtype, device) for lq, lk in PREFILL_SHAPES for dtype in dtypes]
    return {"device": str(device), "triton": triton.__version__, "torch": torch.__version__,
            "ok": all(c["ok"] for c in cases + prefill), "interpreter": INTERPRETED,
            "cases": cases, "prefill": prefill}


def _self_check_in_interpreter(dtypes, shapes) -> dict:
    code = ("import json, sys, torch; from pdserve.engine.paged_attn_triton import self_check; "
            "a = json.loads(sys.argv[1]); print(json.dumps(self_check('cpu', shapes=a[1], "
            "dtypes=[getattr(torch, n) for n in a[0]])))")
    names = [str(d).removeprefix("torch.") for d in dtypes]
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", code, json.dumps([names, shapes])], env=env,
                       capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"paged attention Triton kernel: the interpreter check failed: "
                           f"{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


# (query tokens, keys) of a prefill chunk: a whole prompt, a chunk on a cached prefix.
PREFILL_SHAPES = [(64, 64), (48, 300)]


def _prefill_case(lq: int, lk: int, dtype: torch.dtype, device: torch.device) -> dict:
    """The prefill SDPA call CUDA runs (bottom-right causal bias, kv heads repeated) against
    the mask path CPU runs, on GQA heads of Llama-3-8B's shape."""
    from pdserve.engine.attention_cuda import prefill_sdpa
    gen = torch.Generator().manual_seed(lq + lk)
    q, k, v = (torch.randn(1, h, n, 128, generator=gen).to(device=device, dtype=dtype)
               for h, n in ((32, lq), (8, lk), (8, lk)))
    mask = (torch.arange(lk).unsqueeze(0) <= torch.arange(lk - lq, lk).unsqueeze(1)).to(device)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float().repeat_interleave(4, 1), v.float().repeat_interleave(4, 1),
        attn_mask=mask)
    err = (prefill_sdpa(q, k, v, mask).float() - ref).abs().max().item()
    # fp32 on CUDA may run TF32-free efficient attention; allow its accumulation order.
    tol = max(TOLERANCE[dtype], 1e-4 if dtype == torch.float32 else 0.0)
    return {"q_tokens": lq, "keys": lk, "dtype": str(dtype).removeprefix("torch."),
            "max_abs_err": err, "tol": tol, "ok": err <= tol}
