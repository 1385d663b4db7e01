"""Speculative decoding, greedy: the n-gram drafter, greedy verification, and invariant 2
(lossless speculation) on a tiny random Llama.

The model has tied embeddings and a larger init, so its greedy output falls into repeats that
the n-gram drafter can predict, but not always: acceptance varies across requests and steps. The
reference for every comparison is the same engine with speculation off.
"""

from __future__ import annotations

import random

import pytest

from pdserve.engine.config import (CacheConfig, ConfigError, EngineConfig, SchedulerConfig,
                                   SpecConfig)
from pdserve.engine.engine import LLMEngine, StepOutput
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.spec import (Draft, Drafter, DraftRequest, NgramDrafter, SpecStats,
                                 verify_greedy)
from pdserve.engine.spec.ngram import ngram_lookup

from tests.conftest import SMOLLM2_VOCAB_SIZE

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)
K = 4


def make_engine(path: str, spec: SpecConfig | None = None, *, num_blocks: int = 256,
                budget: int = 2048, block_size: int = 4) -> LLMEngine:
    return LLMEngine(EngineConfig(
        path, cache=CacheConfig(block_size_tokens=block_size, num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget), spec=spec))


def repetitive_prompts(n: int = 6, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        pattern = [rng.randrange(3, SMOLLM2_VOCAB_SIZE) for _ in range(3 + i)]
        out.append((pattern * 4)[:10 + 3 * i])
    return out


def run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
        ) -> tuple[list[list[int]], list[list[StepOutput]]]:
    """Outputs per prompt, and each step's StepOutputs."""
    ps = params if isinstance(params, list) else [params] * len(prompts)
    rids = [engine.add_request(None, p, q) for p, q in zip(prompts, ps)]
    outs: dict[str, list[int]] = {r: [] for r in rids}
    steps = []
    while engine.has_work():
        step = engine.step()
        steps.append(step)
        for o in step:
            outs[o.request_id].extend(o.new_token_ids)
    return [outs[r] for r in rids], steps


def assert_all_free(engine: LLMEngine) -> None:
    s = engine.stats()
    assert s["num_free_blocks"] == s["num_total_blocks"], s
    assert s["num_running"] == s["num_waiting"] == 0


def assert_stats_consistent(engine: LLMEngine) -> dict:
    s = engine.stats()
    per_pos = s["spec_decode_num_accepted_tokens_per_pos"]
    assert len(per_pos) == K
    drafts, tokens = s["spec_decode_num_drafts"], s["spec_decode_num_draft_tokens"]
    accepted = s["spec_decode_num_accepted_tokens"]
    assert 0 <= accepted <= tokens <= K * drafts
    assert drafts <= tokens
    assert sum(per_pos) == accepted
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:]))  # position i needs i - 1 accepted
    assert per_pos[0] <= drafts
    return s


