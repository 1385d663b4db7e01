"""LLMEngine end to end on a tiny random Llama: batching, chunking, preemption, prefix caching,
abort, the prefill -> decode hand-over, stop rules, validation and seeded sampling.

The reference for every comparison is the same engine running one request alone with a big
budget and a big pool: scheduling choices (budget, block size, batch mates, preemption, cache
hits, where the prompt was prefilled) must never change a token.
"""

from __future__ import annotations

import random
from dataclasses import fields, replace

import pytest
import torch

from pdserve.core.block_hash import prompt_block_hashes
from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.engine import LLMEngine, StepOutput
from pdserve.engine.loader import load_checkpoint
from pdserve.engine.sampling import InvalidArgumentError, SamplingParams
from pdserve.engine.scheduler import QueueFullError

from tests.conftest import SMOLLM2_VOCAB_SIZE

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=8, ignore_eos=True)


def make_engine(path: str, **overrides) -> LLMEngine:
    """An engine on `path`; overrides name a CacheConfig, SchedulerConfig or EngineConfig field.
    Defaults: 4-token blocks, 256 blocks, budget 2048."""
    groups = {}
    for cls in (CacheConfig, SchedulerConfig):
        names = {f.name for f in fields(cls)}
        groups[cls] = {k: overrides.pop(k) for k in list(overrides) if k in names}
    cache = {"block_size_tokens": 4, "num_blocks": 256, **groups[CacheConfig]}
    cfg = EngineConfig(path, cache=CacheConfig(**cache),
                       scheduler=SchedulerConfig(**groups[SchedulerConfig]), **overrides)
    return LLMEngine(cfg)


def make_prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, SMOLLM2_VOCAB_SIZE) for _ in range(n)] for n in lengths]


def run(engine: LLMEngine, outs: dict[str, list[int]] | None = None,
        log: list[StepOutput] | None = None) -> dict[str, list[int]]:
    """Step until idle; collect each request's new tokens (and every StepOutput if asked)."""
    outs = {} if outs is None else outs
    while engine.has_work():
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
            if log is not None:
                log.append(o)
    return outs


PROMPTS = make_prompts([5, 13, 1, 22, 9, 16])


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    """reference(prompt, params) -> output of that request alone in a roomy engine (memoised)."""
    memo: dict[tuple, list[int]] = {}

    def ref(prompt: list[int], params: SamplingParams = GREEDY) -> list[int]:
        key = (tuple(prompt), params)
        if key not in memo:
            e = make_engine(tiny_llama_dir, block_size_tokens=16, max_num_batched_tokens=2048)
            memo[key] = e.generate([prompt], params)[0]
        return memo[key]
    return ref


def assert_all_free(engine: LLMEngine) -> None:
    s = engine.stats()
    assert s["num_free_blocks"] == s["num_total_blocks"], s
    assert s["num_running"] == s["num_waiting"] == 0
    assert not any(engine.pool.ref)


# ---- scheduling never changes tokens ---------------------------------------------------------------

@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("budget", [3, 7, 64, 2048])
def test_output_independent_of_budget_block_size_and_batch(tiny_llama_dir, reference, budget,
                                                          block_size):
    engine = make_engine(tiny_llama_dir, block_size_tokens=block_size, num_blocks=512,
                         max_num_batched_tokens=budget)
    outs = engine.generate(PROMPTS, GREEDY)
    assert outs == [reference(p) for p in PROMPTS]
    assert all(len(o) == GREEDY.max_tokens for o in outs)
    assert_all_free(engine)


def test_requests_added_mid_flight_match_running_alone(tiny_llama_dir, reference):
    engine = make_engine(tiny_llama_dir, max_num_batched_tokens=7)
    outs: dict[str, list[int]] = {}
    rids = {}
    schedule = {0: [0, 1], 3: [2], 5: [3, 4], 9: [5]}  # step -> prompts that arrive then
    for step in range(40):
        for i in schedule.get(step, []):
            rids[i] = engine.add_request(f"r{i}", PROMPTS[i], GREEDY)
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
    run(engine, outs)
    assert len(rids) == len(PROMPTS)
    for i, p in enumerate(PROMPTS):
        assert outs[rids[i]] == reference(p), i
    assert_all_free(engine)


