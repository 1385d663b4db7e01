"""The trained drafters (EAGLE-, DFlash-, DSpark-style) in the engine: output equals no
speculation token for token (invariant 2), greedy and seeded sampled requests in one batch with
ragged acceptance, with the confidence scheduler on and off. Drafters are trained for a few
seconds on a tiny Llama whose greedy output repeats, so their drafts are often right."""

from __future__ import annotations

import pytest

from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.spec.schedule import StepCostTable
from pdserve.engine.spec.train import _render, train_draft
from pdserve.engine.tokenizer import Tokenizer


pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = [f"Tell me about topic number {i}, and then {i * 7} more things." for i in range(8)]
TINY = dict(max_new_tokens=16, window=8, draft_vocab_size=256, seed=0, batch_size=2,
            progress=False)
K = 4


@pytest.fixture(scope="module")
def drafts(repeaty_llama_dir, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("drafts")
    mp = pytest.MonkeyPatch()
    mp.setenv("PDSERVE_CACHE", str(root / "cache"))  # the target's answers are built once
    out = {}
    try:
        for kind in ("eagle", "dflash", "dspark"):
            out[kind] = str(root / kind)
            train_draft(repeaty_llama_dir, kind, out[kind], epochs=8, prompts=PROMPTS,
                        eval_prompts=PROMPTS[:2], **TINY)
    finally:
        mp.undo()
    return out


def make_engine(path: str, spec: SpecConfig | None = None) -> LLMEngine:
    return LLMEngine(EngineConfig(path, cache=CacheConfig(block_size_tokens=4, num_blocks=256),
                                  scheduler=SchedulerConfig(max_num_batched_tokens=512),
                                  spec=spec))


def run(engine: LLMEngine, prompts, params):
    rids = [engine.add_request(None, p, q) for p, q in zip(prompts, params)]
    outs = {r: [] for r in rids}
    while engine.has_work():
        for o in engine.step():
            outs[o.request_id].extend(o.new_token_ids)
    return [outs[r] for r in rids]


def batch(path: str):
    """Chat-rendered prompts like the ones the drafters learnt from, of different lengths."""
    tok = Tokenizer.from_path(path)
    ids = [_render(tok, PROMPTS[i])[: 12 + 5 * i] for i in range(5)]
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)
    sampled = SamplingParams(temperature=0.7, seed=5, max_tokens=24, ignore_eos=True)
    return ids, [greedy, greedy, sampled, greedy, sampled]


@pytest.mark.parametrize("kind", ["eagle", "dflash", "dspark"])
@pytest.mark.parametrize("schedule", [False, True])
def test_trained_drafter_output_equals_no_speculation(repeaty_llama_dir, drafts, kind, schedule):
    plain = make_engine(repeaty_llama_dir)
    prompts, params = batch(repeaty_llama_dir)
    want = run(plain, prompts, params)
    spec = make_engine(repeaty_llama_dir, SpecConfig(method=kind, draft_path=drafts[kind],
                                               num_speculative_tokens=K, schedule=schedule))
    if schedule:  # an idle machine: drafts pay, so the scheduler keeps them (and the
        spec.runner.step_costs = StepCostTable({1: 1.0, 64: 1.05})  # confidences decide the length)
    got = run(spec, prompts, params)
    assert got == want
    s = spec.stats()
    assert s["spec_decode_num_draft_tokens"] > 0
    assert sum(s["spec_decode_num_accepted_tokens_per_pos"]) == s["spec_decode_num_accepted_tokens"]
    if kind == "eagle":  # the serial drafter learns this target well: some drafts hold
        assert s["spec_decode_num_accepted_tokens"] > 0
    assert s["num_free_blocks"] == s["num_total_blocks"]
