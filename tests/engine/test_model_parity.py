"""Invariant 1 at the engine level: our model equals Hugging Face transformers on the same weights.

Logits of one forward agree to 1e-4 relative in fp32, and greedy generation gives the same tokens,
for every supported architecture (tiny random checkpoints) and for the real default model (GGUF).
"""

from __future__ import annotations

import os

import pytest
import torch

from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.tokenizer import Tokenizer

PROMPTS = [
    "The quick brown fox jumps over the lazy dog because",
    "def fibonacci(n):\n    ",
    "In 1969, the first humans landed on",
]


def hf_model(path: str):
    from transformers import AutoModelForCausalLM

    if path.endswith(".gguf"):
        m = AutoModelForCausalLM.from_pretrained(os.path.dirname(path),
                                                 gguf_file=os.path.basename(path),
                                                 torch_dtype=torch.float32)
    else:
        m = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    return m.eval()


def make_engine(path: str, **sched) -> LLMEngine:
    return LLMEngine(EngineConfig(path, cache=CacheConfig(block_size_tokens=16, num_blocks=256),
                                  scheduler=SchedulerConfig(**sched)))


def hf_greedy(model, prompt_ids: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids),
                             dtype=torch.long), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def engine_logits(engine: LLMEngine, ids: list[int]) -> torch.Tensor:
    """Logits at every position of a single prefill, through the paged cache."""
    return engine.prompt_logits(ids)


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    err = (ours - ref).abs().max().item()
    scale = ref.abs().max().item()
    assert err <= 1e-4 * scale, f"max abs error {err:.3e} vs logit scale {scale:.3e}"


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "llama3"])
def test_tiny_architectures_match_transformers(kind, tiny_model_factory):
    path = tiny_model_factory(kind)
    ref = hf_model(path)
    engine = make_engine(path, max_num_batched_tokens=13)  # forces chunked prefill
    tok = Tokenizer.from_path(path)
    prompts = [tok.encode(p) for p in PROMPTS]
    # A prompt longer than the llama3 scaling's original context exercises the scaled band.
    prompts.append(list(range(100, 100 + 150)))
    with torch.inference_mode():
        ref_logits = ref(torch.tensor([prompts[0]])).logits[0].float()
    assert_logits_close(engine_logits(engine, prompts[0]), ref_logits)
    outs = engine.generate(prompts, SamplingParams(max_tokens=64, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o == hf_greedy(ref, p, 64)


def test_tied_embeddings_match_transformers(tiny_model_factory):
    path = tiny_model_factory("llama", tie_word_embeddings=True)
    ref = hf_model(path)
    engine = make_engine(path)
    ids = Tokenizer.from_path(path).encode(PROMPTS[0])
    with torch.inference_mode():
        ref_logits = ref(torch.tensor([ids])).logits[0].float()
    assert_logits_close(engine_logits(engine, ids), ref_logits)


@pytest.fixture(scope="module")
def smollm2_engine(smollm2_gguf_path):
    return make_engine(smollm2_gguf_path, max_num_batched_tokens=512)


def test_smollm2_gguf_logits_match_transformers(smollm2_engine, smollm2_hf_model,
                                                smollm2_gguf_path):
    ids = Tokenizer.from_path(smollm2_gguf_path).encode(PROMPTS[0])
    with torch.inference_mode():
        ref_logits = smollm2_hf_model(torch.tensor([ids])).logits[0].float()
    assert_logits_close(engine_logits(smollm2_engine, ids), ref_logits)


def test_smollm2_gguf_greedy_matches_transformers(smollm2_engine, smollm2_oracle):
    prompts = [p for p, _ in smollm2_oracle]
    outs = smollm2_engine.generate(prompts, SamplingParams(max_tokens=64, ignore_eos=True))
    assert outs == [ref for _, ref in smollm2_oracle]


def test_bfloat16_runs_close_to_the_fp32_reference(tiny_llama_dir):
    """bf16 is a supported run dtype: logits stay within bf16 rounding of the fp32 model's."""
    ref = hf_model(tiny_llama_dir)
    engine = LLMEngine(EngineConfig(tiny_llama_dir, dtype="bfloat16",
                                    cache=CacheConfig(block_size_tokens=16, num_blocks=64)))
    assert engine.kv.k.dtype == torch.bfloat16
    ids = Tokenizer.from_path(tiny_llama_dir).encode(PROMPTS[0])
    with torch.inference_mode():
        ref_logits = ref(torch.tensor([ids])).logits[0].float()
    ours = engine_logits(engine, ids)
    rel = ((ours - ref_logits).norm() / ref_logits.norm()).item()
    assert rel < 3e-2, rel
    out = engine.generate([ids], SamplingParams(max_tokens=16, ignore_eos=True))[0]
    assert len(out) == 16


@pytest.mark.parametrize("path", ["reference", "onednn", "c"])
def test_every_linear_path_matches_transformers_too(tiny_llama_dir, monkeypatch, path):
    """Each way of multiplying the weights (PDSERVE_LINEAR): plain F.linear (the path GPUs
    take), oneDNN's packed weights, the C kernel; each exact against transformers."""
    from pdserve.engine import linear_cpu

    if path == "c" and not linear_cpu.available():
        pytest.skip(f"no C linear kernel: {linear_cpu.unavailable_reason()}")
    monkeypatch.setenv("PDSERVE_LINEAR", path)
    engine = make_engine(tiny_llama_dir)
    from pdserve.engine.linear import packing_available

    onednn = packing_available(torch.float32, torch.device("cpu"))
    want = {"reference": "plain", "c": "c", "onednn": "onednn" if onednn else "plain"}[path]
    assert engine.model.lm_head.kind == want
    ref = hf_model(tiny_llama_dir)
    ids = Tokenizer.from_path(tiny_llama_dir).encode(PROMPTS[1])
    with torch.inference_mode():
        ref_logits = ref(torch.tensor([ids])).logits[0].float()
    assert_logits_close(engine_logits(engine, ids), ref_logits)
    out = engine.generate([ids], SamplingParams(max_tokens=32, ignore_eos=True))[0]
    assert out == hf_greedy(ref, ids, 32)
