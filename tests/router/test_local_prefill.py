"""The conditional-disaggregation rule (`router/local_prefill.py`): which decode worker, if any,
prefills a prompt it caches all but a short tail of."""

from __future__ import annotations

from pdserve.router.local_prefill import LocalCandidate, LocalChoice, choose_cached_local


def test_the_worker_caching_the_most_computes_the_tail():
    cands = [LocalCandidate("d0", 32), LocalCandidate("d1", 48), LocalCandidate("d2", 0)]
    assert choose_cached_local(cands, 60, 64) == LocalChoice(1, 12, 48)


def test_a_tail_longer_than_the_bound_takes_the_normal_path():
    cands = [LocalCandidate("d0", 16)]
    assert choose_cached_local(cands, 81, 64) is None  # 65 tokens to compute
    assert choose_cached_local(cands, 80, 64) == LocalChoice(0, 64, 16)


def test_nothing_cached_or_off_or_busy_is_never_local():
    assert choose_cached_local([LocalCandidate("d0", 0)], 10, 64) is None  # a cold prompt
    assert choose_cached_local([LocalCandidate("d0", 16)], 20, 0) is None  # the rule is off
    assert choose_cached_local([LocalCandidate("d0", 16, waiting=1)], 20, 64) is None
    assert choose_cached_local([LocalCandidate("d0", 16, free_blocks=3)], 20, 64,
                               need_blocks=4) is None
    assert choose_cached_local([LocalCandidate("d0", 16, free_blocks=None)], 20, 64,
                               need_blocks=4) == LocalChoice(0, 4, 16)
    assert choose_cached_local([], 20, 64) is None


def test_the_last_prompt_token_is_always_computed():
    # An index claiming the whole prompt still leaves its last token to compute.
    assert choose_cached_local([LocalCandidate("d0", 32)], 32, 64) == LocalChoice(0, 1, 31)


def test_ties_go_to_the_smaller_batch_then_the_lower_address():
    cands = [LocalCandidate("d2", 32, running=5), LocalCandidate("d1", 32, running=5),
             LocalCandidate("d0", 32, running=9)]
    assert choose_cached_local(cands, 40, 64).index == 1
    cands[0] = LocalCandidate("d2", 32, running=1)
    assert choose_cached_local(cands, 40, 64).index == 0
