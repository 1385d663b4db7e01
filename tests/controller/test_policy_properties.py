"""Property tests: one per rule of the controller policy, over random workers and pressures.

Settings are derandomized (the same examples every run) and sized to run in seconds.
"""

from __future__ import annotations

import dataclasses
import math

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from pdserve.controller.policy import (DECODE, DRAINING, GONE, PREFILL, ROLES, SERVING, STATES,
                                       SWITCHING, ControllerInput, PolicyConfig, PolicyState,
                                       WorkerView, decide, plan_rebalance)
from pdserve.controller.signals import DecodePressure, PrefillPressure, Slo

DETERMINISTIC = settings(max_examples=200, deadline=None, derandomize=True, database=None,
                         suppress_health_check=[HealthCheck.too_slow])
OTHER = {PREFILL: DECODE, DECODE: PREFILL}

times = st.floats(0, 200)
# Calm, at the default thresholds, and hot, so that holds and flips both come up often.
ratios = st.one_of(st.floats(0, 4), st.sampled_from([0.0, 0.2, 0.5, 1.0, 1.5, 3.0]))
slos = st.builds(Slo, ttft_s=st.floats(0.1, 10), itl_s=st.floats(0.02, 1),
                 ttft_share=st.floats(0.05, 1))
states = st.sampled_from([SERVING] * 16 + list(STATES))


@st.composite
def configs(draw) -> PolicyConfig:
    high = draw(st.floats(0.2, 2))
    return PolicyConfig(
        max_flips_per_tick=draw(st.integers(0, 3)), cooldown_s=draw(st.floats(0, 60)),
        min_per_role=draw(st.integers(0, 2)), sustain_s=draw(st.floats(0, 10)), high=high,
        low=high * draw(st.floats(0.05, 1)), offload_itl_share=draw(st.floats(0.1, 1)),
        offload_kv_max=draw(st.sampled_from([0.7, 1.0]) | st.floats(0, 1)),
        offload_max_tokens=draw(st.sampled_from([4096, 64]) | st.integers(0, 8192)),
        offload_min_chunk_tokens=draw(st.integers(1, 64)))


