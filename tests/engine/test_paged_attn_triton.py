"""The Triton paged-attention decode kernel equals the PyTorch reference: GQA ratios (MHA to MQA),
head dims that are not powers of two, block sizes, ragged contexts on both sides of block
boundaries, causal spans of up to 16 query tokens (speculative verification), contexts cut into
splits and merged, fp32/bf16/fp16; rows it does not own are left alone. Inside the engine it is
the decode path `PDSERVE_PAGED_ATTN=triton` picks, with greedy tokens equal to the reference's.
CUDA prefill's SDPA call (bottom-right causal bias, repeated kv heads) equals the mask path.

Without CUDA the kernels run on CPU under TRITON_INTERPRET=1, set below before triton decorates
them (shapes stay small: the interpreter is slow). With CUDA they run compiled on the GPU, and
the interpreter cases run once more in a subprocess with CUDA hidden.
"""

from __future__ import annotations

import importlib
import logging
import os
import subprocess
import sys

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # triton.jit reads it when the kernels are decorated
pytest.importorskip("triton")
if "pdserve.engine.paged_attn_triton" in sys.modules:  # decorated earlier, maybe without it
    importlib.reload(sys.modules["pdserve.engine.paged_attn_triton"])
from pdserve.engine import attention, attention_cuda  # noqa: E402
from pdserve.engine import paged_attn_triton as pat  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}

# (heads, kv heads, head dim, block size): GQA 2, GQA 3 with a head dim of 40, MHA, MQA (8
# query heads on one kv head) with blocks of 32 and of 5 (not a power of two).
SHAPES = [(4, 2, 16, 16), (9, 3, 40, 8), (4, 4, 32, 16), (8, 1, 16, 32), (2, 1, 16, 5)]
# (cached, new) per sequence: one-token decodes at contexts around block boundaries, a prompt
# being prefilled in the same flat batch (rows the kernel must leave alone), spans of 3, 16, 2.
SPANS = [(1, 1), (14, 1), (15, 1), (16, 1), (32, 1), (0, 5), (6, 3), (20, 16), (70, 2)]


def run_kernel(spans, h, hkv, d, bs, dtype, splits=None, seed=0):
    meta, q, _, _, kc, vc = pat.random_case(spans, h, hkv, d, bs, dtype, DEVICE, seed=seed)
    dec = meta.decode
    out = torch.full_like(q, float("nan"))
    ref = torch.full_like(q, float("nan"))
    pat.decode(q, kc, vc, out, pat.DecodeMeta(dec.spans(), DEVICE), splits=splits)
    attention.decode_reference(q, kc, vc, ref, dec)
    return dec, out, ref


@pytest.mark.parametrize("h,hkv,d,bs", SHAPES)
@pytest.mark.parametrize("splits", [1, 3])
def test_fp32_rows_match_the_reference(h, hkv, d, bs, splits):
    dec, out, ref = run_kernel(SPANS, h, hkv, d, bs, torch.float32, splits, seed=h * d + bs)
    rows = pat.decode_rows(dec)
    torch.testing.assert_close(out[rows], ref[rows], rtol=0, atol=TOL[torch.float32])
    others = [r for r in range(out.shape[0]) if r not in set(rows)]
    assert len(others) == 5 and out[others].isnan().all()  # the prefill's rows: untouched


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("h,hkv,d,bs", SHAPES[:2])
def test_half_precision_rows_match_the_reference(h, hkv, d, bs, dtype):
    dec, out, ref = run_kernel(SPANS, h, hkv, d, bs, dtype, splits=2, seed=bs)
    rows = pat.decode_rows(dec)
    assert out.dtype == dtype
    torch.testing.assert_close(out[rows].float(), ref[rows].float(), rtol=0, atol=TOL[dtype])


def test_every_split_count_gives_the_same_rows():
    """A long context cut into 1..9 splits (some splits past shorter contexts' ends, which
    must contribute nothing) merges to the same result."""
    spans = [(300, 1), (2, 1), (150, 4)]
    dec, base, ref = run_kernel(spans, 4, 2, 16, 16, torch.float32, splits=1, seed=5)
    rows = pat.decode_rows(dec)
    for splits in (2, 4, 9):
        _, out, _ = run_kernel(spans, 4, 2, 16, 16, torch.float32, splits=splits, seed=5)
        torch.testing.assert_close(out[rows], ref[rows], rtol=0, atol=1e-5)
        torch.testing.assert_close(out[rows], base[rows], rtol=0, atol=1e-5)


