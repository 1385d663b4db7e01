"""Routing policies as pure cores: plain data in, a decision out (no processes, no clock)."""

from __future__ import annotations

import random

import pytest

from pdserve.router.policy import (
    DecodeChooser, KvAware, LeastLoaded, NoWorkerError, PowerOfTwo, RoundRobin, RouteInput,
    WorkerLoad, make_policy, prefill_parts,
)

BS = 16


def make_worker(i: int = 0, **overrides) -> WorkerLoad:
    fields = dict(address=f"w{i}", in_flight=0)
    return WorkerLoad(**{**fields, **overrides})


def make_input(*workers: WorkerLoad, prompt_tokens: int = 161, store_cached_blocks: int = 0,
               need_blocks: int = 0) -> RouteInput:
    return RouteInput(tuple(workers), prompt_tokens, BS, store_cached_blocks, need_blocks)


# ---- load-only policies -------------------------------------------------------------------------

def test_round_robin_cycles_over_healthy_workers():
    rr = RoundRobin()
    ws = [make_worker(0), make_worker(1, healthy=False), make_worker(2)]
    assert [rr.decide(make_input(*ws)).index for _ in range(4)] == [0, 2, 0, 2]


def test_least_loaded_takes_fewest_in_flight_lowest_index_on_ties():
    ws = [make_worker(0, in_flight=2), make_worker(1, in_flight=1), make_worker(2, in_flight=1)]
    assert LeastLoaded().decide(make_input(*ws)).index == 1


def test_no_healthy_worker_raises():
    for policy in (RoundRobin(), LeastLoaded(), PowerOfTwo(), KvAware(), DecodeChooser()):
        with pytest.raises(NoWorkerError):
            policy.decide(make_input(make_worker(0, healthy=False)))


def test_power_of_two_is_reproducible_with_a_seeded_rng():
    ws = [make_worker(i, in_flight=i % 3) for i in range(8)]
    a = PowerOfTwo(random.Random(7))
    b = PowerOfTwo(random.Random(7))
    picks_a = [a.decide(make_input(*ws)).index for _ in range(50)]
    assert picks_a == [b.decide(make_input(*ws)).index for _ in range(50)]
    assert len(set(picks_a)) > 1  # it does draw


def test_power_of_two_never_takes_the_busier_of_its_two():
    # With two workers both are always drawn, so the idle one must win every time.
    p2c = PowerOfTwo(random.Random(1))
    ws = [make_worker(0, in_flight=5), make_worker(1, in_flight=0)]
    assert {p2c.decide(make_input(*ws)).index for _ in range(20)} == {1}
    # With many, the busiest is never chosen (it loses to whichever it is paired with).
    ws = [make_worker(i, in_flight=1) for i in range(5)] + [make_worker(5, in_flight=9)]
    assert 5 not in {p2c.decide(make_input(*ws)).index for _ in range(200)}


def test_power_of_two_skips_unhealthy_workers():
    p2c = PowerOfTwo(random.Random(3))
    ws = [make_worker(0, healthy=False), make_worker(1, in_flight=4), make_worker(2, healthy=False)]
    assert {p2c.decide(make_input(*ws)).index for _ in range(10)} == {1}


# ---- KV-aware -----------------------------------------------------------------------------------

def test_prefill_parts_reuse_all_but_the_last_token():
    # 161 tokens: 10 full blocks before the last token; 9 cached locally, the store has 10.
    local, fetch, compute = prefill_parts(make_input(store_cached_blocks=10, prompt_tokens=161),
                                          make_worker(cached_blocks=9))
    assert (local, fetch, compute) == (9, 1, 1)
    # 160 tokens: the last token is in block 10, so only 9 blocks are reusable.
    assert prefill_parts(make_input(prompt_tokens=160), make_worker(cached_blocks=10)) == (9, 0, 16)


def test_kv_aware_prefers_the_worker_holding_the_prefix():
    ws = [make_worker(0, cached_blocks=0), make_worker(1, cached_blocks=8)]
    d = KvAware().decide(make_input(*ws))
    assert d.index == 1
    s0, s1 = d.scores
    assert (s1.local_blocks, s1.compute_tokens) == (8, 161 - 8 * BS)
    assert s0.compute_tokens == 161 and s1.cost < s0.cost
    assert d.work_tokens == s1.work_tokens == s1.compute_tokens  # nothing fetched