@st.composite
def a_worker(draw, address: str, only_serving: bool = False) -> WorkerView:
    role = draw(st.sampled_from(ROLES))
    state = SERVING if only_serving else draw(states)
    total = draw(st.integers(0, 200))
    flipping = state in (DRAINING, SWITCHING) and draw(st.booleans())
    return WorkerView(
        address, role, state, pinned=draw(st.integers(0, 4)) == 0,
        last_flip_s=draw(st.none() | times), running=draw(st.integers(0, 8)),
        waiting=draw(st.sampled_from([0, 0, 0, 1, 3])),
        kv_used_blocks=draw(st.sampled_from([0, total // 2]) | st.integers(0, total)),
        kv_total_blocks=total, queued_prompt_tokens=draw(st.floats(0, 5000)),
        prefill_tokens_per_s=draw(st.none() | st.floats(1, 1e5)),
        decode_step_s=draw(st.none() | st.floats(0, 0.5)),
        to_role=OTHER[role] if flipping else None)


@st.composite
def fleets(draw, min_size: int = 0, max_size: int = 8, only_serving: bool = False):
    n = draw(st.integers(min_size, max_size))
    # Half the fleets all serving: one worker mid-flip holds every pressure-driven flip.
    only_serving = only_serving or draw(st.booleans())
    return tuple(draw(a_worker(f"w{i}", only_serving)) for i in range(n))


def pressures(prefill: float, decode: float, tokens_per_s: float = 1000.0):
    return (PrefillPressure(prefill, prefill, prefill * tokens_per_s, tokens_per_s),
            DecodePressure(decode, 0.0, 0.0, decode, 0.0))


@st.composite
def inputs(draw, target: bool | None = None, both_hot: bool = False
           ) -> tuple[ControllerInput, float, PolicyConfig]:
    """(input, now, config); `target`: None either way, True always, False never."""
    cfg = draw(configs())
    hot = st.floats(cfg.high, cfg.high + 3, exclude_min=True)
    cold = st.floats(0, cfg.low).map(lambda r: r * 0.99)  # below low (unless low is 0)
    edge = st.sampled_from([cfg.low, cfg.high])
    # One role hot and the other cold is where flips and budgets happen: draw it on purpose.
    kind = "both" if both_hot else draw(st.sampled_from(["prefill", "decode", "any"]))
    p_ratio, d_ratio = {"both": (hot, hot), "prefill": (hot, cold), "decode": (cold, hot),
                        "any": (ratios | edge, ratios | edge)}[kind]
    workers = draw(fleets())
    now = draw(times)
    # Half the time both roles are past sustain_s, so the rules after that gate get exercised.
    held_s = (st.floats(cfg.sustain_s + 0.01, cfg.sustain_s + 20) if draw(st.booleans())
              else st.one_of(st.floats(0, 20), st.none()))
    state = PolicyState(*(None if h is None else now - h for h in (draw(held_s), draw(held_s))))
    split = None
    if target or (target is None and draw(st.booleans())):
        n = sum(1 for w in workers if w.state != GONE)
        p = draw(st.integers(0, n + 1))  # sometimes the wrong size
        split = (p, max(0, n - p))
    pre, dec = pressures(draw(p_ratio), draw(d_ratio), draw(st.floats(1, 1e5)))
    return ControllerInput(workers, pre, dec, draw(slos), state, split), now, cfg


def counted(workers) -> dict[str, int]:
    out = {PREFILL: 0, DECODE: 0}
    for w in workers:
        if w.state != GONE:
            out[w.to_role or (OTHER[w.role] if w.state == SWITCHING else w.role)] += 1
    return out


def apply(workers, flips, now: float):
    to = {f.address: f.to_role for f in flips}
    return tuple(dataclasses.replace(w, role=to[w.address], last_flip_s=now)
                 if w.address in to else w for w in workers)


# ---- every mode ---------------------------------------------------------------------------------

@DETERMINISTIC
@given(inputs())
def test_at_most_max_flips_per_tick(case):
    inp, now, cfg = case
    assert len(decide(inp, now, cfg).flips) <= cfg.max_flips_per_tick


@DETERMINISTIC
@given(inputs())
def test_only_serving_unpinned_workers_flip_and_workers_are_conserved(case):
    inp, now, cfg = case
    d = decide(inp, now, cfg)
    by_address = {w.address: w for w in inp.workers}
    assert len({f.address for f in d.flips}) == len(d.flips)
    for f in d.flips:
        w = by_address[f.address]
        assert w.state == SERVING and not w.pinned and w.to_role is None
        assert f.from_role == w.role and f.to_role == OTHER[w.role]
    after = apply(inp.workers, d.flips, now)
    assert [w.address for w in after] == [w.address for w in inp.workers]
    assert sum(counted(after).values()) == sum(counted(inp.workers).values())


@DETERMINISTIC
@given(inputs(), st.randoms(use_true_random=False))
def test_decide_is_deterministic_and_ignores_worker_order(case, rng):
    inp, now, cfg = case
    d = decide(inp, now, cfg)
    assert decide(inp, now, cfg) == d
    shuffled = list(inp.workers)
    rng.shuffle(shuffled)
    assert decide(dataclasses.replace(inp, workers=tuple(shuffled)), now, cfg) == d


# ---- pressure mode ------------------------------------------------------------------------------

@DETERMINISTIC
@given(inputs(target=False))
def test_cooldown_is_respected(case):
    inp, now, cfg = case
    by_address = {w.address: w for w in inp.workers}
    for f in decide(inp, now, cfg).flips:
        last = by_address[f.address].last_flip_s
        assert last is None or now - last >= cfg.cooldown_s


@DETERMINISTIC
@given(inputs(target=False))
def test_the_giving_role_keeps_its_floor(case):
    inp, now, cfg = case
    d = decide(inp, now, cfg)
    for role in ROLES:
        before = sum(1 for w in inp.workers if w.role == role and w.state == SERVING)
        after = sum(1 for w in apply(inp.workers, d.flips, now)
                    if w.role == role and w.state == SERVING)
        if before >= cfg.min_per_role:
            assert after >= cfg.min_per_role


@DETERMINISTIC
@given(inputs(target=False, both_hot=True))
def test_no_flip_when_both_roles_are_pressured(case):
    inp, now, cfg = case
    d = decide(inp, now, cfg)
    assert d.flips == () and "both roles pressured" in d.reason


@DETERMINISTIC
@given(fleets(min_size=2, only_serving=True), configs(),
       st.lists(st.tuples(st.integers(1, 10), st.floats(0.1, 5), ratios, ratios), min_size=1,
                max_size=8))
def test_flips_go_toward_the_pressured_role_only_after_sustain(workers, cfg, spells):
    # Pressure comes in spells of several ticks, as bursts do, so that sustain is reached.
    ticks = [(dt, p, d) for n, dt, p, d in spells for _ in range(n)]
    state, now = PolicyState(), 0.0
    onset: dict[str, float | None] = {PREFILL: None, DECODE: None}
    for dt, p, d in ticks:
        now += dt
        ratio = {PREFILL: p, DECODE: d}
        for role in ROLES:  # when the current run of pressure above `high` began
            onset[role] = (onset[role] if onset[role] is not None else now
                           ) if ratio[role] > cfg.high else None
        decision = decide(ControllerInput(workers, *pressures(p, d), Slo(), state), now, cfg)
        for f in decision.flips:
            assert ratio[f.to_role] > cfg.high and ratio[f.from_role] < cfg.low
            assert now - onset[f.to_role] >= cfg.sustain_s
        state, workers = decision.state, apply(workers, decision.flips, now)


# ---- FluidToken ---------------------------------------------------------------------------------

@DETERMINISTIC
@given(inputs())
def test_budgets_go_to_serving_decode_workers_and_keep_the_itl_bound(case):
    inp, now, cfg = case
    d = decide(inp, now, cfg)
    if inp.prefill.ratio <= cfg.high or not cfg.fluid_token:
        assert d.budgets == ()
    by_address = {w.address: w for w in inp.workers}
    flipped = {f.address for f in d.flips}
    for b in d.budgets:
        w = by_address[b.address]
        assert w.role == DECODE and w.state == SERVING and b.address not in flipped
        assert w.kv_used_blocks / w.kv_total_blocks <= cfg.offload_kv_max
        assert cfg.offload_min_chunk_tokens <= b.chunk_tokens <= b.max_tokens
        assert b.max_tokens <= cfg.offload_max_tokens
        step_s = w.decode_step_s if w.decode_step_s is not None else inp.slo.itl_s / 2
        tps = w.prefill_tokens_per_s or inp.prefill.tokens_per_s
        assert step_s + b.chunk_tokens / tps <= cfg.offload_itl_share * inp.slo.itl_s
        assert math.isclose(b.step_s, step_s + b.chunk_tokens / tps)
        # One chunk a step, the whole budget prefills within the TTFT share, and no less fits.
        share_s = inp.slo.ttft_share * inp.slo.ttft_s
        assert (b.max_tokens // b.chunk_tokens) * b.step_s <= share_s * (1 + 1e-9)
        assert b.max_tokens == min(cfg.offload_max_tokens,
                                   b.chunk_tokens * math.floor(share_s / b.step_s))


# ---- operator target ----------------------------------------------------------------------------

@DETERMINISTIC
@given(inputs(target=True))
def test_no_flip_moves_away_from_the_target(case):
    inp, now, cfg = case
    want = dict(zip(ROLES, inp.target))
    have = counted(inp.workers)
    d = decide(inp, now, cfg)
    for f in d.flips:
        assert want[f.to_role] > have[f.to_role]
    after = counted(apply(inp.workers, d.flips, now))
    if d.flips:
        to_role = d.flips[0].to_role
        assert have[to_role] < after[to_role] <= want[to_role]


@DETERMINISTIC
@given(fleets(max_size=8, only_serving=True), st.data(), st.integers(1, 3), ratios, ratios)
def test_repeated_ticks_converge_to_the_target(workers, data, per_tick, p, d):
    prefill = data.draw(st.integers(0, len(workers)))
    target = (prefill, len(workers) - prefill)
    have = counted(workers)[PREFILL]
    givers = [w for w in workers if w.role == (DECODE if prefill > have else PREFILL)]
    assume(sum(1 for w in givers if not w.pinned) >= abs(prefill - have))  # no pin blocks it
    cfg = PolicyConfig(max_flips_per_tick=per_tick)
    state = PolicyState()
    for tick in range(len(workers) + 1):
        decision = decide(ControllerInput(workers, *pressures(p, d), Slo(), state, target),
                          float(tick), cfg)
        state, workers = decision.state, apply(workers, decision.flips, float(tick))
    assert counted(workers)[PREFILL] == prefill


@settings(DETERMINISTIC, max_examples=300)
@given(fleets(), st.data())
def test_plan_rebalance_reaches_exactly_the_split_when_feasible(workers, data):
    live = [w for w in workers if w.state != GONE]
    prefill = data.draw(st.integers(0, len(live)))
    decode = len(live) - prefill
    have = counted(workers)
    to_role = PREFILL if prefill > have[PREFILL] else DECODE
    short = abs(prefill - have[PREFILL])
    movable = [w for w in live if w.role == OTHER[to_role] and w.state == SERVING
               and not w.pinned and w.to_role is None]
    try:
        plan = plan_rebalance(workers, prefill, decode)
    except ValueError:
        assert len(movable) < short
        return
    assert len(plan) == short  # the fewest flips
    assert {f.address for f in plan} <= {w.address for w in movable}
    assert counted(apply(workers, plan, 0.0)) == {PREFILL: prefill, DECODE: decode}
