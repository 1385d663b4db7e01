"""One route for the live router and the simulator (`router/route.py`): from the same
membership, loads, measured prefill rates, offload budgets and cached prefixes, `plan` over the
live `WorkerSet` and over the simulated router takes the same path to the same worker, makes
the same prefill deflection from the same estimates, counts the same work on it,
and after a failure (a local hop refused, the prefill pool emptied, workers draining or
failed) the next plan agrees too. The simulated cluster's arrivals call the same `plan`
(checked by its reports staying byte-identical: `.ci/compiled`, and
`test_the_simulator_routes_through_the_live_route`)."""

from __future__ import annotations

import random

from pdserve.core.block_hash import prompt_block_hashes
from pdserve.proto import worker_pb2 as wpb
from pdserve.router.kv_feed import KvFeeds
from pdserve.router.kv_index import STORED, KvEvent
from pdserve.router.deflect import HANDOFF_S
from pdserve.router.membership import ACTIVE, DRAINING, FAILED
from pdserve.router.policy import make_policy
from pdserve.router.picks import LiveRequest
from pdserve.router.pool import WorkerSet
from pdserve.router.route import (CACHED_LOCAL, DECODE_FALLBACK, DISAGGREGATED, FALL_THROUGH,
                                  FALLBACK, GIVE_UP, LOCAL_HOP, OFFLOAD, PREFILL_HOP, Failure,
                                  after_failure, plan)
from pdserve.router.retry import RetryPolicy
from pdserve.sim.config import SimConfig
from pdserve.sim.router import MODEL_ID, SimRouter

BS = 16


class SimArrival:
    """One simulated request as `plan` sees the simulated router: the bindings the simulated
    cluster makes (`sim/arrival.py`: `take_*` of request i)."""

    def __init__(self, sim: SimRouter, cached: dict[str, int], prompt_tokens: int,
                 out: int, hashes) -> None:
        self.sim, self.cached, self.prompt_tokens, self.out, self.hashes = (
            sim, cached, prompt_tokens, out, hashes)

    def take_cached_local(self, _request, limit):
        return self.sim.take_cached_local(self.cached, self.prompt_tokens, self.out, limit)

    def take_offload(self, _request, prefill):
        return self.sim.take_offload(self.prompt_tokens, prefill)

    def choose_prefill(self, _request):
        return self.sim.choose_prefill(self.prompt_tokens, self.hashes)

    def take_prefill(self, _request, exclude, chosen=None):
        return self.sim.take_prefill(self.prompt_tokens, self.hashes, chosen)


def _stats(rng: random.Random, role: str, totals: list[float] | None = None
           ) -> wpb.WorkerStats:
    """A random report; with `totals` ([tokens, busy seconds] so far, advanced here), its
    counters grow as a working prefill worker's do, so the routers measure its rate."""
    if totals is None:
        tokens, busy = rng.randrange(10_000), 1.0
    else:
        totals[0] += rng.randrange(100, 5000)
        totals[1] += rng.uniform(0.1, 1.0)
        tokens, busy = totals
    return wpb.WorkerStats(
        role=wpb.ROLE_PREFILL if role == "prefill" else wpb.ROLE_DECODE,
        num_running=rng.randrange(0, 8), num_waiting=rng.randrange(0, 3),
        num_free_blocks=rng.randrange(0, 300), num_total_blocks=300,
        prompt_tokens_computed=int(tokens), busy_seconds=busy)


def _same(live_route, sim_route, step):
    assert live_route.kind == sim_route.kind, step
    assert live_route.address == sim_route.address, step
    assert live_route.chunk_tokens == sim_route.chunk_tokens, step
    assert live_route.cached_tokens == sim_route.cached_tokens, step
    assert (live_route.taken is None) == (sim_route.taken is None), step
    # The prefill deflection: the same choice from the same estimates, for the same reason.
    assert live_route.deflection == sim_route.deflection, step
    if live_route.taken is not None:
        assert tuple(live_route.taken) == tuple(sim_route.taken), step


