"""The prefill deflection (`router/deflect.py`): a request an offload budget fits goes where
its estimated time to first token is lower, the prefill pool or a decode worker, and never past
a budget."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdserve.core.rates import RateMeter
from pdserve.router.deflect import (HANDOFF_S, decode_ttft_s, deflect, pool_side,
                                    request_cost_tokens)
from pdserve.router.membership import DECODE, PREFILL, Member
from pdserve.router.policy import KvAware, LeastLoaded, choose_offload


@dataclass
class Slot:
    address: str
    offload_tokens: int
    offload_budget: int
    offload_chunk: int = 64
    offload_step_s: float = 0.01


def test_nothing_to_choose_when_no_budget_fits():
    assert deflect([], 10, 100.0, 1000.0) is None
    assert deflect([Slot("d0", 90, 100), Slot("d1", 0, 0)], 20, 100.0, 1000.0) is None


def test_the_decode_estimate_is_the_chunks_in_flight_and_this_prompt_a_step_each():
    assert decode_ttft_s(Slot("d0", 100, 1000, 64, 0.01), 100) == 4 * 0.01  # 200 / 64 -> 4
    assert decode_ttft_s(Slot("d0", 0, 1000, 64, 0.01), 64) == 0.01
    assert decode_ttft_s(Slot("d0", 0, 1000, 64, 0.0), 64) is None  # no step time
    assert decode_ttft_s(Slot("d0", 0, 1000, 0, 0.01), 64) is None  # no chunk size


def test_the_lower_estimate_wins_with_both_recorded():
    # The pool: 900 queued + 100 of this prompt at 1000 tokens/s, plus the hand-off.
    slot = Slot("d0", 0, 1000, 50, 0.01)  # 100 tokens: 2 steps, 0.02 s
    d = deflect([slot], 100, 1000.0, 1000.0)
    assert (d.choice, d.index) == (DECODE, 0)
    assert d.prefill_ttft_s == 1.0 + HANDOFF_S and d.decode_ttft_s == 0.02
    assert "decode" in d.reason and "<" in d.reason
    # An idle pool is faster than 2 steps of a busy decode worker: the pool keeps it.
    d = deflect([Slot("d0", 0, 1000, 50, 0.5)], 100, 100.0, 1000.0)
    assert (d.choice, d.index) == (PREFILL, None)
    assert d.prefill_ttft_s == 0.1 + HANDOFF_S and d.decode_ttft_s == 1.0


def test_a_tie_stays_on_the_pool():
    d = deflect([Slot("d0", 0, 1000, 100, 0.5)], 100, 500.0, 1000.0, handoff_s=0.0)
    assert d.decode_ttft_s == d.prefill_ttft_s == 0.5
    assert d.choice == PREFILL


def test_the_fastest_decode_worker_is_weighed_not_the_first():
    slots = [Slot("d0", 900, 1000, 64, 0.01),  # 1000 tokens queued: 16 steps
             Slot("d1", 0, 1000, 64, 0.01),  # 100 tokens: 2 steps
             Slot("d2", 0, 1000, 64, 0.05)]  # slower steps
    d = deflect(slots, 100, 1000.0, 1000.0)
    assert (d.choice, d.index, d.decode_ttft_s) == (DECODE, 1, 0.02)


def test_ties_between_decode_workers_go_to_most_budget_left_then_lowest_address():
    slots = [Slot("d9", 0, 500), Slot("d5", 0, 800), Slot("d1", 0, 800)]
    assert deflect(slots, 64, 1e6, 1.0).index == 2  # d1 and d5 leave 736; d1 sorts first
    # Same, listed in another order: the choice follows the workers, not the list.
    assert deflect(list(reversed(slots)), 64, 1e6, 1.0).index == 0


def test_without_a_measured_rate_nothing_is_deflected_unless_no_prefill_worker_is_active():
    d = deflect([Slot("d0", 0, 1000)], 100, 100.0, None)
    assert (d.choice, d.prefill_ttft_s, d.reason) == (PREFILL, None, "no prefill rate measured")
    assert deflect([Slot("d0", 0, 1000)], 100, 100.0, 0.0).choice == PREFILL
    d = deflect([Slot("d0", 0, 1000)], 100, None, None)
    assert (d.choice, d.index, d.reason) == (DECODE, 0, "no prefill worker active")


def test_a_budget_without_a_step_time_decides_alone_as_the_budget_rule_does():
    slots = [Slot("d0", 0, 300, 64, 0.0), Slot("d1", 100, 800, 64, 0.0)]
    d = deflect(slots, 100, 100.0, None)
    assert (d.choice, d.index, d.decode_ttft_s) == (DECODE, 1, None)
    assert d.index == choose_offload(slots, 100)
    # A worker that can be estimated ranks before one that cannot.
    d = deflect([Slot("d0", 0, 800, 64, 0.0), Slot("d1", 0, 300, 64, 0.01)], 100, 1e6, 1.0)
    assert (d.choice, d.index) == (DECODE, 1)


def test_the_pools_side_is_its_picks_queue_with_this_request_over_its_smoothed_rate():
    rates = RateMeter(min_busy_s=0.01)
    for a in ("p0", "p1"):
        rates.observe(a, 0, 0.0)
    rates.observe("p0", 2000, 1.0)
    rates.observe("p0", 3000, 2.0)  # 1000 tokens/s now: smoothed 1700, its peak 2000
    p0 = Member("p0", PREFILL, in_flight=2, in_flight_tokens=300.0)
    p1 = Member("p1", PREFILL)
    # Its work in flight, this prompt's own (100), and a request's cost for each of the 3.
    assert pool_side(p0, 100.0, 64.0, rates, ["p0", "p1"]) == (592.0, pytest.approx(1700.0))
    assert pool_side(p1, 100.0, 64.0, rates, ["p0", "p1"]) == (
        164.0, pytest.approx(1700.0))  # the pool's mean
    assert pool_side(p1, 100.0, 64.0, RateMeter(), ["p0", "p1"]) == (164.0, None)
    assert pool_side(None, 100.0, 64.0, rates, ["p0"]) == (None, None)
    # A pool with no rate is not read at all while the pick has one of its own.
    assert pool_side(p0, 100.0, 64.0, rates, iter(())) == (592.0, pytest.approx(1700.0))


def test_a_requests_cost_is_the_prefill_policys_own():
    assert request_cost_tokens(KvAware(request_cost_tokens=10.0)) == 10.0
    assert request_cost_tokens(LeastLoaded()) == KvAware().request_cost_tokens == 64.0


def test_membership_members_are_candidates_as_they_are():
    members = [Member("d0", DECODE, offload_budget=64, offload_chunk=16, offload_step_s=0.01),
               Member("d1", DECODE, offload_budget=256, offload_chunk=16, offload_step_s=0.01)]
    d = deflect(members, 64, 500.0, 1000.0)
    assert (d.choice, d.index, d.decode_ttft_s) == (DECODE, 1, 0.04)


slots = st.lists(st.builds(Slot, st.sampled_from(["d0", "d1", "d2", "d3"]),
                           st.integers(0, 2000), st.integers(0, 2000), st.integers(0, 256),
                           st.sampled_from([0.0, 0.001, 0.01, 0.2])), max_size=6)


@given(slots, st.integers(1, 2000), st.one_of(st.none(), st.floats(0, 1e5)),
       st.one_of(st.none(), st.floats(0, 1e5)))
def test_the_choice_fits_its_budget_and_is_never_slower_than_the_pool(cands, prompt, work,
                                                                      rate):
    d = deflect(cands, prompt, work, rate)
    fitting = [i for i, c in enumerate(cands) if c.offload_budget > 0
               and c.offload_tokens + prompt <= c.offload_budget]
    if not fitting:
        assert d is None
        return
    assert d is not None and d.choice in (DECODE, PREFILL)
    if d.choice == PREFILL:
        assert d.index is None
        return
    assert d.index in fitting  # never past a budget
    c = cands[d.index]
    assert c.offload_tokens + prompt <= c.offload_budget
    if d.decode_ttft_s is not None:
        # The fastest fitting worker, and faster than the pool whenever the pool was weighed.
        known = [decode_ttft_s(cands[i], prompt) for i in fitting]
        assert d.decode_ttft_s == min(e for e in known if e is not None)
        if d.prefill_ttft_s is not None:
            assert d.decode_ttft_s < d.prefill_ttft_s
        else:
            assert work is None  # no prefill worker: nothing to weigh against
    # Deterministic: the same inputs, the same choice.
    assert deflect(cands, prompt, work, rate) == d


@given(slots, st.integers(1, 2000), st.floats(1, 1e5), st.floats(1, 1e5))
def test_the_pool_keeps_every_request_it_serves_faster(cands, prompt, work, rate):
    d = deflect(cands, prompt, work, rate)
    if d is None:
        return
    pool_s = work / rate + HANDOFF_S
    known = [e for c in cands if c.offload_budget > 0
             and c.offload_tokens + prompt <= c.offload_budget
             and (e := decode_ttft_s(c, prompt)) is not None]
    if known and min(known) >= pool_s:
        assert d.choice == PREFILL and math.isclose(d.prefill_ttft_s, pool_s)


def test_a_decision_costs_microseconds():
    """It sits on the request path: under a millisecond of CPU time with a few dozen budgets
    (a loose bound: a shared host's noise must not fail it)."""
    cands = [Slot(f"d{i:02d}", (i * 37) % 500, 2000, 64, 0.01 + i * 1e-4) for i in range(32)]
    n = 2000
    started = time.process_time()
    for _ in range(n):
        deflect(cands, 300, 5000.0, 4000.0)
    per_call_s = (time.process_time() - started) / n
    assert per_call_s < 1e-3, per_call_s