def test_chunk_cap_on_a_prompt_next_to_running_decodes_keeps_every_token(tiny_llama_dir,
                                                                          reference):
    # The offload shape: requests decoding while a long prompt is prefilled 8 tokens a step.
    engine = make_engine(tiny_llama_dir)
    long_prompt = make_prompts([60], seed=3)[0]
    longer = replace(GREEDY, max_tokens=24)
    rids = [engine.add_request(None, p, longer) for p in PROMPTS[:3]]
    outs = {o.request_id: o.new_token_ids for o in engine.step()}  # they decode from now on
    capped = engine.add_request(None, long_prompt, GREEDY, max_chunk_tokens=8)
    chunks = []
    while engine.has_work():
        seq = engine.seqs.get(capped)
        before = seq.num_computed if seq is not None else None
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
        if before is not None and before < len(long_prompt):
            chunks.append(seq.num_computed - before)
    assert chunks == [8] * 7 + [4]
    assert outs[capped] == reference(long_prompt)
    for rid, p in zip(rids, PROMPTS):
        assert outs[rid] == reference(p, longer)
    assert engine.stats()["prompt_tokens_computed"] == 60 + sum(map(len, PROMPTS[:3]))
    assert_all_free(engine)
    with pytest.raises(InvalidArgumentError, match="max_chunk_tokens"):
        engine.add_request(None, long_prompt, GREEDY, max_chunk_tokens=-1)


def test_preemption_under_a_tiny_pool_keeps_every_output(tiny_llama_dir, reference):
    # 12 blocks of 4 tokens: the longest request alone needs 8, all of them together need 30.
    engine = make_engine(tiny_llama_dir, num_blocks=12, max_num_batched_tokens=16)
    params = [GREEDY, SAMPLED] * 3
    rids = [engine.add_request(None, p, sp) for p, sp in zip(PROMPTS, params)]
    outs = run(engine)
    assert engine.scheduler.preemptions > 0, "the pool was meant to run out"
    for rid, p, sp in zip(rids, PROMPTS, params):
        assert outs[rid] == reference(p, sp)
    assert_all_free(engine)


# ---- prefix caching --------------------------------------------------------------------------------

def test_prefix_cache_hit_gives_the_same_output(tiny_llama_dir, reference):
    shared = make_prompts([24], seed=7)[0]
    first, second = shared + [11, 12, 13], shared + [21, 22]
    engine = make_engine(tiny_llama_dir)
    assert engine.generate([first], GREEDY)[0] == reference(first)
    hits_before = engine.stats()["prefix_cache_hits_tokens"]
    assert engine.stats()["num_cached_blocks"] > 0
    log: list[StepOutput] = []
    rid = engine.add_request(None, second, GREEDY)
    out = run(engine, log=log)[rid]
    assert engine.stats()["prefix_cache_hits_tokens"] - hits_before == 24
    assert {o.num_cached_tokens for o in log} == {24}
    assert all(o.num_prompt_tokens == len(second) for o in log)

    off = make_engine(tiny_llama_dir, enable_prefix_caching=False)
    assert off.generate([first], GREEDY)[0] == reference(first)
    off_log: list[StepOutput] = []
    rid = off.add_request(None, second, GREEDY)
    assert run(off, log=off_log)[rid] == out
    assert {o.num_cached_tokens for o in off_log} == {0}
    assert off.stats()["prefix_cache_hits_tokens"] == 0 and off.stats()["num_cached_blocks"] == 0


def test_prefix_cache_is_isolated_per_tenant(tiny_llama_dir):
    prompt = make_prompts([20], seed=8)[0]
    engine = make_engine(tiny_llama_dir)
    engine.add_request(None, prompt, GREEDY, salt="tenant-a")
    out_a = run(engine)
    log: list[StepOutput] = []
    engine.add_request(None, prompt, GREEDY, salt="tenant-b")
    out_b = run(engine, log=log)
    assert {o.num_cached_tokens for o in log} == {0}
    assert engine.stats()["prefix_cache_hits_tokens"] == 0
    assert list(out_a.values()) == list(out_b.values())
    log.clear()
    engine.add_request(None, prompt, GREEDY, salt="tenant-a")
    run(engine, log=log)
    assert {o.num_cached_tokens for o in log} == {16}