def test_plans_and_replans_after_failures_agree_live_and_simulated():
    prefill, decode = ["p0", "p1"], ["d0", "d1", "d2"]
    roles = {**{a: "prefill" for a in prefill}, **{a: "decode" for a in decode}}
    feeds = KvFeeds()  # never started: the test feeds its index, as the streams would
    live = WorkerSet(prefill, decode, prefill_policy=make_policy("kv_aware", seed=3),
                     decode_policy=make_policy("free_kv", seed=4), block_size_tokens=BS,
                     feeds=feeds, stats_interval_s=0)
    for a in roles:
        feeds.block_sizes[a] = BS
        feeds.model_ids[a] = MODEL_ID
    sim = SimRouter(SimConfig(prefill_workers=2, decode_workers=3, seed=3,
                              prefill_policy="kv_aware"), roles)
    rng = random.Random(11)
    convs = [list(range(s * 1000, s * 1000 + 500)) for s in range(1, 6)]
    kinds: dict[str, int] = {}
    deflections: dict[tuple[str, bool], int] = {}  # (choice, both sides estimated) -> count
    totals = {a: [0.0, 0.0] for a in prefill}
    held = []
    try:
        for step in range(300):
            prompt = rng.choice(convs)[:rng.randrange(17, 500)]
            hashes = prompt_block_hashes(prompt[:-1], BS)
            out = rng.randrange(1, 200)
            limit = rng.choice((0, 16, 64, 300))
            r = rng.random()
            if r < 0.35:  # a worker caches a prefix of a conversation
                event = KvEvent(rng.choice(list(roles)), STORED,
                                tuple(hashes[:rng.randrange(len(hashes) + 1)]))
                feeds.index.apply(event)
                sim.index.apply(event)
            elif r < 0.55:  # a worker reports its load
                a = rng.choice(list(roles))
                stats = _stats(rng, roles[a], totals.get(a))
                live.report(a, stats, now=0.0, asked_s=0.0)
                sim.report(a, roles[a], stats, 0.0)
            elif r < 0.65:  # the controller's offload budgets
                # Steps of every kind: none given (the budget decides), short (a decode
                # worker is faster than the pool's queue), long (the pool is).
                budgets = {a: (rng.choice((0, 0, 200, 800)), rng.choice((16, 64)),
                               rng.choice((0.0, 0.0005, 0.005, 0.05))) for a in decode}
                live.set_offload_budgets(budgets)
                sim.set_budgets(budgets)
            elif r < 0.85:  # a worker, or the whole prefill pool, drains, fails or is back
                state = rng.choice((ACTIVE, ACTIVE, DRAINING, FAILED))
                for a in (prefill if r >= 0.8 else [rng.choice(list(roles))]):
                    live.set_state(a, state, None, "test")
                    sim.set_state(a, state, None, "test", 0.0)
            cached = {a: n for a in decode if (n := sim.index.overlap(a, hashes))}
            request = LiveRequest(prompt, "", out)
            arrival = SimArrival(sim, cached, len(prompt), out, hashes)
            after = ""
            while True:
                lr = plan(live, request, limit, after)
                sr = plan(arrival, None, limit, after)
                _same(lr, sr, step)
                kinds[lr.kind] = kinds.get(lr.kind, 0) + 1
                if lr.deflection is not None:
                    d = lr.deflection
                    key = (d.choice, None not in (d.prefill_ttft_s, d.decode_ttft_s))
                    deflections[key] = deflections.get(key, 0) + 1
                if lr.taken is not None:
                    held.append((lr.address, lr.taken))
                if lr.kind not in (CACHED_LOCAL, OFFLOAD) or rng.random() < 0.5:
                    break
                # The local hop refused before a token: both plan on from the next path.
                n = after_failure(Failure(LOCAL_HOP, "UNAVAILABLE", lr.address), RetryPolicy())
                assert n.action == FALL_THROUGH
                after = lr.kind
            if lr.kind == DECODE_FALLBACK:  # no prefill worker active, live or simulated
                assert not [m for m in live.members() if m.role == "prefill"
                            and m.state == ACTIVE]
                assert after_failure(Failure(PREFILL_HOP, None), RetryPolicy()).action == \
                    FALLBACK
            while held and rng.random() < 0.7:  # requests end
                address, taken = held.pop(rng.randrange(len(held)))
                live.release_taken(address, taken)
                sim.release(address, *taken)
            assert {m.address: (m.in_flight, m.in_flight_tokens, m.offload_tokens)
                    for m in live.members()} == \
                {m.address: (m.in_flight, m.in_flight_tokens, m.offload_tokens)
                 for m in sim.members()}, step
        # Every path was taken, so the comparison covered each.
        assert all(kinds.get(k, 0) > 5 for k in (CACHED_LOCAL, OFFLOAD, DISAGGREGATED,
                                                 DECODE_FALLBACK)), kinds
        # Both choices were made from both estimates: the pool kept some, decode took some.
        assert deflections.get(("decode", True), 0) > 5, deflections
        assert deflections.get(("prefill", True), 0) > 5, deflections
    finally:
        live.close()


