"""Resuming a request in the engine (`add_request(resume_token_ids=...)`): what a decode worker
does when the one that was serving a request died after the client got some of its tokens.

The reference is the same request run without interruption in a roomy engine. Resumed at any
point, greedy or seeded-sampled, chunked or not, next to other running requests, the engine
must stream exactly the reference's tokens after the resume point (and their logprobs), end
for the same reason at the same place (a stop token, max_tokens right after the resume point),
and refuse resume tokens that could not come from a running request, naming the field.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from pdserve.engine.engine import StepOutput
from pdserve.engine.sampling import InvalidArgumentError, SamplingParams
from tests.conftest import SMOLLM2_VOCAB_SIZE
from tests.engine.test_engine import assert_all_free, make_engine, make_prompts, run

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_TOKENS = 24
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=77, max_tokens=MAX_TOKENS,
                        ignore_eos=True)
PROMPT, OTHER = make_prompts([11, 7], seed=5)


@pytest.fixture(scope="module")
def uninterrupted(tiny_llama_dir):
    """uninterrupted(params) -> (tokens, finish reason, logprobs) of PROMPT run alone."""
    memo: dict[SamplingParams, tuple[list[int], str, list]] = {}

    def ref(params: SamplingParams):
        if params not in memo:
            e = make_engine(tiny_llama_dir, block_size_tokens=16)
            e.add_request("ref", PROMPT, params)
            log: list[StepOutput] = []
            outs = run(e, log=log)
            lps = [lp for o in log for lp in (o.logprobs or [])]
            memo[params] = (outs["ref"], log[-1].finish_reason, lps)
        return memo[params]
    return ref


def resume(engine, params: SamplingParams, emitted: list[int], rid: str = "resumed"):
    """Add PROMPT resumed after `emitted` and run the engine; (new tokens, final output)."""
    engine.add_request(rid, PROMPT, params, resume_token_ids=emitted)
    log: list[StepOutput] = []
    outs = run(engine, log=log)
    final = [o for o in log if o.request_id == rid and o.finished]
    assert len(final) == 1
    return outs.get(rid, []), final[0]


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("cut", [1, 2, 9, MAX_TOKENS - 1])
@pytest.mark.parametrize("budget", [3, 2048])  # the resumed tokens computed in chunks, or at once
def test_resumed_request_continues_with_the_uninterrupted_tokens(tiny_llama_dir, uninterrupted,
                                                                 params, cut, budget):
    full, reason, _ = uninterrupted(params)
    assert len(full) == MAX_TOKENS and reason == "length"
    engine = make_engine(tiny_llama_dir, max_num_batched_tokens=budget)
    got, final = resume(engine, params, full[:cut])
    assert got == full[cut:]
    assert final.finish_reason == "length"
    assert final.num_prompt_tokens == len(PROMPT)
    assert_all_free(engine)


def test_max_tokens_reached_right_after_the_resume_point(tiny_llama_dir, uninterrupted):
    full, _, _ = uninterrupted(SEEDED)
    engine = make_engine(tiny_llama_dir)
    got, final = resume(engine, replace(SEEDED, max_tokens=6), full[:5])
    assert got == [full[5]] and final.finish_reason == "length"
    assert_all_free(engine)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_stop_token_after_the_resume_point_ends_it_where_it_would_have(tiny_llama_dir,
                                                                         uninterrupted, params):
    full, _, _ = uninterrupted(params)
    stop_tok = full[12]
    stopped = replace(params, stop_token_ids=(stop_tok,))
    want, reason, _ = uninterrupted(stopped)
    assert want == full[:full.index(stop_tok) + 1] and reason == "stop"
    cut = len(want) - 3  # a few tokens before the stop token
    engine = make_engine(tiny_llama_dir)
    got, final = resume(engine, stopped, want[:cut])
    assert got == want[cut:] and final.finish_reason == "stop"


def test_resumed_next_to_running_requests_keeps_every_output(tiny_llama_dir, uninterrupted):
    """A resumed request joins a batch that is decoding: neither output changes."""
    greedy, _, _ = uninterrupted(GREEDY)
    seeded, _, _ = uninterrupted(SEEDED)
    want_other = make_engine(tiny_llama_dir).generate([OTHER], GREEDY)[0]
    engine = make_engine(tiny_llama_dir, max_num_batched_tokens=5)
    engine.add_request("other", OTHER, GREEDY)
    outs: dict[str, list[int]] = {}
    for _ in range(4):  # the other request is decoding when the resumed ones arrive
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
    engine.add_request("greedy", PROMPT, GREEDY, resume_token_ids=greedy[:10])
    engine.add_request("seeded", PROMPT, SEEDED, resume_token_ids=seeded[:7])
    run(engine, outs)
    assert outs["other"] == want_other
    assert outs["greedy"] == greedy[10:] and outs["seeded"] == seeded[7:]
    assert_all_free(engine)


def test_logprobs_of_the_resumed_tokens_are_the_uninterrupted_ones(tiny_llama_dir,
                                                                   uninterrupted):
    params = replace(SEEDED, logprobs=3)
    full, _, want_lps = uninterrupted(params)
    engine = make_engine(tiny_llama_dir)
    engine.add_request("lp", PROMPT, params, resume_token_ids=full[:8])
    log: list[StepOutput] = []
    run(engine, log=log)
    lps = [lp for o in log for lp in (o.logprobs or [])]
    assert [lp.token_id for lp in lps] == full[8:]
    for got, want in zip(lps, want_lps[8:]):
        assert got.logprob == pytest.approx(want.logprob, abs=1e-5)
        assert [t for t, _ in got.top] == [t for t, _ in want.top]


@pytest.mark.parametrize("emitted, params, prefill_only", [
    pytest.param([5] * MAX_TOKENS, GREEDY, False, id="reaches-max-tokens"),
    pytest.param([5, SMOLLM2_VOCAB_SIZE], GREEDY, False, id="token-id-past-vocab"),
    pytest.param([5, -1], GREEDY, False, id="negative-token-id"),
    pytest.param([5, 9, 6], replace(GREEDY, stop_token_ids=(9,)), False, id="has-a-stop-token"),
    pytest.param([5, 2], replace(GREEDY, ignore_eos=False), False, id="has-eos"),
    pytest.param([5], GREEDY, True, id="prefill-only"),
])
def test_resume_tokens_a_running_request_cannot_have_are_refused(tiny_llama_dir, emitted,
                                                                 params, prefill_only):
    engine = make_engine(tiny_llama_dir)
    with pytest.raises(InvalidArgumentError) as info:
        engine.add_request("bad", PROMPT[:1], params, resume_token_ids=emitted,
                           prefill_only=prefill_only)
    assert info.value.field == "resume_token_ids"
    assert not engine.has_work() and not engine.seqs
    # A resume with eos inside is fine when eos is ignored: the request would have gone on.
    engine.add_request("ok", PROMPT[:1], GREEDY, resume_token_ids=[5, 2])
    assert len(run(engine)["ok"]) == MAX_TOKENS - 2