# ---- the drafter and the rule, by hand ---------------------------------------------------------
def test_ngram_proposes_what_followed_the_most_recent_match():
    # Last 3 tokens [1, 2, 3] occur at 0 and 5; the most recent earlier one (5) is followed by 7.
    hist = [1, 2, 3, 4, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    assert ngram_lookup(hist, 2, 1, 3) == [7, 8]
    assert ngram_lookup(hist, 5, 1, 3) == [7, 8, 1, 2, 3]
    # Longest n first: [5, 3] has no earlier match, but [3] (n=1) does.
    assert ngram_lookup([3, 6, 5, 3], 2, 1, 2) == [6, 5]
    assert ngram_lookup([3, 6, 5, 3], 2, 2, 2) == []  # min_n 2: no match, no proposal
    assert ngram_lookup([1, 2, 3, 4], 3, 1, 3) == []  # nothing repeats
    assert ngram_lookup([5], 3, 1, 3) == []  # no earlier context
    assert ngram_lookup([1, 2, 1, 2], 0, 1, 3) == []  # k = 0


def test_ngram_continues_a_repeating_pattern():
    assert ngram_lookup([9, 7, 7, 7], 4, 1, 3) == [7, 7, 7, 7]  # period 1
    assert ngram_lookup([4, 1, 2, 1, 2], 5, 1, 3) == [1, 2, 1, 2, 1]  # period 2


def test_ngram_drafter_batch_and_per_request_k():
    d = NgramDrafter(min_n=1, max_n=3)
    assert isinstance(d, Drafter)
    hists = [[1, 2, 3, 1, 2], [5, 6], [8, 8]]
    assert [x.tokens for x in d.propose([DraftRequest(h, 2) for h in hists])] == [
        [3, 1], [], [8, 8]]
    assert [x.tokens for x in d.propose([DraftRequest(h, k) for h, k in
                                         zip(hists, [1, 3, 0])])] == [[3], [], []]
    with pytest.raises(ValueError):
        NgramDrafter(min_n=3, max_n=2)
    with pytest.raises(ConfigError):
        SpecConfig(num_speculative_tokens=0)


def test_verify_greedy_accepts_the_longest_agreeing_prefix():
    assert verify_greedy([5, 6, 7], [5, 6, 7, 8]) == (3, [5, 6, 7, 8])
    assert verify_greedy([5, 6, 7], [5, 9, 7, 8]) == (1, [5, 9])
    assert verify_greedy([5, 6, 7], [4, 6, 7, 8]) == (0, [4])
    assert verify_greedy([], [4]) == (0, [4])
    with pytest.raises(ValueError):
        verify_greedy([1, 2], [1, 2])
    st = SpecStats(3)
    st.record(3, 2)
    st.record(1, 1)
    st.record(0, 0)  # no draft: not a verification
    assert st.as_dict() == {"spec_decode_num_drafts": 2, "spec_decode_num_draft_tokens": 4,
                            "spec_decode_num_accepted_tokens": 3,
                            "spec_decode_num_accepted_tokens_per_pos": [2, 1, 0]}


# ---- invariant 2: lossless -------------------------------------------------------------------
def test_ngram_speculation_is_lossless_with_ragged_acceptance(repeaty_llama_dir):
    prompts = repetitive_prompts()
    plain = make_engine(repeaty_llama_dir)
    want, _ = run(plain, prompts, GREEDY)
    assert "spec_decode_num_drafts" not in plain.stats()  # speculation off: stats as before
    spec = make_engine(repeaty_llama_dir,
                       SpecConfig(method="ngram", num_speculative_tokens=K, schedule=False))
    got, steps = run(spec, prompts, GREEDY)
    assert got == want
    assert all(len(o) == GREEDY.max_tokens for o in got)
    s = assert_stats_consistent(spec)
    assert s["spec_decode_num_accepted_tokens"] > 0
    # Some drafts were rejected.
    assert s["spec_decode_num_accepted_tokens"] < s["spec_decode_num_draft_tokens"]
    # Fewer steps than tokens, and acceptance differs across requests and within one step.
    assert len(steps) < GREEDY.max_tokens
    emitted = {}
    ragged_step = False
    for step in steps:
        lens = {len(o.new_token_ids) for o in step}
        ragged_step |= len(lens) > 1
        for o in step:
            emitted.setdefault(o.request_id, []).append(len(o.new_token_ids))
    assert ragged_step
    assert len({tuple(v) for v in emitted.values()}) > 1
    assert_all_free(spec)


class NoisyOracle(Drafter):
    """Proposes the true continuation with a wrong token at a position that depends on the
    history's length (sometimes past the draft: all accepted): any drafter must be lossless,
    and this one makes acceptance ragged on purpose. A request's drafts depend only on its own
    history, so two runs agree step by step until their outputs differ."""

    def __init__(self, truth: dict[tuple[int, ...], list[int]]) -> None:
        self.truth = truth

    def propose(self, requests):
        out = []
        for r in requests:
            h, kk = r.token_ids, r.k
            for prompt, full in self.truth.items():
                if tuple(h[:len(prompt)]) == prompt:
                    d = list(full[len(h):len(h) + kk])
                    bad = (len(h) * 7 + len(prompt)) % (kk + 2)
                    if bad < len(d):
                        d[bad] = (d[bad] + 1) % SMOLLM2_VOCAB_SIZE
                    out.append(Draft(d))
                    break
            else:
                out.append(Draft([]))
        return out


@pytest.mark.parametrize("budget,num_blocks", [(2048, 256), (9, 256), (2048, 24)])
def test_any_drafter_is_lossless_under_tight_budget_and_pool(repeaty_llama_dir, budget,
                                                             num_blocks):
    """Drafts cut by the token budget, dropped for want of blocks, preemption, and a sampled
    request (which gets no drafts) in the same batch: outputs never change."""
    prompts = repetitive_prompts(5, seed=1)
    sampled = SamplingParams(temperature=0.8, seed=7, max_tokens=20, ignore_eos=True)
    params = [GREEDY] * 4 + [sampled]
    want, _ = run(make_engine(repeaty_llama_dir), prompts, params)
    spec = make_engine(repeaty_llama_dir, SpecConfig(num_speculative_tokens=K, schedule=False),
                       budget=budget, num_blocks=num_blocks)
    spec.runner.drafter = NoisyOracle({tuple(p): p + o for p, o in zip(prompts[:4], want[:4])})
    got, steps = run(spec, prompts, params)
    assert got == want
    s = assert_stats_consistent(spec)
    assert 0 < s["spec_decode_num_accepted_tokens"] < s["spec_decode_num_draft_tokens"]
    assert_all_free(spec)


def test_max_tokens_and_stop_inside_an_accepted_run(repeaty_llama_dir):
    prompts = repetitive_prompts()
    cfg = SpecConfig(num_speculative_tokens=K, schedule=False)
    for max_tokens in (1, 2, 7):
        p = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        want, _ = run(make_engine(repeaty_llama_dir), prompts, p)
        got, _ = run(make_engine(repeaty_llama_dir, cfg), prompts, p)
        assert got == want
        assert all(len(o) == max_tokens for o in got)
    # An n-gram draft is always a token seen before, so a stop on its first appearance is never
    # a draft; the oracle drafter proposes new tokens too. Find a token whose first appearance in
    # some output is an accepted draft with more tokens after it in the same step: stopping
    # there must cut that step's run short.
    full, _ = run(make_engine(repeaty_llama_dir), prompts, GREEDY)
    truth = {tuple(p): p + o for p, o in zip(prompts, full)}
    e = make_engine(repeaty_llama_dir, cfg)
    e.runner.drafter = NoisyOracle(truth)
    _, steps = run(e, prompts, GREEDY)
    seen: dict[str, list[int]] = {}
    stop_tok = cut_at = None
    for step in steps:
        for o in step:
            prev = seen.setdefault(o.request_id, [])
            for j in range(1, len(o.new_token_ids) - 1):
                tok = o.new_token_ids[j]
                if stop_tok is None and tok not in prev + o.new_token_ids[:j]:
                    stop_tok, cut_at = tok, j + 1
            prev.extend(o.new_token_ids)
    assert stop_tok is not None
    for how in ("stop_token_ids", "eos"):
        if how == "eos":
            p = SamplingParams(max_tokens=GREEDY.max_tokens)
        else:
            p = SamplingParams(max_tokens=GREEDY.max_tokens, ignore_eos=True,
                               stop_token_ids=(stop_tok,))
        plain, spec = make_engine(repeaty_llama_dir), make_engine(repeaty_llama_dir, cfg)
        spec.runner.drafter = NoisyOracle(truth)
        if how == "eos":
            plain.eos_ids = spec.eos_ids = {stop_tok}
        want, _ = run(plain, prompts, p)
        got, steps = run(spec, prompts, p)
        assert got == want
        stopped = [o for o in want if stop_tok in o]
        assert stopped and all(o.index(stop_tok) == len(o) - 1 for o in stopped)
        finals = {o.request_id: o for step in steps for o in step if o.finished}
        assert len(finals) == len(prompts)
        assert {o.finish_reason for o in finals.values()} >= {"stop"}
        assert any(o.finish_reason == "stop" and len(o.new_token_ids) == cut_at
                   and o.new_token_ids[-1] == stop_tok for o in finals.values())
        assert_stats_consistent(spec)
        assert_all_free(spec)


def test_logprobs_with_speculation_match(repeaty_llama_dir):
    prompts = repetitive_prompts(3)
    p = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2)

    def run_lp(engine):
        rids = [engine.add_request(None, q, p) for q in prompts]
        lps = {r: [] for r in rids}
        while engine.has_work():
            for o in engine.step():
                assert o.logprobs is not None and len(o.logprobs) == len(o.new_token_ids)
                lps[o.request_id].extend(o.logprobs)
        return [lps[r] for r in rids]

    want = run_lp(make_engine(repeaty_llama_dir))
    spec = make_engine(repeaty_llama_dir, SpecConfig(num_speculative_tokens=K, schedule=False))
    got = run_lp(spec)
    assert spec.stats()["spec_decode_num_accepted_tokens"] > 0
    for a, b in zip(want, got):
        assert [x.token_id for x in a] == [x.token_id for x in b]
        assert [x.top[0][0] for x in a] == [x.top[0][0] for x in b]
        assert all(abs(x.logprob - y.logprob) < 1e-4 for x, y in zip(a, b))


