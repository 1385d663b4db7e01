"""The logits controls a request sends (repetition, frequency and presence penalties, logit
bias, min-tokens, min-p), against references, on every path a token can be sampled on.

The references are transformers' own processors (`RepetitionPenaltyLogitsProcessor` over the
prompt and the output, `SequenceBiasLogitsProcessor` with one-token biases,
`MinNewTokensLengthLogitsProcessor`, `MinPLogitsWarper` after `TemperatureLogitsWarper`), and for
the penalties transformers lacks (vLLM's: frequency times a token's count in the output,
presence once, the prompt not counted) a plain loop written here. They are applied in vLLM's
order: min-tokens, bias, repetition, frequency and presence.

First on random logits (`logits_process.apply`, `sampling.probs_from_logits`), then through the
engine: its greedy output on a tiny Llama (one whose greedy output repeats, so that the
penalties bite) equals transformers' model on the same checkpoint
stepped token by token with the same processors. Then the paths: a request handed over after
prefill (its first token sampled by a prefill-only engine), resumed after a dead worker's
tokens, or decoded on anchor-precision KV first (progressive transfer) gives exactly the
single-engine tokens, with the controls and with a structured output, greedy and seeded: a
penalty counts every output token wherever it was sampled.
"""

from __future__ import annotations

import random
import re
from dataclasses import replace

import pytest
import torch

from pdserve.core.structured import StructuredOutput
from pdserve.engine.engine import LLMEngine, StepOutput
from pdserve.engine.logits_process import Row, apply
from pdserve.engine.sampling import SamplingParams, probs_from_logits
from pdserve.engine.tokenizer import Tokenizer

from tests.engine.test_engine import assert_all_free, make_engine, make_prompts, run

pytestmark = pytest.mark.usefixtures("one_torch_thread")

EOS = 2  # the tiny models' end of sequence


# ---- the references ----------------------------------------------------------------------------
def penalties_reference(scores: torch.Tensor, output_ids, p: SamplingParams) -> torch.Tensor:
    """vLLM's frequency and presence penalties, one token at a time: output tokens only."""
    counts: dict[int, int] = {}
    for t in output_ids:
        counts[t] = counts.get(t, 0) + 1
    out = scores.clone()
    for t, c in counts.items():
        out[..., t] -= p.frequency_penalty * c + p.presence_penalty
    return out


def reference(scores: torch.Tensor, prompt_ids, output_ids, p: SamplingParams,
              stop_ids) -> torch.Tensor:
    """scores [1, V] after the request's controls, with transformers' processors."""
    from transformers import (MinNewTokensLengthLogitsProcessor,
                              RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor)

    ids = torch.tensor([list(prompt_ids) + list(output_ids)], dtype=torch.long)
    scores = scores.clone()
    if p.min_tokens and stop_ids:
        banned = MinNewTokensLengthLogitsProcessor(len(prompt_ids), p.min_tokens,
                                                   list(stop_ids))(ids, scores)
        if not torch.isneginf(banned).all():  # a complete grammar's end of sequence stays
            scores = banned
    if p.logit_bias:
        scores = SequenceBiasLogitsProcessor([[[t], b] for t, b in p.logit_bias])(ids, scores)
    if p.repetition_penalty != 1.0:
        scores = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, scores)
    if p.frequency_penalty or p.presence_penalty:
        scores = penalties_reference(scores, output_ids, p)
    return scores


# ---- on random logits ----------------------------------------------------------------------------
V = 64


