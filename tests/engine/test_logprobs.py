"""Logprobs in the engine: the sampled token's log-probability and the top-k alternatives, from
the raw logits; asking for them never changes the tokens (invariant 1)."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.sampling import (InvalidArgumentError, SamplingParams, sample,
                                     token_logprobs)
from pdserve.engine.tokenizer import Tokenizer
from tests.engine.test_model_parity import hf_model, make_engine


def test_token_logprobs_from_raw_logits():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 5.0, 1.0], [1.0, 2.0, 3.0, 4.0]])
    params = [SamplingParams(), SamplingParams(temperature=0.5, seed=3), SamplingParams()]
    tokens = sample(logits, params, [0, 0, 0])
    out = token_logprobs(logits, tokens, [2, 0, None])
    ref = torch.log_softmax(logits, dim=-1)
    assert out[2] is None
    assert out[0].token_id == 0 and out[0].logprob == pytest.approx(ref[0, 0].item())
    assert [t for t, _ in out[0].top] == [0, 1]  # best first
    assert out[0].top[0][1] == out[0].logprob  # greedy: chosen == top-1, the very same value
    # Temperature does not change the reported logprob: it is the model's, not the sampler's.
    assert out[1].logprob == pytest.approx(ref[1, tokens[1]].item()) and out[1].top == []


@pytest.mark.parametrize("bad", [-1, 21, 2.0, True])
def test_logprobs_out_of_range_names_the_field(bad):
    with pytest.raises(InvalidArgumentError) as err:
        SamplingParams(logprobs=bad).validate()
    assert err.value.field == "logprobs"


def test_engine_logprobs_keep_greedy_tokens_and_match_transformers(tiny_llama_dir):
    tok = Tokenizer.from_path(tiny_llama_dir)
    prompt = tok.encode("The quick brown fox jumps over the lazy dog because")
    engine = make_engine(tiny_llama_dir)
    plain = engine.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    rid = engine.add_request(None, prompt, SamplingParams(max_tokens=12, ignore_eos=True,
                                                          logprobs=5))
    ids, lps = [], []
    while engine.has_work():
        for o in engine.step():
            assert o.request_id == rid and len(o.logprobs) == len(o.new_token_ids)
            ids += o.new_token_ids
            lps += o.logprobs
    assert ids == plain
    with torch.inference_mode():
        logits = hf_model(tiny_llama_dir)(torch.tensor([prompt + ids])).logits[0].float()
    ref = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
    for i, lp in enumerate(lps):
        assert lp.token_id == ids[i] and len(lp.top) == 5 and lp.top[0][1] == lp.logprob
        assert abs(lp.logprob - ref[i, ids[i]].item()) < 1e-4
        assert max(abs(v - r) for (_, v), r in zip(lp.top, torch.topk(ref[i], 5).values)) < 1e-4


def _run(engine, prompt, params):
    rid = engine.add_request(None, prompt, params)
    outs = []
    while engine.has_work():
        outs += [o for o in engine.step() if o.request_id == rid]
    return outs


@pytest.mark.parametrize("chunk", [0, 16], ids=["one-step", "chunked-prefill"])
def test_prompt_logprobs_match_transformers_even_with_the_prefix_cached(tiny_llama_dir, chunk):
    tok = Tokenizer.from_path(tiny_llama_dir)
    prompt = tok.encode("The quick brown fox jumps over the lazy dog because it was " * 4)
    assert len(prompt) > 40  # spans several blocks, and (chunked) several steps
    engine = make_engine(tiny_llama_dir, **({"max_num_batched_tokens": chunk} if chunk else {}))
    plain = _run(engine, prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    assert plain[0].prompt_logprobs is None  # not asked: none made
    # The prompt's blocks are cached now; asking for prompt logprobs computes it whole anyway.
    outs = _run(engine, prompt, SamplingParams(max_tokens=4, ignore_eos=True,
                                               prompt_logprobs=3))
    assert [t for o in outs for t in o.new_token_ids] == [t for o in plain
                                                          for t in o.new_token_ids]
    assert outs[0].num_cached_tokens == 0
    lps = outs[0].prompt_logprobs
    assert all(o.prompt_logprobs is None for o in outs[1:])
    assert [lp.token_id for lp in lps] == prompt[1:]
    with torch.inference_mode():
        logits = hf_model(tiny_llama_dir)(torch.tensor([prompt])).logits[0].float()
    ref = torch.log_softmax(logits[:-1], dim=-1)
    for i, lp in enumerate(lps):
        assert abs(lp.logprob - ref[i, prompt[i + 1]].item()) < 1e-4
        assert [t for t, _ in lp.top] == torch.topk(ref[i], 3).indices.tolist()
        assert max(abs(v - r) for (_, v), r in zip(lp.top, torch.topk(ref[i], 3).values)) < 1e-4


@pytest.mark.parametrize("bad", [-1, 21, 1.5])
def test_prompt_logprobs_out_of_range_names_the_field(bad):
    with pytest.raises(InvalidArgumentError) as err:
        SamplingParams(prompt_logprobs=bad).validate()
    assert err.value.field == "prompt_logprobs"
