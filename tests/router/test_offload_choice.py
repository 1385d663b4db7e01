"""choose_offload: which decode worker prefills a prompt within its offload budget."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given
from hypothesis import strategies as st

from pdserve.router.membership import DECODE, Member
from pdserve.router.policy import choose_offload


@dataclass
class Slot:
    address: str
    offload_tokens: int
    offload_budget: int


def test_none_without_candidates_or_when_nothing_fits():
    assert choose_offload([], 10) is None
    assert choose_offload([Slot("d0", 90, 100), Slot("d1", 0, 50)], 60) is None


def test_fits_exactly_up_to_the_budget():
    assert choose_offload([Slot("d0", 40, 100)], 60) == 0
    assert choose_offload([Slot("d0", 41, 100)], 60) is None


def test_most_budget_left_wins():
    slots = [Slot("d0", 0, 100), Slot("d1", 100, 300), Slot("d2", 0, 150)]
    assert choose_offload(slots, 50) == 1  # 200 left, against 100 and 150


def test_ties_go_to_the_lowest_address_not_the_first_listed():
    slots = [Slot("d9", 0, 100), Slot("d1", 50, 150), Slot("d5", 0, 100)]
    assert choose_offload(slots, 10) == 1


def test_a_zero_budget_never_takes_work():
    assert choose_offload([Slot("d0", 0, 0)], 0) is None


def test_membership_members_are_candidates_as_they_are():
    members = [Member("d0", DECODE, offload_budget=64), Member("d1", DECODE, offload_budget=256)]
    assert choose_offload(members, 64) == 1


@given(st.lists(st.tuples(st.integers(0, 1000), st.integers(0, 1000)), max_size=8),
       st.integers(0, 1200))
def test_the_choice_fits_and_leaves_no_better_fit(pairs, prompt):
    slots = [Slot(f"d{i}", used, budget) for i, (used, budget) in enumerate(pairs)]
    i = choose_offload(slots, prompt)
    fitting = [s for s in slots if s.offload_budget > 0
               and s.offload_tokens + prompt <= s.offload_budget]
    if i is None:
        assert not fitting
        return
    chosen = slots[i]
    assert chosen in fitting
    left = chosen.offload_budget - chosen.offload_tokens
    assert all(s.offload_budget - s.offload_tokens <= left for s in fitting)