def random_params(rng: random.Random) -> SamplingParams:
    kw = {}
    if rng.random() < 0.6:
        kw["repetition_penalty"] = rng.choice([0.7, 1.0, 1.3, 2.0])
    if rng.random() < 0.6:
        kw["frequency_penalty"] = rng.uniform(-2, 2)
    if rng.random() < 0.6:
        kw["presence_penalty"] = rng.uniform(-2, 2)
    if rng.random() < 0.5:
        toks = rng.sample(range(V), rng.randrange(1, 6))
        kw["logit_bias"] = tuple((t, rng.uniform(-100, 100)) for t in toks)
    if rng.random() < 0.4:
        kw["min_tokens"] = rng.randrange(0, 6)
    return SamplingParams(max_tokens=16, **kw)


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                         reason="needs CUDA"))])
def test_apply_equals_the_references_row_by_row(device):
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    for trial in range(24):
        n = rng.randrange(1, 9)
        logits = torch.randn(n, V, generator=gen) * 3
        if trial % 3 == 0:  # a grammar's mask got there first
            logits[torch.rand(n, V, generator=gen) < 0.3] = float("-inf")
        rows: list[Row | None] = []
        for j in range(n):
            if rng.random() < 0.15:
                rows.append(None)
                continue
            prompt = [rng.randrange(V) for _ in range(rng.randrange(1, 12))]
            out = [rng.randrange(V) for _ in range(rng.randrange(0, 10))]
            stops = rng.sample(range(V), rng.randrange(0, 3))
            params = random_params(rng)
            if trial % 4 == 1 and j == 0 and stops:  # a complete grammar: only the stops left
                logits[j] = float("-inf")
                logits[j, stops] = 1.0
                params = replace(params, min_tokens=len(out) + 1)
            rows.append(Row(params, prompt, out, stops))
        got = apply(logits.clone().to(device), rows).cpu()
        for i, r in enumerate(rows):
            if r is None or not r.params.processed:
                assert torch.equal(got[i], logits[i]), (trial, i)
                continue
            want = reference(logits[i:i + 1], r.prompt_ids, r.output_ids, r.params, r.stop_ids)[0]
            assert torch.equal(torch.isneginf(got[i]), torch.isneginf(want)), (trial, i)
            fin = torch.isfinite(want)
            torch.testing.assert_close(got[i][fin], want[fin], rtol=1e-6, atol=1e-5)
            # Batched, a row is processed as it would be alone.
            assert torch.equal(apply(logits[i:i + 1].clone(), [r])[0], got[i])


@pytest.mark.parametrize("params", [
    SamplingParams(repetition_penalty=2.0), SamplingParams(frequency_penalty=1.0),
    SamplingParams(presence_penalty=1.0)], ids=["repetition", "frequency", "presence"])
def test_which_tokens_each_penalty_counts(params):
    prompt, out = [1, 2, 2], [3, 3, 3, 4]
    logits = torch.full((1, 8), 2.0)
    got = apply(logits.clone(), [Row(params, prompt, out)])[0].tolist()
    if params.repetition_penalty != 1.0:  # the prompt and the output, once each
        assert got == [2.0, 1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0]
    elif params.frequency_penalty:  # the output only, per occurrence
        assert got == [2.0, 2.0, 2.0, -1.0, 1.0, 2.0, 2.0, 2.0]
    else:  # the output only, once
        assert got == [2.0, 2.0, 2.0, 1.0, 1.0, 2.0, 2.0, 2.0]
    # A negative logit is multiplied by the repetition penalty, made more negative.
    neg = apply(torch.full((1, 8), -2.0), [Row(SamplingParams(repetition_penalty=1.5), [5], [])])
    assert neg[0, 5].item() == -3.0 and neg[0, 4].item() == -2.0


