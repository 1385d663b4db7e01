"""The paged-attention kernel inside the engine: greedy tokens equal transformers' with it on,
`PDSERVE_PAGED_ATTN` picks the path, and without a compiler the engine falls back to the
reference with a message saying why; the library is cached by source and flags."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading

import pytest
import torch

from pdserve.engine import attention, paged_attn_cpu
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.tokenizer import Tokenizer
from tests.engine.test_model_parity import PROMPTS, hf_greedy, hf_model, make_engine

needs_cc = pytest.mark.skipif(not paged_attn_cpu.available(),
                              reason="paged attention C kernel: no C compiler")


def count_kernel_calls(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = paged_attn_cpu.decode
    monkeypatch.setattr(paged_attn_cpu, "decode",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


@needs_cc
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_greedy_tokens_equal_transformers_with_the_kernel(kind, tiny_model_factory, monkeypatch):
    monkeypatch.setenv("PDSERVE_PAGED_ATTN", "c")
    calls = count_kernel_calls(monkeypatch)
    path = tiny_model_factory(kind)
    engine = make_engine(path, max_num_batched_tokens=13)  # chunked prefill next to decodes
    tok = Tokenizer.from_path(path)
    prompts = [tok.encode(p) for p in PROMPTS] + [list(range(100, 100 + 150))]
    outs = engine.generate(prompts, SamplingParams(max_tokens=40, ignore_eos=True))
    ref = hf_model(path)
    for p, o in zip(prompts, outs):
        assert o == hf_greedy(ref, p, 40)
    assert calls  # the decodes ran the kernel


@needs_cc
def test_torch_mode_never_calls_the_kernel(tiny_llama_dir, monkeypatch):
    calls = count_kernel_calls(monkeypatch)
    ids = Tokenizer.from_path(tiny_llama_dir).encode(PROMPTS[0])
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    monkeypatch.setenv("PDSERVE_PAGED_ATTN", "torch")
    ref = make_engine(tiny_llama_dir).generate([ids], params)
    assert calls == []
    monkeypatch.setenv("PDSERVE_PAGED_ATTN", "auto")
    assert make_engine(tiny_llama_dir).generate([ids], params) == ref
    assert calls


def test_a_bad_mode_names_the_variable(monkeypatch):
    monkeypatch.setenv("PDSERVE_PAGED_ATTN", "cuda")
    with pytest.raises(ValueError, match="PDSERVE_PAGED_ATTN must be one of auto, c, torch"):
        attention.PagedKVCache(1, 2, 16, 2, 16, torch.float32, torch.device("cpu"))


def test_fp16_takes_the_reference():
    q = torch.zeros(1, 4, 16, dtype=torch.float16)
    assert not paged_attn_cpu.supports(q, torch.zeros(16, 2, 16, dtype=torch.float16))
    assert not attention.use_kernel(q, torch.zeros(16, 2, 16, dtype=torch.float16))


def test_without_a_compiler_auto_falls_back_and_says_why(tiny_llama_dir, monkeypatch, caplog):
    monkeypatch.setenv("CC", "/nonexistent/no-such-cc")
    monkeypatch.setattr(paged_attn_cpu, "_lib", None)
    monkeypatch.setattr(paged_attn_cpu, "_error", None)
    monkeypatch.setattr(attention, "_warned", False)
    assert not paged_attn_cpu.available()
    with pytest.raises(paged_attn_cpu.KernelUnavailable, match="no-such-cc.*not found"):
        paged_attn_cpu.load()
    ids = Tokenizer.from_path(tiny_llama_dir).encode(PROMPTS[2])
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    with caplog.at_level(logging.WARNING, logger="pdserve.engine.attention"):
        out = make_engine(tiny_llama_dir).generate([ids], params)
    assert [r.message for r in caplog.records if "no-such-cc" in r.message]
    assert out[0] == hf_greedy(hf_model(tiny_llama_dir), ids, 10)
    monkeypatch.setenv("PDSERVE_PAGED_ATTN", "c")
    with pytest.raises(paged_attn_cpu.KernelUnavailable, match="not found"):
        make_engine(tiny_llama_dir)


@needs_cc
def test_build_is_cached_by_source_and_atomic(monkeypatch, tmp_path):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    source = paged_attn_cpu.SOURCE
    path = paged_attn_cpu.library_path()
    assert path.parent == tmp_path / "paged_attn" and not path.exists()
    assert paged_attn_cpu.library_path(paged_attn_cpu.FLAG_SETS[1]) != path  # flags count
    edited = tmp_path / "paged_attn_c.c"  # an edit to the source gets a library of its own
    edited.write_text(paged_attn_cpu.SOURCE.read_text() + "\n/* edited */\n")
    monkeypatch.setattr(paged_attn_cpu, "SOURCE", edited)
    assert paged_attn_cpu.library_path() != path
    monkeypatch.setattr(paged_attn_cpu, "SOURCE", source)
    # Two builders at once: each compiles to a temp name and os.replace()s it, so the library
    # is whole whichever lands last, and no temp file is left.
    errors = []
    flags = paged_attn_cpu.FLAG_SETS[0]
    builders = [threading.Thread(target=lambda: errors.append(paged_attn_cpu._build(path, flags)))
                for _ in range(2)]
    for t in builders:
        t.start()
    for t in builders:
        t.join()
    assert errors == [None, None] and sorted(os.listdir(path.parent)) == [path.name]
    probe = "import ctypes, sys; sys.exit(ctypes.CDLL(sys.argv[1]).pa_abi() != %d)" % paged_attn_cpu.ABI
    assert subprocess.run([sys.executable, "-c", probe, str(path)]).returncode == 0


@needs_cc
def test_kernel_reports_what_it_runs():
    info = paged_attn_cpu.info()
    assert info["isa"] in ("baseline", "avx2", "avx512") and isinstance(info["openmp"], bool)


@needs_cc
def test_a_compiler_without_openmp_gets_the_single_threaded_build(monkeypatch, tmp_path):
    """The OpenMP build failing (here: a flag the compiler refuses) falls back to the build
    without it, which gives the same results on one thread."""
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(paged_attn_cpu, "_lib", None)
    monkeypatch.setattr(paged_attn_cpu, "_error", None)
    monkeypatch.setattr(paged_attn_cpu, "FLAG_SETS",
                        (paged_attn_cpu.BASE_FLAGS + ("--no-such-flag",), paged_attn_cpu.FLAG_SETS[1]))
    assert paged_attn_cpu.info()["openmp"] is False
    from tests.engine.test_paged_attn import kernel, make_case, reference
    case = make_case([(40, 1), (70, 3)], 9, 3, 64, 16, seed=11)
    meta, q, _, _, kc, vc = case
    torch.testing.assert_close(kernel(meta, q, kc, vc, threads=2), reference(*case, monkeypatch),
                               rtol=0, atol=1e-5)