def test_kv_aware_yields_to_load_when_the_load_gap_outweighs_the_prefix():
    cached = make_worker(0, cached_blocks=8, in_flight=3, in_flight_tokens=600)
    idle = make_worker(1)
    d = KvAware(request_cost_tokens=16).decide(make_input(cached, idle))
    # cost0 = 33 + 600 + 48 = 681 > cost1 = 161: the saved 128 tokens do not pay for the queue.
    assert d.index == 1
    assert d.scores[0].cost == pytest.approx(33 + 600 + 3 * 16)
    assert d.scores[1].cost == pytest.approx(161)
    # A small queue does not outweigh it.
    light = make_worker(0, cached_blocks=8, in_flight=1, in_flight_tokens=50)
    assert KvAware(request_cost_tokens=16).decide(make_input(light, idle)).index == 0
    # ...but the fixed cost of each request in flight counts too.
    assert KvAware(request_cost_tokens=80).decide(make_input(light, idle)).index == 1


def test_kv_aware_counts_store_blocks_at_the_fetch_weight():
    # Both workers can fetch the 10 stored blocks; worker 1 holds 4 of them itself.
    ws = [make_worker(0), make_worker(1, cached_blocks=4)]
    d = KvAware(fetch_weight=0.25).decide(make_input(*ws, store_cached_blocks=10))
    assert d.index == 1
    assert d.scores[0].cost == pytest.approx(1 + 0.25 * 10 * BS)
    assert d.scores[1].cost == pytest.approx(1 + 0.25 * 6 * BS)
    assert (d.scores[1].local_blocks, d.scores[1].fetch_blocks) == (4, 6)
    assert d.work_tokens == pytest.approx(1 + 0.25 * 6 * BS)  # what the pool counts in flight
    # fetch_weight 0: the store makes both equally cheap; the tie goes to the lower index.
    assert KvAware(fetch_weight=0).decide(make_input(*ws, store_cached_blocks=10)).index == 0


def test_kv_aware_with_zero_overlap_weight_is_pure_load_balancing():
    ws = [make_worker(0, cached_blocks=10, in_flight=1, in_flight_tokens=10), make_worker(1)]
    assert KvAware(overlap_weight=0).decide(make_input(*ws)).index == 1


def test_kv_aware_temperature_samples_reproducibly():
    ws = [make_worker(0, cached_blocks=2), make_worker(1, cached_blocks=3), make_worker(2)]
    a = KvAware(temperature=1.0, rng=random.Random(5))
    b = KvAware(temperature=1.0, rng=random.Random(5))
    picks = [a.decide(make_input(*ws)).index for _ in range(60)]
    assert picks == [b.decide(make_input(*ws)).index for _ in range(60)]
    assert len(set(picks)) > 1


def test_kv_aware_rejects_negative_weights():
    with pytest.raises(ValueError, match="fetch_weight"):
        KvAware(fetch_weight=-1)


# ---- decode -------------------------------------------------------------------------------------

def test_decode_takes_the_smallest_batch_among_workers_with_room():
    ws = [make_worker(0, free_blocks=100, running=4), make_worker(1, free_blocks=3, running=0),
          make_worker(2, free_blocks=50, running=2, waiting=1)]
    d = DecodeChooser().decide(make_input(*ws, need_blocks=10))
    assert (d.index, d.fits) == (2, True)  # worker 1 has the smallest batch but no room


def test_decode_counts_the_routers_own_in_flight_when_reports_lag():
    ws = [make_worker(0, free_blocks=100, running=1, in_flight=5),
          make_worker(1, free_blocks=100, running=3)]
    assert DecodeChooser().decide(make_input(*ws, need_blocks=1)).index == 1


def test_decode_without_room_takes_the_most_free_blocks():
    ws = [make_worker(0, free_blocks=2), make_worker(1, free_blocks=5, running=9),
          make_worker(2)]  # never reported
    d = DecodeChooser().decide(make_input(*ws, need_blocks=10))
    assert (d.index, d.fits) == (1, False)


def test_make_policy_names():
    for name in ("round_robin", "least_loaded", "power_of_two", "kv_aware", "free_kv"):
        assert make_policy(name).name == name
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("random")