def test_choose_splits_fills_the_gpu_only_where_contexts_are_long():
    assert pat.choose_splits(1, 8, 8192, programs_wanted=264) == 32  # batch 1, long: 8192 / 256
    assert pat.choose_splits(1, 8, 100, programs_wanted=264) == 1  # short: nothing to cut
    assert pat.choose_splits(64, 8, 8192, programs_wanted=264) == 1  # 512 programs already
    assert pat.choose_splits(4, 8, 8192, programs_wanted=264) == 9  # ceil(264 / 32)
    assert pat.choose_splits(1, 1, 10 ** 6, programs_wanted=10 ** 4) == pat.MAX_SPLITS
    assert pat.choose_splits(0, 8, 0, programs_wanted=264) == 1


def test_bad_tensors_get_errors_naming_them():
    case, q, _, _, kc, vc = pat.random_case([(20, 1)], 4, 2, 16, 16, torch.float32, DEVICE)
    meta = pat.DecodeMeta(case.decode.spans(), DEVICE)
    with pytest.raises(ValueError, match="v_cache torch.bfloat16"):
        pat.decode(q, kc, vc.bfloat16(), torch.empty_like(q), meta)
    with pytest.raises(ValueError, match="k_cache must be a contiguous"):
        pat.decode(q, kc[:, :1], vc, torch.empty_like(q), meta)
    with pytest.raises(ValueError, match="past the cache"):
        pat.decode(q, kc[:16], vc[:16], torch.empty_like(q), meta)
    with pytest.raises(ValueError, match="spans reach row"):
        pat.decode(q[:0], kc, vc, torch.empty_like(q[:0]), meta)


def test_the_engine_decodes_through_the_kernel_in_triton_mode(monkeypatch):
    """`paged_attention` with PDSERVE_PAGED_ATTN=triton takes the Triton path (counted) and gives
    the reference's output for a batch mixing a prefill, decodes and verification spans."""
    calls = []
    real = pat.decode
    monkeypatch.setattr(pat, "decode", lambda *a, **k: calls.append(1) or real(*a, **k))
    meta, q, k_new, v_new, kc, vc = pat.random_case(SPANS, 6, 2, 16, 8, torch.float32, DEVICE,
                                                    seed=3)
    monkeypatch.setenv("PDSERVE_PAGED_ATTN", "torch")
    ref = attention.paged_attention(q, k_new, v_new, kc, vc, meta)
    meta.decode.path = None
    monkeypatch.setenv("PDSERVE_PAGED_ATTN", "triton")
    out = attention.paged_attention(q, k_new, v_new, kc, vc, meta)
    assert meta.decode.path == "triton" and calls == [1]
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    report = attention.describe_decode_path(torch.float32, DEVICE)
    assert report["path"] == "triton" and report["triton"]


def test_a_kernel_that_fails_to_launch_falls_back_in_auto_mode(monkeypatch, caplog):
    """A GPU Triton cannot compile for: in "auto" mode the step still gets the reference's
    output, with one warning, and later steps go straight to the reference; "triton" mode
    raises instead."""
    monkeypatch.setattr(attention_cuda, "_error", None)  # restored after the test

    def broken(*_a, **_k):
        raise RuntimeError("PTX was compiled with an unsupported toolchain")

    monkeypatch.setattr(pat, "decode", broken)
    meta, q, k_new, v_new, kc, vc = pat.random_case(SPANS, 4, 2, 16, 8, torch.float32, DEVICE)
    monkeypatch.setenv("PDSERVE_PAGED_ATTN", "torch")
    ref = attention.paged_attention(q, k_new, v_new, kc, vc, meta)
    monkeypatch.setenv("PDSERVE_PAGED_ATTN", "triton")
    meta.decode.path = "triton"
    with pytest.raises(RuntimeError, match="unsupported toolchain"):
        attention.paged_attention(q, k_new, v_new, kc, vc, meta)
    monkeypatch.setenv("PDSERVE_PAGED_ATTN", "auto")
    with caplog.at_level(logging.WARNING, logger="pdserve.engine.attention_cuda"):
        out = attention.paged_attention(q, k_new, v_new, kc, vc, meta)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    assert meta.decode.path == "torch"
    assert [r for r in caplog.records if "unsupported toolchain" in r.getMessage()]
    probe = torch.zeros(1, 4, 16, device=DEVICE)
    with pytest.raises(attention_cuda.TritonUnavailable, match="unsupported toolchain"):
        attention_cuda.use_triton(probe, probe, "triton")  # remembered: never launched again
    assert "unsupported toolchain" in attention_cuda.describe(torch.float32, DEVICE, "auto")["reason"]


