"""Progressive KV in the engine: a request joins with anchor-precision KV, decodes
drafts on it without emitting anything, and when the exact KV arrives the drafts are verified in
one step. Output must equal joining with exact KV, token for token (invariant 2), whatever the
approximation, under preemption, for greedy and seeded sampled requests."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import kvcodec
from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling import SamplingParams

from tests.conftest import make_tiny_hf_model

GREEDY = SamplingParams(max_tokens=20, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.8, seed=11, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny_llama_progressive"), "llama",
                              tie_word_embeddings=True)


def make_engine(path: str, num_blocks: int = 256) -> LLMEngine:
    return LLMEngine(EngineConfig(path, cache=CacheConfig(block_size_tokens=4,
                                                          num_blocks=num_blocks),
                                  scheduler=SchedulerConfig(max_num_batched_tokens=512)))


def prefill(path: str, prompts: list[list[int]], params: list[SamplingParams]):
    """What a prefill worker hands over: first token and the prompt's KV blocks."""
    e = make_engine(path)
    rids = [e.add_request(None, p, q, prefill_only=True) for p, q in zip(prompts, params)]
    first = {}
    while e.has_work():
        for o in e.step():
            assert o.prefill_done
            first[o.request_id] = o.new_token_ids[0]
    return [(first[r], e.take_parked_kv(r)) for r in rids]


def anchor_of(block: torch.Tensor) -> torch.Tensor:
    a, _ = kvcodec.split(block)
    return kvcodec.dequantize_anchor(a, block.dtype, block.shape)


def decode(engine: LLMEngine, prompts, params, handed, *, approx=None, steps_before_exact=3):
    """Join every request (approximate blocks when `approx` maps a block), step a few times,
    then deliver the exact KV; returns outputs per request and what was emitted early."""
    rids = []
    for i, (p, q, (first, kv)) in enumerate(zip(prompts, params, handed)):
        rid = f"r{i}"
        data = [approx(b) if approx else b for b in kv.blocks]
        engine.add_prefilled_request(rid, p, first, q, list(zip(kv.block_hashes, data)),
                                     approximate=approx is not None)
        rids.append(rid)
    outs = {r: [first] for r, (first, _) in zip(rids, handed)}
    early = []
    for _ in range(steps_before_exact):
        early.extend(engine.step())
    if approx is not None:
        for rid, (_, kv) in zip(rids, handed):
            engine.finish_anchor(rid, list(zip(kv.block_hashes, kv.blocks)))
    for o in early:
        outs[o.request_id].extend(o.new_token_ids)
    while engine.has_work():
        for o in engine.step():
            outs[o.request_id].extend(o.new_token_ids)
    return [outs[r] for r in rids], early


def prompts_and_params():
    prompts = [[5, 9, 100, 7, 3, 11, 42, 8, 19], [17] * 6 + [3, 4, 5], [60, 61, 62, 63, 64, 65, 66]]
    return prompts, [GREEDY, SAMPLED, GREEDY]


@pytest.mark.parametrize("approx_name", ["anchor", "noise"])
def test_drafting_on_anchor_kv_then_verifying_gives_the_exact_output(llama_dir, approx_name):
    prompts, params = prompts_and_params()
    handed = prefill(llama_dir, prompts, params)
    want, _ = decode(make_engine(llama_dir), prompts, params, handed)

    gen = torch.Generator().manual_seed(0)
    approx = anchor_of if approx_name == "anchor" else (
        lambda b: torch.randn(b.shape, generator=gen, dtype=b.dtype))
    e = make_engine(llama_dir)
    got, early = decode(e, prompts, params, handed, approx=approx, steps_before_exact=4)
    assert not early  # nothing decoded on approximate KV is ever emitted
    assert got == want
    s = e.stats()
    assert s["anchor_num_drafts"] == len(prompts)  # one verification per request
    assert s["anchor_num_draft_tokens"] == 4 * len(prompts)  # one draft per step before
    if approx_name == "anchor":  # the anchor is close: most drafts hold
        assert s["anchor_num_accepted_tokens"] >= 2 * len(prompts)
    assert s["num_free_blocks"] == s["num_total_blocks"] and s["num_running"] == 0


def test_drafting_pauses_at_its_limit_and_exact_kv_resumes(llama_dir):
    prompts, params = prompts_and_params()
    handed = prefill(llama_dir, prompts, params)
    want, _ = decode(make_engine(llama_dir), prompts, params, handed)
    e = make_engine(llama_dir)
    e.max_anchor_drafts = 5
    got, early = decode(e, prompts, params, handed, approx=anchor_of, steps_before_exact=12)
    assert not early
    assert got == want
    assert e.stats()["anchor_num_draft_tokens"] == 5 * len(prompts)