def test_min_tokens_bans_stop_tokens_until_reached_but_yields_to_a_complete_grammar():
    p = SamplingParams(min_tokens=3, stop_token_ids=(5,))
    logits = torch.zeros(3, 8)
    logits[2] = float("-inf")
    logits[2, EOS] = 0.5  # a grammar that is complete allows only the end of sequence
    rows = [Row(p, [1], [7, 7], (EOS, 5)), Row(p, [1], [7, 7, 7], (EOS, 5)),
            Row(p, [1], [7], (EOS, 5))]
    got = apply(logits.clone(), rows)
    assert torch.isneginf(got[0, [EOS, 5]]).all() and torch.isfinite(got[0, :EOS]).all()
    assert torch.isfinite(got[1]).all()  # three output tokens: nothing banned
    assert got[2, EOS].item() == 0.5 and torch.isneginf(got[2]).sum() == 7  # not all -inf
    # Sampled too, such a row gives the end of sequence, never a NaN distribution.
    probs = probs_from_logits(got[2], SamplingParams(temperature=1.0, top_p=0.9, min_p=0.1))
    assert probs[EOS].item() == 1.0


@pytest.mark.parametrize("temperature, min_p", [(1.0, 0.05), (0.5, 0.2), (1.7, 0.6), (0.2, 1.0)])
def test_min_p_equals_transformers_after_temperature(temperature, min_p):
    from transformers import MinPLogitsWarper, TemperatureLogitsWarper

    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 500, generator=gen) * 2
    logits[0, 7] = float("-inf")
    ids = torch.zeros(1, 1, dtype=torch.long)
    p = SamplingParams(temperature=temperature, min_p=min_p, seed=1)
    for row in logits:
        scaled = TemperatureLogitsWarper(temperature)(ids, row[None].clone())
        want = torch.softmax(MinPLogitsWarper(min_p)(ids, scaled), dim=-1)[0]
        got = probs_from_logits(row, p)
        assert torch.equal(got == 0, want == 0)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
        assert 0 < int((got > 0).sum()) < row.numel()  # it keeps some, and drops some


# ---- through the engine: transformers stepped token by token -----------------------------------
PROMPT = make_prompts([9], seed=11)[0] + make_prompts([4], seed=12)[0] * 3  # repeats inside
N_OUT = 16