def test_triton_mode_says_why_it_cannot_run(monkeypatch):
    monkeypatch.setenv("PDSERVE_PAGED_ATTN", "triton")
    q = torch.zeros(1, 4, 16, dtype=torch.float64, device=DEVICE)
    with pytest.raises(ValueError, match="PDSERVE_PAGED_ATTN=triton.*float64"):
        attention.decode_path(q, q)
    assert attention.describe_decode_path(torch.float64, DEVICE)["path"] == "torch"
    monkeypatch.setattr(pat, "INTERPRETED", False)
    cpu = torch.zeros(1, 4, 16)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        attention.decode_path(cpu, cpu)
    monkeypatch.setenv("PDSERVE_PAGED_ATTN", "auto")
    assert attention.decode_path(cpu, cpu) in ("c", "torch")  # auto on CPU: never Triton


@pytest.mark.parametrize("lq,lk,h,hkv", [(7, 7, 6, 2), (5, 19, 6, 2), (1, 9, 4, 4), (16, 40, 8, 1)])
def test_cuda_prefill_sdpa_equals_the_mask_path(lq, lk, h, hkv):
    gen = torch.Generator().manual_seed(lq * lk)
    q = torch.randn(1, h, lq, 32, generator=gen).to(DEVICE)
    k = torch.randn(1, hkv, lk, 32, generator=gen).to(DEVICE)
    v = torch.randn(1, hkv, lk, 32, generator=gen).to(DEVICE)
    mask = (torch.arange(lk).unsqueeze(0) <= torch.arange(lk - lq, lk).unsqueeze(1)).to(DEVICE)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                           enable_gqa=True)
    out = attention_cuda.prefill_sdpa(q, k, v, mask)
    torch.testing.assert_close(out, ref, rtol=0, atol=2e-5)


def test_self_check_reports_each_case():
    shapes = [(4, 2, 16, 16, [(3, 1), (40, 2)])]
    report = pat.self_check(DEVICE, dtypes=(torch.float32, torch.bfloat16), shapes=shapes,
                            repeats=2)
    assert report["ok"] and report["device"] == str(DEVICE)
    assert [c["dtype"] for c in report["cases"]] == ["float32", "bfloat16"]
    assert all(0 <= c["max_abs_err"] <= c["tol"] for c in report["cases"])
    assert ("kernel_ms" in report["cases"][0]) == CUDA
    assert len(report["prefill"]) == 2 * len(pat.PREFILL_SHAPES)
    assert all(c["ok"] and c["max_abs_err"] <= c["tol"] for c in report["prefill"])


def test_self_check_on_cpu_without_the_interpreter_runs_it_in_a_child(monkeypatch):
    """A caller that imported the kernels compiled (no TRITON_INTERPRET) still gets a CPU
    check: the child process sets the variable."""
    monkeypatch.setattr(pat, "INTERPRETED", False)
    report = pat.self_check("cpu", dtypes=(torch.float32,), shapes=[(4, 2, 16, 16, [(3, 2)])])
    assert report["ok"] and report["interpreter"] is True
    assert [c["shape"]["spans"] for c in report["cases"]] == [[[3, 2]]]


@pytest.mark.skipif(not CUDA, reason="without CUDA the cases above already ran in the interpreter")
def test_the_interpreter_cases_pass_with_cuda_hidden():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                        __file__], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


def test_greedy_tokens_equal_transformers_through_the_kernel(tiny_llama_dir, monkeypatch):
    """The engine in "triton" mode (chunked prefill next to running decodes, so decode rows and
    prefill rows share steps): greedy tokens equal transformers' and every decode ran the kernel.
    On CPU the engine's tensors are CPU ones, which the interpreter runs."""
    from pdserve.engine.sampling import SamplingParams
    from pdserve.engine.tokenizer import Tokenizer
    from tests.engine.test_model_parity import PROMPTS, hf_greedy, hf_model, make_engine
    if CUDA:
        pytest.skip("the engine here runs on CPU; the device check runs parity on CUDA")
    calls = []
    real = pat.decode
    monkeypatch.setattr(pat, "decode", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setenv("PDSERVE_PAGED_ATTN", "triton")
    tok = Tokenizer.from_path(tiny_llama_dir)
    prompts = [tok.encode(p) for p in PROMPTS[:2]] + [list(range(100, 140))]
    engine = make_engine(tiny_llama_dir, max_num_batched_tokens=13)
    outs = engine.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    ref = hf_model(tiny_llama_dir)
    for p, o in zip(prompts, outs):
        assert o == hf_greedy(ref, p, 8)
    assert calls