def test_a_paused_request_leaves_the_engine_idle(llama_dir):
    prompts, params = prompts_and_params()
    handed = prefill(llama_dir, prompts[:1], params[:1])
    e = make_engine(llama_dir)
    e.max_anchor_drafts = 2
    first, kv = handed[0]
    e.add_prefilled_request("r", prompts[0], first, GREEDY,
                            [(h, anchor_of(b)) for h, b in zip(kv.block_hashes, kv.blocks)],
                            approximate=True)
    for _ in range(2):
        assert e.step() == []
    assert not e.has_work()  # paused: the engine loop may sleep instead of spinning
    assert e.finish_anchor("r", list(zip(kv.block_hashes, kv.blocks))) == 2
    assert e.has_work()
    out = e.step()
    assert len(out) == 1 and 1 <= len(out[0].new_token_ids) <= 3


def test_preemption_while_drafting_on_the_anchor_stays_exact(llama_dir):
    """A pool too small for every request: one is preempted while drafting on the anchor; its
    recompute is exact, the late exact KV is ignored, and output still matches."""
    prompts, params = prompts_and_params()
    handed = prefill(llama_dir, prompts, params)
    want, _ = decode(make_engine(llama_dir), prompts, params, handed)
    e = make_engine(llama_dir, num_blocks=10)
    preempted = []
    preempt = e.scheduler._preempt

    def spy(seq):
        preempted.append(seq.anchor_from > 0)  # was it drafting on the anchor?
        preempt(seq)

    e.scheduler._preempt = spy
    got, early = decode(e, prompts, params, handed, approx=anchor_of, steps_before_exact=6)
    assert any(preempted)  # the pool was too small: a request drafting on the anchor went
    assert got == want
    s = e.stats()
    assert s["num_running"] == 0 and s["num_waiting"] == 0


def test_abort_while_drafting_frees_the_blocks(llama_dir):
    prompts, params = prompts_and_params()
    handed = prefill(llama_dir, prompts[:1], params[:1])
    e = make_engine(llama_dir)
    first, kv = handed[0]
    e.add_prefilled_request("r", prompts[0], first, GREEDY,
                            [(h, anchor_of(b)) for h, b in zip(kv.block_hashes, kv.blocks)],
                            approximate=True)
    e.step()
    assert e.abort("r")
    s = e.stats()
    assert s["num_free_blocks"] == s["num_total_blocks"]
    assert s["num_cached_blocks"] == 0  # approximate blocks never entered the prefix cache
    assert e.finish_anchor("r", list(zip(kv.block_hashes, kv.blocks))) == 0


def test_prefill_streams_each_layer_as_it_is_computed(llama_dir):
    """on_prefill_layer fires once per layer per step, in layer order, with the prefill-only
    requests' positions; what it reads equals the KV the request hands over at the end."""
    prompts, params = prompts_and_params()
    e = make_engine(llama_dir)
    e.scheduler.cfg = SchedulerConfig(max_num_batched_tokens=8)  # chunks: several steps each
    got: dict[tuple[str, int], list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
    order = []

    def on_layer(li, spans):
        order.append(li)
        for rid, start, end in spans:
            k, v = e.read_layer_kv(rid, li, start, end)
            got.setdefault((rid, li), []).append((start, k, v))

    e.on_prefill_layer = on_layer
    rids = [e.add_request(None, p, q, prefill_only=True) for p, q in zip(prompts, params)]
    done = []
    while e.has_work():
        done += [o.request_id for o in e.step() if o.prefill_done]
    layers = e.model_config.num_hidden_layers
    assert order[:layers] == list(range(layers))
    for rid, p in zip(rids, prompts):
        kv = e.take_parked_kv(rid)
        full = torch.cat(kv.blocks, dim=2)[:, :, :len(p)]  # [layers, 2, tokens, heads, dim]
        for li in range(layers):
            parts = sorted(got[(rid, li)], key=lambda x: x[0])
            assert [s for s, _, _ in parts][0] == 0
            k = torch.cat([k for _, k, _ in parts])
            v = torch.cat([v for _, _, v in parts])
            assert k.shape[0] == len(p)  # every prompt position, once
            assert torch.equal(k, full[li, 0]) and torch.equal(v, full[li, 1])