def test_the_prefill_deflection_chooses_alike_live_and_simulated():
    """The same pool, rates and budgets: an idle prefill pool keeps a request, a decode
    worker whose short steps beat the pool's queue takes it, both routers alike, with the same
    estimates; a request deflected leaves nothing counted on the prefill pick."""
    roles = {"p0": "prefill", "d0": "decode", "d1": "decode"}
    live = WorkerSet(["p0"], ["d0", "d1"], prefill_policy=make_policy("least_loaded"),
                     decode_policy=make_policy("free_kv"), block_size_tokens=BS,
                     stats_interval_s=0)
    sim = SimRouter(SimConfig(prefill_workers=1, decode_workers=2, prefill_policy="least_loaded"),
                    roles)
    try:
        for busy_s, tokens in ((0.0, 0), (1.0, 1000)):  # p0 measured at 1000 tokens/s
            stats = wpb.WorkerStats(role=wpb.ROLE_PREFILL, prompt_tokens_computed=tokens,
                                    busy_seconds=busy_s)
            live.report("p0", stats, now=0.0, asked_s=0.0)
            sim.report("p0", "prefill", stats, 0.0)
        # 400-token prompts in 64-token chunks: 7 steps of 0.1 s (0.7 s) or 0.01 s (0.07 s).
        budgets = {"d0": (2000, 64, 0.1), "d1": (2000, 64, 0.1)}
        live.set_offload_budgets(budgets)
        sim.set_budgets(budgets)
        prompt = list(range(400))
        request = LiveRequest(prompt, "", 8)
        arrival = SimArrival(sim, {}, len(prompt), 8, prompt_block_hashes(prompt[:-1], BS))
        routes = [plan(live, request, 0), plan(arrival, None, 0)]
        _same(*routes, "idle pool")
        d = routes[0].deflection
        assert routes[0].kind == DISAGGREGATED and d.choice == "prefill"
        # Its 400 tokens and a request's cost (64 tokens) at 1000 tokens/s, plus the hand-off.
        assert (d.prefill_ttft_s, d.decode_ttft_s) == (0.464 + HANDOFF_S, 7 * 0.1)
        # With that one queued on p0 (0.928 s for the next) and d1's steps shorter, d1 wins.
        budgets = {"d0": (2000, 64, 0.1), "d1": (2000, 64, 0.01)}
        live.set_offload_budgets(budgets)
        sim.set_budgets(budgets)
        routes = [plan(live, request, 0), plan(arrival, None, 0)]
        _same(*routes, "queued pool")
        d = routes[0].deflection
        assert (routes[0].kind, routes[0].address, d.choice) == (OFFLOAD, "d1", "decode")
        assert (d.prefill_ttft_s, d.decode_ttft_s) == (0.928 + HANDOFF_S, 7 * 0.01)
        assert [(m.in_flight, m.in_flight_tokens, m.offload_tokens) for m in live.members()] \
            == [(m.in_flight, m.in_flight_tokens, m.offload_tokens) for m in sim.members()] \
            == [(0, 0.0, 0), (1, 0.0, 400), (1, 400.0, 0)]  # d0, d1, p0
    finally:
        live.close()


def test_after_failure_gives_the_live_routers_decisions():
    retry = RetryPolicy(max_attempts=2)
    # A prefill refused, then refused again: re-routed once, then a decode worker prefills it.
    assert after_failure(Failure(PREFILL_HOP, "UNAVAILABLE", "p0", 1), retry).action == "retry"
    assert after_failure(Failure(PREFILL_HOP, "UNAVAILABLE", "p1", 2), retry).action == FALLBACK
    # A bad request is bad everywhere: the client gets it as it is.
    n = after_failure(Failure(PREFILL_HOP, "INVALID_ARGUMENT", "p0"), retry)
    assert (n.action, n.status) == (GIVE_UP, "INVALID_ARGUMENT")
    # A decode stream that broke after tokens is resumed; one that broke before is re-routed.
    assert after_failure(Failure("decode", "UNAVAILABLE", "d0", 1, relayed=True),
                         retry).action == "resume"
    assert after_failure(Failure("decode", "UNAVAILABLE", "d0", 1), retry).action == "retry"
    # Out of resumes: UNAVAILABLE for the client; INTERNAL from a worker is UNAVAILABLE too.
    n = after_failure(Failure("decode", "INTERNAL", "d0", 1, relayed=True, resumes=3), retry)
    assert (n.action, n.status) == (GIVE_UP, "UNAVAILABLE")
    # The client left: nothing to send.
    n = after_failure(Failure("decode", "CANCELLED", "d0", client_left=True), retry)
    assert (n.action, n.status) == (GIVE_UP, None)
    # No decode worker: each left out once gets another chance, then UNAVAILABLE.
    assert after_failure(Failure("decode", None, excluded=True), retry).clear_excluded
    n = after_failure(Failure("decode", None), retry)
    assert (n.action, n.status) == (GIVE_UP, "UNAVAILABLE")


def test_the_simulator_routes_through_the_live_route(monkeypatch):
    """The simulated cluster's arrivals take their path from `route.plan`: a plan that says
    otherwise changes where the simulator sends requests."""
    import pdserve.sim.arrival as arrival_mod
    from pdserve.router.route import Route
    from pdserve.core.step_profile import load_profile
    from pdserve.sim.run import simulate
    from pdserve.sim.trace import load_trace

    requests = load_trace("synthetic:poisson:rate=20,n=200,in=256,out=32", seed=0)
    cfg = SimConfig(prefill_workers=2, decode_workers=2, seed=0)
    base_report = simulate(cfg, requests, load_profile("h100-llama3-8b"))
    base = base_report.summary()
    calls = []

    def fallback_only(workers, request, limit, after=""):
        calls.append(request)
        return Route(DECODE_FALLBACK)

    monkeypatch.setattr(arrival_mod, "plan", fallback_only)
    forced = simulate(cfg, requests, load_profile("h100-llama3-8b"))
    assert len(calls) == len(requests)
    prefill = {"w0000", "w0001"}  # the first workers are the prefill pool
    assert set(base_report.prefill_worker) & prefill
    assert not set(forced.prefill_worker) & prefill  # every prompt prefilled on a decode worker
    assert forced.summary() != base