# ---- abort -----------------------------------------------------------------------------------------

def test_abort_frees_all_blocks(tiny_llama_dir, reference):
    engine = make_engine(tiny_llama_dir, max_num_batched_tokens=6, max_num_seqs=2)
    parked = engine.add_request(None, PROMPTS[4], GREEDY, prefill_only=True)
    while parked in engine.seqs:
        engine.step()
    assert parked in engine.parked  # its KV waits for export
    long = replace(GREEDY, max_tokens=40)
    rids = [engine.add_request(None, p, long) for p in PROMPTS[:4]]
    for _ in range(3):
        engine.step()
    s = engine.stats()
    assert s["num_running"] == 2 and s["num_waiting"] == 2 and s["num_free_blocks"] < 256
    # One request decodes, one is mid-prefill, two never started.
    assert [engine.seqs[r].num_computed for r in rids] == [7, 11, 0, 0]
    for rid in rids + [parked]:
        assert engine.abort(rid)
    assert not engine.abort(rids[0]) and not engine.abort("never-added")
    assert_all_free(engine)
    assert not engine.has_work() and not engine.parked
    # It keeps serving, and the aborted ids can be used again.
    rid = engine.add_request(rids[0], PROMPTS[0], GREEDY)
    assert run(engine)[rid] == reference(PROMPTS[0])


# ---- prefill here, decode there ----------------------------------------------------------------------

def prefill_elsewhere(path: str, prompt: list[int], params: SamplingParams, **overrides):
    """Engine A in the prefill role: returns (first_token, ParkedKV), with A's pool all free."""
    a = make_engine(path, **overrides)
    a.add_request("r", prompt, params, prefill_only=True)
    log: list[StepOutput] = []
    run(a, log=log)
    (out,) = log
    assert out.prefill_done and out.new_token_ids and "r" in a.parked
    kv = a.take_parked_kv("r")
    assert kv.num_tokens == len(prompt) and len(kv.blocks) == len(kv.block_hashes)
    assert_all_free(a)
    assert not a.parked
    return out.new_token_ids[0], kv


@pytest.mark.parametrize("prompt_len", [16, 19])  # whole blocks only / a trailing partial block
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("mode", ["all", "local_prefix", "tail_missing", "nothing"])
def test_prefilled_request_continues_like_a_single_engine(tiny_llama_dir, reference, mode,
                                                          params, prompt_len):
    prompt = make_prompts([prompt_len], seed=3)[0]
    full = reference(prompt, params)
    first, kv = prefill_elsewhere(tiny_llama_dir, prompt, params, max_num_batched_tokens=5)
    assert first == full[0]
    blocks = list(zip(kv.block_hashes, kv.blocks))
    b = make_engine(tiny_llama_dir, max_num_batched_tokens=6)
    expect_cached = prompt_len
    if mode == "local_prefix":
        # B already holds the first 8 tokens' blocks: those are sent as hashes only.
        b.generate([prompt[:8] + [5]], SamplingParams(max_tokens=1))
        n_local = b.cached_prefix_blocks(kv.block_hashes)
        assert n_local == 2
        blocks = [(h, None) for h, _ in blocks[:n_local]] + blocks[n_local:]
    elif mode == "tail_missing":
        blocks = blocks[:2]  # the store lost the rest: B recomputes from token 8
        expect_cached = 8
    elif mode == "nothing":
        blocks = []
        expect_cached = 0
    assert b.add_prefilled_request("r", prompt, first, params, blocks) is None
    log: list[StepOutput] = []
    out = run(b, log=log)
    assert [first] + out["r"] == full
    assert {o.num_cached_tokens for o in log} == {expect_cached}
    assert log[-1].finished and log[-1].finish_reason == "length"
    assert_all_free(b)