# ---- the confidence scheduler in the engine ----------------------------------------------------
def test_scheduler_drafts_on_an_idle_machine_and_cuts_drafts_on_a_busy_one(repeaty_llama_dir):
    """With a step cost that barely grows with the batch, whole drafts are verified; with one
    that grows steeply past the decode batch, speculation would make the step slower than the
    tokens it could win, so nothing is drafted. Outputs are the same either way."""
    from pdserve.engine.spec.schedule import StepCostTable

    prompts = repetitive_prompts(4, seed=3)
    want, _ = run(make_engine(repeaty_llama_dir), prompts, GREEDY)

    idle = make_engine(repeaty_llama_dir, SpecConfig(num_speculative_tokens=K))
    idle.runner.step_costs = StepCostTable({1: 1.0, 64: 1.01})
    got, _ = run(idle, prompts, GREEDY)
    assert got == want
    s = assert_stats_consistent(idle)
    assert s["spec_decode_num_draft_tokens"] > 2 * s["spec_decode_num_drafts"]  # long drafts

    busy = make_engine(repeaty_llama_dir, SpecConfig(num_speculative_tokens=K))
    busy.runner.step_costs = StepCostTable({1: 1.0, 4: 1.0, 5: 10.0, 64: 200.0})
    got, _ = run(busy, prompts, GREEDY)
    assert got == want
    assert busy.stats()["spec_decode_num_draft_tokens"] == 0

    off = make_engine(repeaty_llama_dir, SpecConfig(num_speculative_tokens=K, schedule=False))
    off.runner.step_costs = StepCostTable({1: 1.0, 4: 1.0, 5: 10.0, 64: 200.0})  # ignored when off
    got, _ = run(off, prompts, GREEDY)
    assert got == want
    assert off.stats()["spec_decode_num_draft_tokens"] > 0
