"""The projected pressure and the comparison of actions: pure functions, unit and property tests.

Property settings are derandomized (the same examples every run) and sized to run in seconds.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.controller.policy import (DECODE, PREFILL, SERVING, ControllerInput, PolicyConfig,
                                       PolicyState, WorkerView, decide)
from pdserve.controller.projection import (MAX_STEADY_BATCH, StepModel, arriving, attainment,
                                           fit_step_model, project, spread_incoming,
                                           steady_batch)
from pdserve.controller.signals import (DecodePressure, PrefillPressure, Slo, decode_pressure,
                                        prefill_pressure)
from pdserve.core.step_profile import load_profile

DETERMINISTIC = settings(max_examples=200, deadline=None, derandomize=True, database=None,
                         suppress_health_check=[HealthCheck.too_slow])
SLO = Slo(ttft_s=2.0, itl_s=0.2)
LINE = StepModel("test line", fixed_s=0.03, seq_s=0.005)  # 0.2 s at 34 sequences


def test_a_line_and_a_profile_give_their_step_times():
    assert LINE.step_s(10) == pytest.approx(0.08)
    assert LINE.step_s(0) == 0.0  # no batch, no step
    profile = load_profile("cpu-smollm2-135m")
    scaled = StepModel("cpu", profile=profile, block_tokens=16, scale=2.0)
    assert scaled.step_s(8, kv_blocks=40) == pytest.approx(
        2.0 * profile.step_s(decode_batch=8, decode_ctx=640, kv_read_tokens=640))


def test_the_fit_recovers_a_line_and_waits_for_enough_spread():
    samples = [(b, 3.0 * b, 0.03 + 0.005 * b) for b in (1, 4, 9, 16, 25)]
    m = fit_step_model(samples)
    assert m is not None and m.fixed_s == pytest.approx(0.03) and m.seq_s == pytest.approx(0.005)
    # Too few samples, or all at one batch size: no model to project with.
    assert fit_step_model(samples[:3]) is None
    assert fit_step_model([(4, 12, 0.05)] * 10) is None
    # A line never runs backwards: a falling cloud gives a flat model, not a negative slope.
    falling = fit_step_model([(b, 0, 0.2 - 0.001 * b) for b in (1, 5, 10, 20)])
    assert falling is not None and falling.seq_s == 0.0


def test_a_profile_is_scaled_by_the_median_measured_over_predicted():
    prior = StepModel("cpu", profile=load_profile("cpu-smollm2-135m"))
    samples = [(b, 2 * b, 1.5 * prior.step_s(b, 2 * b)) for b in (2, 4, 8, 16)]
    samples.append((8, 16, 100.0))  # one outlier step (a pause) does not move the median much
    m = fit_step_model(samples, prior)
    assert m.profile is prior.profile and m.scale == pytest.approx(1.5)
    assert fit_step_model([], prior) is prior  # nothing measured: the profile as shipped


def test_incoming_requests_fill_the_least_loaded_decode_workers_first():
    assert spread_incoming([5, 1, 3], 4) == [5, 4, 4]
    assert spread_incoming([2, 2], 3) == [4, 3]  # ties: the first
    assert spread_incoming([], 5) == []
    p = project([20, 4], [100.0, 20.0], 10, LINE)
    assert p.batches == (20, 14)
    assert p.steps_s == pytest.approx((LINE.step_s(20), LINE.step_s(14)))
    assert p.worst_step_s == pytest.approx(LINE.step_s(20))


def test_admitted_decode_work_settles_at_the_batch_that_keeps_up_with_it():
    # A line a + b B settles at B = W a / (1 - W b): W = 100 tokens/s, a = 0.03, b = 0.005
    # gives B = 6, a step of 0.06 s (6 tokens a step, 100 a second).
    assert steady_batch(100.0, LINE) == 6
    assert LINE.step_s(6) == pytest.approx(0.06)
    assert steady_batch(0.0, LINE) == 0
    # W b >= 1: no batch keeps up; the step is projected at the largest batch looked at.
    assert steady_batch(200.0, LINE) == MAX_STEADY_BATCH
    # Two idle decode workers, 100 tokens/s admitted: each settles at the batch for 50.
    p = project([0, 0], [0.0, 0.0], 0, LINE, tokens_per_s=100.0)
    assert p.batches == (steady_batch(50.0, LINE),) * 2
    # A worker already past the steady batch keeps its own (the larger of the two).
    p = project([30, 0], [0.0, 0.0], 0, LINE, tokens_per_s=100.0)
    assert p.batches == (30, steady_batch(50.0, LINE))
    # One decode worker of a 3:1 split gets all the work of a decode-heavy stretch: its
    # projected step is past the ITL SLO before any of those requests decoded.
    one = project([2], [10.0], 0, LINE, tokens_per_s=180.0)
    assert one.worst_step_s > SLO.itl_s
    assert project([2, 0], [10.0, 0.0], 0, LINE, tokens_per_s=180.0).worst_step_s < SLO.itl_s


def test_attainment_counts_decodes_in_time_and_the_queue_reached_in_time():
    # 10 decoding at 0.1 s (in time), 30 at 0.3 s (late); nothing queued.
    assert attainment([10, 30], [0.1, 0.3], 0.2, 0, 0.0, 1.0) == pytest.approx(0.25)
    # 10 queued, the queue clears in 2 s, a 1 s budget: the first half is reached in time.
    assert attainment([], [], 0.2, 10, 2.0, 1.0) == pytest.approx(0.5)
    assert attainment([], [], 0.2, 0, 0.0, 1.0) == 1.0


def test_decode_pressure_sees_the_projected_step_before_the_measured_itl():
    d = decode_pressure(10, 100, 0.05, 0, 4, SLO, projected_step_s=0.3)
    assert d.itl_ratio == pytest.approx(0.25) and d.projected_ratio == pytest.approx(1.5)
    assert d.ratio == pytest.approx(1.5)
    assert decode_pressure(10, 100, 0.05, 0, 4, SLO).projected_ratio == 0.0


def _decoder(address, running, kv=0, **kw):
    return WorkerView(address, DECODE, SERVING, running=running, kv_used_blocks=kv,
                      kv_total_blocks=1000, **kw)


def _prefiller(address, in_flight=0, **kw):
    return WorkerView(address, PREFILL, SERVING, in_flight=in_flight, **kw)


def _input(workers, *, prefill=0.1, decode=0.3, model=LINE, state=PolicyState()):
    return ControllerInput(tuple(workers), PrefillPressure(0.1, prefill, 100, 1000.0),
                           DecodePressure(decode, 0.1, 0.1, decode, 0.0), SLO, state,
                           step_model=model)


def test_the_most_loaded_decode_worker_sheds_running_decodes_to_even_out():
    workers = [_prefiller("p0"), _decoder("d0", 40, kv=400), _decoder("d1", 4, kv=40)]
    d = decide(_input(workers), 10.0)
    assert d.action == "migrate" and d.flips == ()
    assert [(m.address, m.count) for m in d.migrations] == [("d0", 4)]  # max_migrations_per_tick
    assert "projected step" in d.migrations[0].reason and "move 4 off d0" in d.reason
    d = decide(_input(workers), 10.0, PolicyConfig(max_migrations_per_tick=32))
    assert [(m.address, m.count) for m in d.migrations] == [("d0", 18)]  # 40:4 -> 22:22
    # Off, or without a step model, or with both under the threat line: nothing moves.
    assert decide(_input(workers), 10.0, PolicyConfig(balance=False)).migrations == ()
    assert decide(_input(workers, model=None), 10.0).migrations == ()
    calm = [_prefiller("p0"), _decoder("d0", 20), _decoder("d1", 4)]
    assert decide(_input(calm), 10.0).migrations == ()


def test_a_move_that_changes_no_count_must_cut_the_worst_step():
    # Every step is late against a 20 ms ITL whatever moves: attainment ties at 0. Moving 4 of
    # 40 cuts the worst step by under a tenth (held); evening them out halves it (moved).
    tight = dataclasses.replace(SLO, itl_s=0.02)
    workers = [_prefiller("p0"), _decoder("d0", 40, kv=400), _decoder("d1", 0)]
    inp = dataclasses.replace(_input(workers), slo=tight)
    assert decide(inp, 10.0).migrations == ()
    d = decide(inp, 10.0, PolicyConfig(max_migrations_per_tick=32))
    assert [(m.address, m.count) for m in d.migrations] == [("d0", 20)]


def test_a_flip_the_other_role_would_pay_for_is_held():
    # Prefill is pressured, decode calm: the hysteresis allows taking a decode worker, but the
    # one left would then run 44 sequences at 0.25 s a step, over the 0.2 s ITL SLO.
    workers = [_prefiller("p0"), _decoder("d0", 22), _decoder("d1", 22)]
    state = PolicyState(prefill_high_since_s=0.0)
    blind = decide(_input(workers, prefill=2.0, model=None, state=state), 10.0)
    assert [f.address for f in blind.flips] == ["d0"]
    d = decide(_input(workers, prefill=2.0, state=state), 10.0)
    assert d.flips == () and "hold instead of flip" in d.reason
    # The sustained pressure still counts: held, not reset.
    assert d.state.prefill_high_since_s == 0.0
    # With light decode work the same flip goes ahead.
    light = [_prefiller("p0"), _decoder("d0", 3), _decoder("d1", 3)]
    assert [f.address for f in decide(_input(light, prefill=2.0, state=state), 10.0).flips] \
        == ["d0"]


def test_a_flip_toward_decode_goes_ahead_when_the_model_sees_no_difference():
    # Decode measured over its SLO but the model projects every step in time: the flip the
    # sustained pressure allows is still ordered (a tie goes to the flip).
    workers = [_prefiller("p0"), _prefiller("p1"), _decoder("d0", 4)]
    state = PolicyState(decode_high_since_s=0.0)
    d = decide(_input(workers, decode=2.0, state=state), 10.0)
    assert [(f.address, f.to_role) for f in d.flips] == [("p0", DECODE)]


def test_projected_pressure_turns_a_burst_of_answers_into_decode_pressure_early():
    """A prefill worker holds 30 requests that will decode on one decode worker running 10:
    no ITL is measured over its SLO yet, but the projected step is."""
    pre = prefill_pressure(0, 1000.0, SLO)
    proj = project([10], [50.0], 30, LINE)
    d = decode_pressure(50, 1000, 0.08, 0, 10, SLO, projected_step_s=proj.worst_step_s)
    assert d.itl_ratio < 1.0 < d.ratio
    assert pre.ratio == 0.0


def test_admitted_answers_turn_a_3_1_split_back_toward_decode_before_any_step_is_late():
    """Three prefill workers, one decode worker running 2 short answers in time; long answers
    are being admitted at 180 tokens a second. Decode pressure is the projected step's, the
    flip toward decode is ordered once it has held, and the comparison keeps it."""
    workers = [_prefiller("p0"), _prefiller("p1"), _prefiller("p2"),
               _decoder("d0", 2, kv=10, decode_step_s=0.04)]
    proj = project([2], [10.0], 0, LINE, tokens_per_s=180.0)
    dp = decode_pressure(10, 1000, 0.04, 0, 2, SLO, projected_step_s=proj.worst_step_s)
    assert dp.itl_ratio < 1.0 < dp.ratio
    inp = dataclasses.replace(_input(workers, prefill=0.1, decode=dp.ratio,
                                     state=PolicyState(decode_high_since_s=0.0)),
                              decode_tokens_per_s=180.0)
    d = decide(inp, 10.0)
    assert [(f.from_role, f.to_role) for f in d.flips] == [(PREFILL, DECODE)]
    # Without the admitted work the same batch projects in time: nothing to do.
    calm = project([2], [10.0], 0, LINE)
    assert calm.worst_step_s < SLO.itl_s


def test_a_flip_from_a_role_that_is_not_calm_is_ordered_only_where_it_projects_better():
    """The 3:1 split of the test above, its prefill queue still draining (pressure 0.8, over
    `low`): the hysteresis alone would hold the flip toward decode. With the admitted answers
    swamping the one decode worker, the projection finds more requests in time after it and
    orders it; where it finds no difference, or with no model to project, it is held."""
    workers = [_prefiller("p0", in_flight=2), _prefiller("p1", in_flight=2),
               _prefiller("p2", in_flight=2), _decoder("d0", 2, kv=10, decode_step_s=0.04)]
    state = PolicyState(decode_high_since_s=0.0)
    inp = dataclasses.replace(_input(workers, prefill=0.8, decode=1.5, state=state),
                              decode_tokens_per_s=180.0)
    d = decide(inp, 10.0)
    assert [(f.from_role, f.to_role) for f in d.flips] == [(PREFILL, DECODE)], d.reason
    assert "prefill 0.80 not below 0.5, the projection decides" in d.reason
    # Short answers: one decode worker keeps every step in time either way, a tie, held.
    tie = decide(dataclasses.replace(inp, decode_tokens_per_s=0.0), 10.0)
    assert tie.flips == () and "hold instead of flip" in tie.reason, tie.reason
    assert tie.state.decode_high_since_s == 0.0  # the sustained pressure still counts
    # The same tie with a calm prefill role goes to the flip the pressure asked for.
    calm = decide(dataclasses.replace(inp, prefill=dataclasses.replace(inp.prefill, ratio=0.1),
                                      decode_tokens_per_s=0.0), 10.0)
    assert [(f.from_role, f.to_role) for f in calm.flips] == [(PREFILL, DECODE)]
    # Nothing to project with: the hysteresis holds it, as it always did.
    blind = decide(dataclasses.replace(inp, step_model=None), 10.0)
    assert blind.flips == () and "prefill 0.80 is not below 0.5" in blind.reason


def test_with_both_roles_pressured_the_projection_may_give_decode_a_worker():
    """The decode phase's first seconds on a 3:1 split: long prompts still queued (prefill
    2.0) while the admitted answers swamp the one decode worker (decode 6.0). The hysteresis
    alone has no role to take a worker from; the projection finds the flip toward decode
    better and orders it. Without a model it is held as before."""
    workers = [_prefiller("p0", in_flight=1), _prefiller("p1", in_flight=1),
               _prefiller("p2", in_flight=1), _decoder("d0", 6, kv=30, decode_step_s=0.3)]
    state = PolicyState(prefill_high_since_s=0.0, decode_high_since_s=0.0)
    inp = dataclasses.replace(_input(workers, prefill=2.0, decode=6.0, state=state),
                              decode_tokens_per_s=180.0)
    d = decide(inp, 10.0)
    assert [(f.from_role, f.to_role) for f in d.flips] == [(PREFILL, DECODE)], d.reason
    assert "prefill 2.00 not below 0.5, the projection decides" in d.reason
    blind = decide(dataclasses.replace(inp, step_model=None), 10.0)
    assert blind.flips == () and "both roles pressured" in blind.reason


def test_a_decode_role_that_is_not_calm_gives_no_worker_to_prefill_whatever_the_projection():
    """Three light decode workers (decode 0.59, between the marks) and a long prefill queue:
    taking one for prefill projects better, but the flip is held as the hysteresis holds it."""
    workers = [_prefiller("p0", in_flight=4), _decoder("d0", 2, kv=10), _decoder("d1", 2, kv=10),
               _decoder("d2", 2, kv=10)]
    inp = _input(workers, prefill=2.65, decode=0.59, state=PolicyState(prefill_high_since_s=0.0))
    inp = dataclasses.replace(inp, prefill=dataclasses.replace(inp.prefill, work_s=3.0))
    d = decide(inp, 10.0)
    assert d.flips == () and "decode 0.59 is not below 0.5" in d.reason, d.reason
    calm = decide(dataclasses.replace(inp, decode=dataclasses.replace(inp.decode, ratio=0.3)),
                  10.0)
    assert [(f.from_role, f.to_role) for f in calm.flips] == [(DECODE, PREFILL)]


def test_a_decode_worker_flipped_away_hands_its_decodes_over_without_a_prefill():
    """Two decode workers running 2 each, a prefill queue of 4 that takes 3 s against a 1 s
    share of the TTFT SLO. As things are, 2 of the 4 reach decode within that share: 6
    decoding in time, and 1.33 of the 4 queued reached, 7.33 of 10. Taking d0 for prefill
    halves the queue's time; its 2 running decodes go on at d1 and wait for no prefill: 3
    arrive, 7 decoding in time and 2.67 queued reached, 9.67 of 11 (counted as queued too
    they would make 10 of 12)."""
    workers = [_prefiller("p0", in_flight=4), _decoder("d0", 2, kv=10), _decoder("d1", 2, kv=10)]
    inp = _input(workers, prefill=3.0, state=PolicyState(prefill_high_since_s=0.0))
    inp = dataclasses.replace(inp, prefill=dataclasses.replace(inp.prefill, work_s=3.0))
    d = decide(inp, 10.0)
    assert [(f.address, f.to_role) for f in d.flips] == [("d0", PREFILL)]
    assert "nothing 0.73" in d.reason and "flip d0 0.88" in d.reason, d.reason


def test_a_flip_away_from_decode_is_held_when_the_admitted_work_would_swamp_the_one_left():
    # Prefill pressured, two decode workers running 3 each in time: the flip of one to prefill
    # goes ahead. With 180 tokens a second of answers being admitted, the one left would
    # settle past the ITL SLO (90 a second each keeps both in time): the comparison holds it.
    workers = [_prefiller("p0"), _decoder("d0", 3), _decoder("d1", 3)]
    inp = _input(workers, prefill=2.0, state=PolicyState(prefill_high_since_s=0.0))
    assert [f.address for f in decide(inp, 10.0).flips] == ["d0"]
    busy = decide(dataclasses.replace(inp, decode_tokens_per_s=180.0), 10.0)
    assert busy.flips == () and "hold instead of flip" in busy.reason


def test_a_prefill_backlog_is_neither_decode_pressure_nor_a_reason_to_feed_decode():
    """A burst of long prompts: 40 requests at two prefill workers whose queue takes 30 s
    against a 1 s share of the TTFT SLO, two decode workers running 20 answers each in time.
    Only what the pool gets through in that second (2 of 40) reaches decode in the
    projection; counted whole, the backlog projected every step late, and a prefill worker
    handed to decode for it deepened the backlog."""
    assert arriving(40, 30.0, 1.0) == 2 and arriving(40, 0.5, 1.0) == 40
    assert arriving(0, 30.0, 1.0) == 0 and arriving(5, float("inf"), 1.0) == 0
    kv = [100.0, 100.0]
    assert (project([20, 20], kv, arriving(40, 30.0, 1.0), LINE).worst_step_s < SLO.itl_s
            < project([20, 20], kv, 40, LINE).worst_step_s)
    workers = [_prefiller("p0", in_flight=20), _prefiller("p1", in_flight=20),
               _decoder("d0", 20, kv=100), _decoder("d1", 20, kv=100)]
    # Both read as pressured (the decode figure as the whole backlog made it).
    state = PolicyState(prefill_high_since_s=0.0, decode_high_since_s=0.0)
    inp = _input(workers, prefill=30.0, decode=1.15, state=state)
    inp = dataclasses.replace(inp, prefill=dataclasses.replace(inp.prefill, work_s=30.0))
    d = decide(inp, 10.0)
    assert d.flips == () and "hold instead of flip" in d.reason, d.reason


# ---- properties ---------------------------------------------------------------------------

batches = st.lists(st.integers(0, 64), min_size=1, max_size=6)
models = st.builds(StepModel, st.just("p"), fixed_s=st.floats(0, 0.1), seq_s=st.floats(0, 0.02),
                   block_s=st.floats(0, 1e-4))


@DETERMINISTIC
@given(batches, st.integers(0, 50), models)
def test_projection_conserves_requests_and_only_grows_steps(bs, incoming, model):
    kv = [8.0 * b for b in bs]
    p = project(bs, kv, incoming, model)
    assert sum(p.batches) == sum(bs) + incoming
    assert all(a >= b for a, b in zip(p.batches, bs))
    more = project(bs, kv, incoming + 1, model)
    assert more.worst_step_s >= p.worst_step_s - 1e-12
    # Water-filling: a worker that gained a request ends no more than one above the least.
    if incoming:
        gained = [a for a, b in zip(p.batches, bs) if a > b]
        assert max(gained) <= min(p.batches) + 1


@DETERMINISTIC
@given(batches, st.integers(0, 20), models, st.floats(0, 500), st.floats(0, 500))
def test_more_admitted_work_never_projects_a_shorter_step(bs, incoming, model, w1, w2):
    kv = [8.0 * b for b in bs]
    lo, hi = sorted((w1, w2))
    a, b = project(bs, kv, incoming, model, lo), project(bs, kv, incoming, model, hi)
    assert b.worst_step_s >= a.worst_step_s - 1e-12
    assert all(y >= x for x, y in zip(a.batches, b.batches))
    # The steady batch keeps up with its share of the work, or is the largest looked at.
    share = hi / len(bs)
    s = steady_batch(share, model, 8.0)
    assert s == MAX_STEADY_BATCH or s >= share * model.step_s(s, 8.0 * s) - 1e-9
    # And no smaller batch does (the first that keeps up).
    assert s <= 1 or s - 1 < share * model.step_s(s - 1, 8.0 * (s - 1)) + 1e-9


@DETERMINISTIC
@given(batches, st.lists(st.floats(0, 1), min_size=6, max_size=6), st.floats(0.01, 1),
       st.integers(0, 20), st.floats(0, 10), st.floats(0.01, 5))
def test_attainment_is_a_share_and_faster_steps_never_lower_it(bs, steps, itl, queued, queue_s,
                                                              budget):
    steps = steps[:len(bs)]
    a = attainment(bs, steps, itl, queued, queue_s, budget)
    assert 0.0 <= a <= 1.0
    assert attainment(bs, [s / 2 for s in steps], itl, queued, queue_s, budget) >= a - 1e-12


@st.composite
def clusters(draw):
    workers = []
    for i in range(draw(st.integers(1, 3))):
        workers.append(_prefiller(f"p{i}", in_flight=draw(st.integers(0, 20))))
    for i in range(draw(st.integers(1, 4))):
        workers.append(_decoder(f"d{i}", draw(st.integers(0, 60)),
                                kv=draw(st.integers(0, 600)),
                                waiting=draw(st.sampled_from([0, 0, 2]))))
    return workers


@DETERMINISTIC
@given(clusters(), st.floats(0, 3), st.floats(0, 3), models,
       st.builds(PolicyState, st.none() | st.floats(0, 10), st.none() | st.floats(0, 10)),
       st.integers(0, 8), st.booleans())
def test_the_comparison_never_adds_a_flip_and_moves_only_what_runs(workers, p, dr, model, state,
                                                                   per_tick, balance):
    cfg = PolicyConfig(sustain_s=0.0, cooldown_s=0.0, max_migrations_per_tick=per_tick,
                       balance=balance)
    inp = _input(workers, prefill=p, decode=dr, model=model, state=state)
    d = decide(inp, 20.0, cfg)
    blind = decide(dataclasses.replace(inp, step_model=None), 20.0, cfg)
    # A flip the hysteresis alone holds is one from a role that is not calm, ordered only
    # where it projects strictly more requests in time than doing nothing (the note rounds).
    for f in set(d.flips) - set(blind.flips):
        assert f.to_role == DECODE and inp.prefill.ratio >= cfg.low
        assert "the projection decides" in f.reason
        done, nothing = d.reason.split("projected attainment: nothing ")[1].split(" ", 1)
        assert float(nothing.split(f"flip {f.address} ")[1][:4]) >= float(done)
    assert blind.migrations == ()
    assert d == decide(inp, 20.0, cfg)  # pure: the same input, the same decision
    by = {w.address: w for w in workers}
    for m in d.migrations:
        assert balance and 1 <= m.count <= per_tick
        assert by[m.address].role == DECODE and m.count <= by[m.address].running
    assert len(d.migrations) <= 1


@DETERMINISTIC
@given(st.integers(0, 200), st.floats(0, 100), st.floats(0, 100), st.floats(0, 100))
def test_what_arrives_is_every_request_in_time_and_never_more_as_the_queue_grows(
        incoming, q1, q2, horizon):
    a = arriving(incoming, q1, horizon)
    assert 0 <= a <= incoming
    if q1 <= horizon:
        assert a == incoming
    if q2 >= q1:
        assert arriving(incoming, q2, horizon) <= a