def test_prefilled_request_whose_first_token_ends_it(tiny_llama_dir, reference):
    prompt = PROMPTS[1]
    one = SamplingParams(max_tokens=1)
    first, kv = prefill_elsewhere(tiny_llama_dir, prompt, one)
    assert [first] == reference(prompt, one)
    b = make_engine(tiny_llama_dir)
    reason = b.add_prefilled_request("r", prompt, first, one, list(zip(kv.block_hashes, kv.blocks)))
    assert reason == "length" and not b.has_work()
    assert_all_free(b)


def test_prefill_only_output_block_hashes_match_the_decode_side(tiny_llama_dir):
    # The decode side looks blocks up by the hashes the prefill side exported.
    prompt = make_prompts([10], seed=4)[0]
    _, kv = prefill_elsewhere(tiny_llama_dir, prompt, GREEDY, max_num_batched_tokens=3)
    assert kv.block_hashes == prompt_block_hashes(prompt, 4, include_partial=True)
    shape = make_engine(tiny_llama_dir).kv.block_shape()  # [layers, k/v, block, kv heads, dim]
    assert all(tuple(x.shape) == shape for x in kv.blocks)


# ---- stop rules ------------------------------------------------------------------------------------

def test_stop_token_ids_max_tokens_and_eos(tiny_llama_dir, reference):
    prompt = PROMPTS[3]
    full = reference(prompt)
    stop_at = 3
    stop_tok = full[stop_at]
    expect = full[:full.index(stop_tok) + 1]
    engine = make_engine(tiny_llama_dir)
    log: list[StepOutput] = []
    engine.add_request("stop", prompt, replace(GREEDY, stop_token_ids=(stop_tok,)))
    engine.add_request("len", prompt, replace(GREEDY, max_tokens=5))
    outs = run(engine, log=log)
    assert outs["stop"] == expect and outs["len"] == full[:5]
    final = {o.request_id: o for o in log if o.finished}
    assert final["stop"].finish_reason == "stop" and final["len"].finish_reason == "length"
    assert all(not o.finished and o.finish_reason is None for o in log if o not in final.values())

    # EOS: the model's eos id is whatever the config says; make it a token this prompt produces.
    model_config, weights = load_checkpoint(tiny_llama_dir, torch.float32)
    cfg = EngineConfig(tiny_llama_dir, cache=CacheConfig(block_size_tokens=4, num_blocks=64))
    eos_engine = LLMEngine(cfg, model_config=replace(model_config, eos_token_ids=(stop_tok,)),
                           weights=weights)
    log.clear()
    eos_engine.add_request("eos", prompt, replace(GREEDY, ignore_eos=False))
    eos_engine.add_request("ignore", prompt, GREEDY)  # ignore_eos=True
    outs = run(eos_engine, log=log)
    assert outs["eos"] == expect and outs["ignore"] == full
    final = {o.request_id: o for o in log if o.finished}
    assert final["eos"].finish_reason == "stop" and final["ignore"].finish_reason == "length"
    assert_all_free(eos_engine)


# ---- validation ------------------------------------------------------------------------------------

@pytest.mark.parametrize("prompt, params, field", [
    pytest.param([], GREEDY, "prompt", id="empty-prompt"),
    pytest.param([5, SMOLLM2_VOCAB_SIZE], GREEDY, "prompt", id="token-id-past-vocab"),
    pytest.param([5, -1], GREEDY, "prompt", id="negative-token-id"),
    pytest.param([5] * 512, GREEDY, "prompt", id="prompt-fills-context"),
    pytest.param([5], SamplingParams(max_tokens=0), "max_tokens", id="max-tokens-0"),
    pytest.param([5], SamplingParams(max_tokens=513), "max_tokens", id="max-tokens-above-context"),
    pytest.param([5] * 500, SamplingParams(max_tokens=13), "max_tokens",
                 id="prompt-plus-max-tokens-above-context"),
    pytest.param([5], SamplingParams(temperature=-0.5), "temperature", id="temperature-negative"),
    pytest.param([5], SamplingParams(temperature=float("nan")), "temperature",
                 id="temperature-nan"),
    pytest.param([5], SamplingParams(temperature=float("inf")), "temperature",
                 id="temperature-inf"),
    pytest.param([5], SamplingParams(top_p=0.0), "top_p", id="top-p-0"),
    pytest.param([5], SamplingParams(top_p=1.5), "top_p", id="top-p-1.5"),
    pytest.param([5], SamplingParams(top_k=-1), "top_k", id="top-k-negative"),
    pytest.param([5], SamplingParams(stop_token_ids=(SMOLLM2_VOCAB_SIZE,)), "stop_token_ids",
                 id="stop-token-id-past-vocab"),
    pytest.param([5], SamplingParams(stop=("",)), "stop", id="empty-stop-string"),
])
def test_invalid_requests_name_the_field(tiny_llama_dir, reference, prompt, params, field):
    engine = make_engine(tiny_llama_dir)
    with pytest.raises(InvalidArgumentError) as info:
        engine.add_request(None, prompt, params)
    assert info.value.field == field and str(info.value).startswith(field)
    with pytest.raises(InvalidArgumentError) as info:
        engine.add_prefilled_request("p", prompt, 5, params, [])
    assert info.value.field == field
    assert not engine.has_work() and not engine.seqs
    assert engine.generate([PROMPTS[0]], GREEDY)[0] == reference(PROMPTS[0])  # still serving


