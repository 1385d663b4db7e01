"""The confidence scheduler: the step-cost table, the draft-length planner (against hand-computed
optima and a brute force over every length combination), the acceptance estimator, and
profiling real forwards of a tiny model."""

from __future__ import annotations

import itertools
import json
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.loader import load_checkpoint
from pdserve.engine.model import LlamaModel
from pdserve.engine.spec.schedule import (AcceptanceEstimator, StepCostTable, expected_tokens,
                                          plan_draft_lengths, profile_engine_step_costs,
                                          profile_step_costs)

from tests.conftest import make_tiny_hf_model


def linear_cost(fixed_s: float, per_token_s: float) -> StepCostTable:
    return StepCostTable({1: fixed_s + per_token_s, 1001: fixed_s + 1001 * per_token_s})


def ratio(probs, lengths, base, cost, draft_cost_s=0.0) -> float:
    value = sum(expected_tokens(p, n) for p, n in zip(probs, lengths))
    m = sum(lengths)
    return value / (cost(base + m) + (draft_cost_s if m else 0.0))


# ---- the table --------------------------------------------------------------------------------
def test_table_is_monotone_and_interpolates():
    t = StepCostTable({4: 2.0, 1: 1.0, 2: 0.5})  # 2 tokens measured cheaper than 1: noise
    assert t.tokens == (1, 2, 4) and t.seconds == (1.0, 1.0, 2.0)
    assert t(0) == t(1) == 1.0  # flat below the first point
    assert t(3) == pytest.approx(1.5)
    assert t(6) == pytest.approx(3.0)  # the last segment's slope, (2 - 1) / (4 - 2)
    assert t(4) == 2.0
    costs = [t(n) for n in range(0, 20)]
    assert costs == sorted(costs)
    assert StepCostTable([(8, 0.25)])(100) == 0.25  # one point: constant
    assert StepCostTable([(2, 1.0), (2, 3.0)]).seconds == (3.0,)


def test_table_rejects_bad_points():
    for bad in ({}, {0: 1.0}, {1: -1.0}, {1: float("nan")}):
        with pytest.raises(ValueError):
            StepCostTable(bad)


def test_table_json_round_trip():
    t = StepCostTable({1: 0.01, 8: 0.013, 64: 0.05})
    back = StepCostTable.from_dict(json.loads(json.dumps(t.to_dict())))
    assert back == t and back(30) == t(30)


# ---- the planner: hand-computed optima ----------------------------------------------------------
def test_flat_cost_keeps_whole_drafts():
    flat = StepCostTable({1: 1.0, 1000: 1.0})
    assert plan_draft_lengths([[0.9, 0.8, 0.5, 0.1], [0.3, 0.3], []], 3, flat) == [4, 2, 0]
    # A sure-to-fail draft adds nothing: the tie goes to fewer tokens.
    assert plan_draft_lengths([[0.9, 0.0, 0.7]], 1, flat) == [1]


def test_linear_cost_cuts_low_confidence_tails():
    cost = linear_cost(1.0, 0.1)  # 1 s + 0.1 s per token
    # one request: m=0 1/1.1, m=1 1.9/1.2, m=2 2.35/1.3 (best), m=3 2.395/1.4
    assert plan_draft_lengths([[0.9, 0.5, 0.1]], 1, cost) == [2]
    # Cumulative products 0.9, 0.45, 0.045 | 0.2, 0.18: the second request's confident second
    # draft is worth only 0.18, after its weak first. m=2 gives 3.35/1.4, the best.
    assert plan_draft_lengths([[0.9, 0.5, 0.1], [0.2, 0.9]], 2, cost) == [2, 0]
    # Tokens cost 10x more: only the 0.9 draft pays (m=1 2.9/4 beats m=0 2/3 and m=2 3.35/5).
    assert plan_draft_lengths([[0.9, 0.5, 0.1], [0.2, 0.9]], 2, linear_cost(1.0, 1.0)) == [1, 0]
    # A step time purely proportional to its tokens (no fixed part): no unsure draft pays.
    assert plan_draft_lengths([[0.9, 0.5, 0.1], [0.2, 0.9]], 2, linear_cost(0.0, 1.0)) == [0, 0]


def test_expensive_drafter_drafts_nothing():
    flat = StepCostTable({1: 0.01})
    assert plan_draft_lengths([[0.99] * 4] * 3, 3, flat, draft_cost_s=0.0) == [4, 4, 4]
    assert plan_draft_lengths([[0.99] * 4] * 3, 3, flat, draft_cost_s=1.0) == [0, 0, 0]


def test_equal_confidences_convex_cost():
    cost = StepCostTable({4: 1.0, 8: 1.2, 12: 2.0, 16: 4.0, 20: 8.0})
    # m=4 (one draft each): 6/1.2 = 5.0 beats m=3 5.5/1.15 and m=5 6.25/1.4
    assert plan_draft_lengths([[0.5] * 4] * 4, 4, cost) == [1, 1, 1, 1]


def test_planner_edge_cases():
    cost = linear_cost(1.0, 0.1)
    assert plan_draft_lengths([], 5, cost) == []
    assert plan_draft_lengths([[], []], 2, cost) == [0, 0]
    with pytest.raises(ValueError):
        plan_draft_lengths([[1.5]], 1, cost)
    with pytest.raises(ValueError):
        plan_draft_lengths([[float("nan")]], 1, cost)
    with pytest.raises(ValueError):
        plan_draft_lengths([[0.5]], -1, cost)