@pytest.fixture(scope="module")
def hf_tiny(repeaty_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(repeaty_llama_dir, dtype=torch.float32).eval()


def hf_controlled_greedy(model, prompt: list[int], p: SamplingParams) -> list[int]:
    """transformers' model, one full forward per token, the references applied, argmax."""
    stops = ([] if p.ignore_eos else [EOS]) + list(p.stop_token_ids)
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(p.max_tokens):
            scores = model(torch.tensor([prompt + out])).logits[:, -1].float()
            scores = reference(scores, prompt, out, p, stops)
            out.append(int(scores.argmax()))
            if out[-1] in stops:
                break
    return out


@pytest.fixture(scope="module")
def plain(repeaty_llama_dir) -> list[int]:
    return make_engine(repeaty_llama_dir).generate(
        [PROMPT], SamplingParams(max_tokens=N_OUT, ignore_eos=True))[0]


def control_cases(plain: list[int]) -> dict[str, SamplingParams]:
    base = SamplingParams(max_tokens=N_OUT, ignore_eos=True)
    return {
        "repetition": replace(base, repetition_penalty=1.3),
        "repetition-below-1": replace(base, repetition_penalty=0.8),
        "frequency": replace(base, frequency_penalty=0.3),
        "presence": replace(base, presence_penalty=0.5),
        "negative-penalties": replace(base, frequency_penalty=-0.3, presence_penalty=-0.2),
        "logit-bias": replace(base, logit_bias=((plain[1], -100.0), (plain[-1], 0.4),
                                                (4321, 1.0))),
        # The end of sequence and a stop token are the likeliest tokens, but not before 5.
        "min-tokens": replace(base, ignore_eos=False, min_tokens=5, stop_token_ids=(777,),
                              logit_bias=((EOS, 10.0), (777, 9.9))),
        "all": replace(base, repetition_penalty=1.2, frequency_penalty=0.2,
                       presence_penalty=0.1, logit_bias=((plain[2], 0.3),), min_tokens=3),
    }


def test_greedy_engine_output_with_controls_equals_transformers(repeaty_llama_dir, hf_tiny, plain):
    cases = control_cases(plain)
    engine = make_engine(repeaty_llama_dir)
    rids = {name: engine.add_request(name, PROMPT, p) for name, p in cases.items()}
    engine.add_request("plain", PROMPT, SamplingParams(max_tokens=N_OUT, ignore_eos=True))
    outs = run(engine)  # every control in one batch, next to a request with none
    assert outs["plain"] == plain
    for name, p in cases.items():
        want = hf_controlled_greedy(hf_tiny, PROMPT, p)
        assert outs[rids[name]] == want, name
        assert want != plain, f"{name}: the control changes nothing here"
    assert len(outs["min-tokens"]) == 6 and outs["min-tokens"][-1] in (EOS, 777)
    assert_all_free(engine)


def test_sampled_tokens_stay_inside_min_p(repeaty_llama_dir, hf_tiny):
    p = SamplingParams(temperature=1.0, min_p=0.3, seed=3, max_tokens=N_OUT, ignore_eos=True)
    engine = make_engine(repeaty_llama_dir)
    out = engine.generate([PROMPT], p)[0]
    wide = engine.generate([PROMPT], replace(p, min_p=0.0))[0]
    assert out != wide  # the same seed draws outside min_p's set without it
    with torch.inference_mode():
        logits = hf_tiny(torch.tensor([PROMPT + out])).logits[0, len(PROMPT) - 1:-1].float()
    probs = torch.softmax(logits / p.temperature, dim=-1)
    for j, t in enumerate(out):
        assert probs[j, t] >= p.min_p * probs[j].max() * (1 - 1e-4), j


# ---- every path a token is sampled on ---------------------------------------------------------------
N_PATH = 32
PENALTIES = SamplingParams(max_tokens=N_PATH, repetition_penalty=1.3, frequency_penalty=0.3,
                           presence_penalty=0.2, logit_bias=((4321, 0.5),), min_tokens=2)
# An answer, then two to five short lower-case words and a full stop: each structured case
# here ends (its grammar complete, then the end of sequence) before max_tokens.
WORDS = StructuredOutput("regex", r"(yes|no), [a-z]{1,6}( [a-z]{1,6}){1,4}\.")
SEEDED = dict(temperature=0.1, top_p=0.95, seed=4242)
PATH_CASES = {
    "penalties-greedy": PENALTIES,
    "penalties-seeded": replace(PENALTIES, **SEEDED),
    "structured-greedy": SamplingParams(max_tokens=N_PATH, structured_output=WORDS),
    "both-greedy": replace(PENALTIES, structured_output=WORDS),
    "both-seeded": replace(PENALTIES, structured_output=WORDS, **SEEDED),
}


@pytest.fixture(scope="module")
def single(repeaty_llama_dir):
    """The reference: each case run alone in one engine; (tokens, finish reason)."""
    engine = make_engine(repeaty_llama_dir)
    want = {}
    for name, p in PATH_CASES.items():
        engine.add_request(name, PROMPT, p)
        log: list[StepOutput] = []
        out = run(engine, log=log)
        want[name] = (out[name], log[-1].finish_reason)
    return want


def test_the_path_cases_are_shaped_by_their_controls(repeaty_llama_dir, single):
    """Otherwise the path tests below would prove nothing."""
    engine = make_engine(repeaty_llama_dir)
    for name, p in PATH_CASES.items():
        bare = replace(p, repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0,
                       logit_bias=(), min_tokens=0, structured_output=None)
        assert engine.generate([PROMPT], bare)[0] != single[name][0], name
    # A structured case ends where its grammar does: lower-case words and a full stop.
    assert single["both-greedy"] != single["structured-greedy"]  # penalties inside a grammar
    tok = Tokenizer.from_path(repeaty_llama_dir)
    for name in ("structured-greedy", "both-greedy", "both-seeded"):
        out, reason = single[name]
        assert reason == "stop" and out[-1] == EOS, name
        assert re.fullmatch(WORDS.spec, tok.decode(out[:-1])), name


def prefill_only(engine: LLMEngine, rid: str, p: SamplingParams):
    engine.add_request(rid, PROMPT, p, prefill_only=True)
    log: list[StepOutput] = []
    run(engine, log=log)
    (o,) = [o for o in log if o.request_id == rid]
    assert o.prefill_done
    return o.new_token_ids[0], engine.take_parked_kv(rid)


@pytest.fixture(scope="module")
def pd_engines(repeaty_llama_dir):
    return make_engine(repeaty_llama_dir, max_num_batched_tokens=5), make_engine(repeaty_llama_dir)


@pytest.mark.parametrize("name", list(PATH_CASES))
def test_handed_over_after_prefill_gives_the_single_engine_tokens(pd_engines, single, name):
    a, b = pd_engines
    p = PATH_CASES[name]
    want, reason = single[name]
    first, kv = prefill_only(a, name, p)
    assert first == want[0]
    assert b.add_prefilled_request(name, PROMPT, first, p,
                                   list(zip(kv.block_hashes, kv.blocks))) is None
    log: list[StepOutput] = []
    out = run(b, log=log)
    assert [first] + out[name] == want
    assert log[-1].finish_reason == reason
    assert_all_free(a)
    assert_all_free(b)


@pytest.fixture(scope="module")
def resume_engine(repeaty_llama_dir):
    return make_engine(repeaty_llama_dir, max_num_batched_tokens=6)


@pytest.mark.parametrize("name", list(PATH_CASES))
def test_resumed_gives_the_single_engine_tokens(resume_engine, single, name):
    p = PATH_CASES[name]
    want, reason = single[name]
    cuts = sorted({1, 2, len(want) // 2, len(want) - 2})
    for cut in cuts:  # every resume point at once, in one batch
        resume_engine.add_request(f"{name}@{cut}", PROMPT, p, resume_token_ids=want[:cut])
    log: list[StepOutput] = []
    out = run(resume_engine, log=log)
    for cut in cuts:
        rid = f"{name}@{cut}"
        assert out.get(rid, []) == want[cut:], cut
        assert [o.finish_reason for o in log if o.request_id == rid and o.finished] == [reason]
    assert_all_free(resume_engine)


@pytest.mark.parametrize("names", [["penalties-greedy", "both-seeded"],
                                   ["both-greedy", "penalties-seeded", "structured-greedy"]])
def test_drafted_on_anchor_kv_then_verified_gives_the_single_engine_tokens(repeaty_llama_dir,
                                                                          single, names):
    """Progressive KV: tokens decoded on the anchor before the exact KV lands are drafts; the
    controls and the grammar see them as such and the verified output is the exact one."""
    from tests.engine.test_progressive import anchor_of, decode, prefill
    from tests.engine.test_progressive import make_engine as progressive_engine

    prompts = [PROMPT] * len(names)
    params = [PATH_CASES[n] for n in names]
    handed = prefill(repeaty_llama_dir, prompts, params)
    engine = progressive_engine(repeaty_llama_dir)
    got, early = decode(engine, prompts, params, handed, approx=anchor_of, steps_before_exact=5)
    assert not early
    assert got == [single[n][0] for n in names]
    assert engine.stats()["anchor_num_draft_tokens"] > 0


def test_controls_and_structured_output_in_one_batch_with_others(repeaty_llama_dir, single):
    """Every case at once, with chunked prefill next to decodes: each keeps its tokens."""
    engine = make_engine(repeaty_llama_dir, max_num_batched_tokens=7)
    for name, p in PATH_CASES.items():
        engine.add_request(name, PROMPT, p)
    engine.add_request("plain", PROMPT, SamplingParams(max_tokens=N_PATH, ignore_eos=True))
    out = run(engine)
    for name in PATH_CASES:
        assert out[name] == single[name][0], name
    assert_all_free(engine)