# ---- KV-aware over the holders and a load order -------------------------------------------------

def _sparse_case(rng: random.Random, n: int):
    from dataclasses import replace

    # Few distinct loads, so ties on cost, load and requests in flight are common; a few
    # tiny fractions make float rounding merge costs of different loads.
    workers = [make_worker(i, in_flight=rng.randrange(3),
                           in_flight_tokens=rng.choice([0, 0, 64, 128, 1e-13, 2e-13, 300.5]),
                           healthy=rng.random() > 0.1) for i in range(n)]
    cached = {i: rng.randrange(1, 12) for i in rng.sample(range(n), rng.randrange(n // 2 + 1))}
    full = [replace(w, cached_blocks=cached.get(i, 0)) for i, w in enumerate(workers)]
    return workers, cached, full


def test_sparse_kv_aware_choice_equals_scoring_every_worker():
    from pdserve.router.policy import LoadOrder

    rng = random.Random(7)
    for trial in range(3000):
        n = rng.randrange(1, 12)
        workers, cached, full = _sparse_case(rng, n)
        policy = KvAware(overlap_weight=rng.choice([1.0, 0.5, 3.0, 1e15]),
                         fetch_weight=rng.choice([0.0, 0.2]),
                         request_cost_tokens=rng.choice([0.0, 64.0]))
        order = LoadOrder()
        for i, w in enumerate(workers):
            if w.healthy:
                order.set(i, policy.load_of(w), w.in_flight)
        prompt = rng.randrange(1, 200)
        store = rng.randrange(8)
        try:
            want = policy.decide(make_input(*full, prompt_tokens=prompt,
                                            store_cached_blocks=store))
        except NoWorkerError:
            with pytest.raises(NoWorkerError):
                policy.decide_sparse(make_input(*workers, prompt_tokens=prompt,
                                                store_cached_blocks=store), cached, order)
            continue
        got = policy.decide_sparse(make_input(*workers, prompt_tokens=prompt,
                                              store_cached_blocks=store), cached, order)
        assert (got.index, got.work_tokens) == (want.index, want.work_tokens), trial
        assert set(got.scores) <= set(want.scores)


def test_load_order_follows_updates_and_discards():
    from pdserve.router.policy import LoadOrder

    order = LoadOrder()
    for i, load in enumerate([5.0, 1.0, 1.0, 0.0]):
        order.set(i, load, 0)
    assert order.cheapest(lambda load: load, set()) == 3
    order.set(3, 9.0, 0)  # its load grew
    assert order.cheapest(lambda load: load, set()) == 1  # ties go to the lower index
    assert order.cheapest(lambda load: load, {1}) == 2
    order.discard(1)
    order.discard(2)
    assert len(order) == 2 and order.cheapest(lambda load: load, set()) == 0
    assert order.cheapest(lambda load: load, {0, 3}) is None


def test_sparse_decode_choice_equals_a_pass_over_every_worker():
    from pdserve.router.policy import LoadOrder

    rng = random.Random(9)
    chooser = DecodeChooser()
    fitted = unfitted = 0
    for trial in range(3000):
        n = rng.randrange(1, 10)
        workers = [make_worker(i, in_flight=rng.randrange(3), running=rng.randrange(3),
                               waiting=rng.randrange(2), healthy=rng.random() > 0.1,
                               free_blocks=rng.choice([None, 0, 2, 5, 5, 9]))
                   for i in range(n)]
        batch_order, free_order = LoadOrder(), LoadOrder()
        for i, w in enumerate(workers):
            if w.healthy:
                batch_order.set(i, *chooser.by_batch(w))
                free_order.set(i, *chooser.by_free(w))
        inp = make_input(*workers, need_blocks=rng.randrange(8))
        try:
            want = chooser.decide(inp)
        except NoWorkerError:
            with pytest.raises(NoWorkerError):
                chooser.decide_sparse(inp, batch_order, free_order)
            continue
        got = chooser.decide_sparse(inp, batch_order, free_order)
        assert (got.index, got.fits) == (want.index, want.fits), trial
        fitted += want.fits
        unfitted += not want.fits
    assert fitted > 500 and unfitted > 500  # both branches are exercised