def test_expected_tokens():
    assert expected_tokens([0.5, 0.5], 0) == 1.0
    assert expected_tokens([0.5, 0.5], 2) == pytest.approx(1.75)
    assert expected_tokens([1.0] * 4, 4) == 5.0


# ---- the planner: brute force ---------------------------------------------------------------------
prob = st.sampled_from([0.0, 0.1, 0.25, 0.5, 0.5, 0.8, 0.9, 1.0]) | st.floats(0.0, 1.0)


@settings(max_examples=300, deadline=None)
@given(probs=st.lists(st.lists(prob, max_size=4), min_size=1, max_size=3),
       base_extra=st.integers(0, 4),
       increments=st.lists(st.floats(0.0, 2.0), min_size=1, max_size=5),
       fixed=st.floats(0.01, 3.0), draft_cost_s=st.sampled_from([0.0, 0.0, 0.05, 0.5]))
def test_plan_attains_brute_force_maximum(probs, base_extra, increments, fixed, draft_cost_s):
    points = {1: fixed}
    for i, inc in enumerate(increments):  # a random monotone table
        points[2 + 3 * i] = points[max(points)] + inc
    cost = StepCostTable(points)
    base = len(probs) + base_extra
    got = plan_draft_lengths(probs, base, cost, draft_cost_s)
    assert all(0 <= n <= len(p) for n, p in zip(got, probs)) and len(got) == len(probs)
    best = max(ratio(probs, ls, base, cost, draft_cost_s)
               for ls in itertools.product(*[range(len(p) + 1) for p in probs]))
    assert ratio(probs, got, base, cost, draft_cost_s) >= best * (1 - 1e-9)
    # deterministic
    assert plan_draft_lengths(probs, base, cost, draft_cost_s) == got


# ---- the estimator ---------------------------------------------------------------------------------
def test_estimator_prior_and_partial_drafts():
    est = AcceptanceEstimator()
    assert est.probs(3) == [0.5, 0.5, 0.5]  # unseen: the prior mean, neither 0 nor 1
    est.update(2, 2)  # both accepted: positions 0 and 1 tried and accepted
    est.update(3, 0)  # first rejected: only position 0 tried
    assert est.tried == [2, 1] and est.accepted == [1, 1]
    assert est.probs(3) == pytest.approx([(1 + 1) / (2 + 2), (1 + 1) / (1 + 2), 0.5])
    est.update(0, 0)  # no drafts: nothing tried
    assert est.tried == [2, 1]
    with pytest.raises(ValueError):
        est.update(2, 3)
    with pytest.raises(ValueError):
        AcceptanceEstimator(prior_mean=1.0)


def test_estimator_forgets_back_to_the_prior():
    est = AcceptanceEstimator(prior_mean=0.5, prior_weight=2.0)
    for _ in range(50):
        est.update(1, 0)
    low = est.probs(1)[0]
    assert low < 0.05
    for _ in range(600):  # steps without drafts: the evidence fades
        est.forget(0.99)
    assert low < est.probs(1)[0] < 0.5 and est.probs(1)[0] > 0.4
    with pytest.raises(ValueError):
        est.forget(0.0)


def test_estimator_converges_to_true_rates():
    true = [0.8, 0.6, 0.3, 0.9]
    rng = random.Random(0)
    est = AcceptanceEstimator()
    for _ in range(20000):
        k = rng.choice([2, 3, 4])
        a = 0
        while a < k and rng.random() < true[a]:
            a += 1
        est.update(k, a)
    got = est.probs(4)
    for g, t in zip(got[:3], true[:3]):
        assert g == pytest.approx(t, abs=0.02)
    assert got[3] == pytest.approx(true[3], abs=0.05)  # reached least often


# ---- profiling real forwards -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_llama_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny_llama_schedule"), "llama")


def test_profile_step_costs_on_a_tiny_model(tiny_llama_path: str):
    cfg, weights = load_checkpoint(tiny_llama_path, torch.float32)
    model = LlamaModel(cfg, weights)
    for per_seq in (1, 3, 7):
        t = profile_step_costs(model, sizes=(1, 2, 4, 8, 16), reps=2, block_size=4,
                               context_tokens=10, tokens_per_seq=per_seq, budget_s=None)
        assert t.tokens == (1, 2, 4, 8, 16)
        assert all(s > 0 for s in t.seconds) and list(t.seconds) == sorted(t.seconds)
    t = profile_step_costs(model, sizes=(1, 2, 4, 8, 16, 32), reps=1, budget_s=0.0)
    assert t.tokens == (1, 2)  # over budget at once: two points, the rest extrapolated


def test_profile_engine_caps_at_the_token_budget(tiny_llama_path: str):
    engine = LLMEngine(EngineConfig(
        tiny_llama_path, cache=CacheConfig(block_size_tokens=4, num_blocks=16),
        scheduler=SchedulerConfig(max_num_batched_tokens=8)))
    before = engine.kv.k.clone()
    t = profile_engine_step_costs(engine, reps=1, budget_s=None)
    assert t.tokens == (1, 2, 4, 8)
    assert torch.equal(engine.kv.k, before)  # a scratch cache: the engine's is untouched