def test_request_larger_than_the_pool_and_duplicate_ids_are_rejected(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, num_blocks=4)  # 16 tokens of KV
    with pytest.raises(InvalidArgumentError) as info:
        engine.add_request(None, [5] * 10, SamplingParams(max_tokens=7))
    assert info.value.field == "max_tokens"
    engine.add_request("x", [5] * 10, SamplingParams(max_tokens=6))
    with pytest.raises(InvalidArgumentError) as info:
        engine.add_request("x", [5], GREEDY)
    assert info.value.field == "request_id"
    with pytest.raises(InvalidArgumentError) as info:
        engine.add_prefilled_request("x", [5], 6, GREEDY, [])
    assert info.value.field == "request_id"


def test_full_waiting_queue_raises_queue_full(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, max_waiting=2)
    engine.add_request(None, [5, 6], GREEDY)
    engine.add_request(None, [5, 7], GREEDY)
    with pytest.raises(QueueFullError):
        engine.add_request("third", [5, 8], GREEDY)
    assert "third" not in engine.seqs
    run(engine)
    engine.add_request("third", [5, 8], GREEDY)


# ---- sampling --------------------------------------------------------------------------------------

def test_same_seed_same_tokens_whatever_the_batch(tiny_llama_dir, reference):
    prompt = PROMPTS[1]
    alone = reference(prompt, SAMPLED)
    engine = make_engine(tiny_llama_dir, block_size_tokens=1, max_num_batched_tokens=5)
    mates = [engine.add_request(None, p, sp) for p, sp in
             zip(PROMPTS[2:5], [GREEDY, replace(SAMPLED, seed=99), SAMPLED])]
    rid = engine.add_request(None, prompt, SAMPLED)
    outs = run(engine)
    assert outs[rid] == alone
    assert outs[mates[2]] == reference(PROMPTS[4], SAMPLED)
    assert alone != reference(prompt)  # sampling did something on this model


def test_different_seeds_differ(tiny_llama_dir, reference):
    prompt = PROMPTS[0]
    outs = {tuple(reference(prompt, replace(SAMPLED, seed=s))) for s in range(4)}
    assert len(outs) == 4


def test_unseeded_sampling_gets_a_seed_of_its_own(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    unseeded = replace(SAMPLED, seed=None, temperature=1.5, top_p=1.0)
    a, b = engine.generate([PROMPTS[0], PROMPTS[0]], unseeded)
    assert a != b


@pytest.mark.parametrize("temperature", [0.5, 2.0, 1e-40])
def test_top_k_one_or_tiny_temperature_equals_greedy(tiny_llama_dir, reference, temperature):
    engine = make_engine(tiny_llama_dir)
    greedy = [reference(p) for p in PROMPTS[:3]]
    top1 = SamplingParams(temperature=temperature, top_k=1, seed=5, max_tokens=8, ignore_eos=True)
    assert engine.generate(PROMPTS[:3], top1) == greedy
    if temperature < 1e-30:  # so small that unshifted logits / temperature overflow to inf
        cold = replace(top1, top_k=0)
        assert engine.generate(PROMPTS[:3], cold) == greedy
