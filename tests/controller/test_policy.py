"""The controller policy as scenarios: workers and pressures in, flips and budgets out.

Time is a plain number; each scenario feeds `Decision.state` back and applies the flips itself,
as the controller service does once a flip has landed.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from pdserve.controller.policy import (DECODE, DRAINING, GONE, PREFILL, SWITCHING,
                                       ControllerInput, Decision, OffloadBudget, PolicyConfig,
                                       PolicyState, WorkerView, decide, plan_rebalance)
from pdserve.controller.signals import DecodePressure, PrefillPressure, Slo

SLO = Slo(ttft_s=2.0, itl_s=0.2, ttft_share=0.5)
CFG = PolicyConfig(sustain_s=3.0, cooldown_s=30.0, fluid_token=False)


def prefill_at(ratio: float, tokens_per_s: float = 1000.0) -> PrefillPressure:
    """Prefill pressure from its queue: `ratio` is the queue term."""
    work_s = ratio * SLO.ttft_share * SLO.ttft_s
    return PrefillPressure(work_s, ratio, work_s * tokens_per_s, tokens_per_s,
                           queue_ratio=ratio)


def decode_at(ratio: float) -> DecodePressure:
    return DecodePressure(ratio, 0.0, 0.0, ratio, 0.0)


def worker(address: str, role: str = DECODE, **overrides) -> WorkerView:
    return WorkerView(address, role, **{"kv_total_blocks": 100, **overrides})


def make_input(workers, prefill: float = 0.0, decode: float = 0.0,
               state: PolicyState = PolicyState(), target=None,
               tokens_per_s: float = 1000.0) -> ControllerInput:
    return ControllerInput(tuple(workers), prefill_at(prefill, tokens_per_s), decode_at(decode),
                           SLO, state, target)


def apply(workers, decision: Decision, now: float) -> list[WorkerView]:
    """The flips landed: each flipped worker serves its new role."""
    to = {f.address: f.to_role for f in decision.flips}
    return [dataclasses.replace(w, role=to[w.address], last_flip_s=now) if w.address in to
            else w for w in workers]


class Cluster:
    """Ticks the policy like the service does: state fed back, flips applied."""

    def __init__(self, workers, cfg: PolicyConfig = CFG, target=None) -> None:
        self.workers, self.cfg, self.target = list(workers), cfg, target
        self.state = PolicyState()

    def tick(self, now: float, prefill: float, decode: float) -> Decision:
        d = decide(make_input(self.workers, prefill, decode, self.state, self.target), now,
                   self.cfg)
        self.state = d.state
        self.workers = apply(self.workers, d, now)
        return d

    def roles(self) -> dict[str, str]:
        return {w.address: w.role for w in self.workers}


def three_decode_one_prefill(**p0) -> list[WorkerView]:
    return [worker("p0", PREFILL, **p0), worker("d0", running=5), worker("d1", running=1),
            worker("d2", running=3)]


# ---- FluidRole ----------------------------------------------------------------------------------

def test_sustained_prefill_burst_flips_the_least_loaded_decode_worker():
    c = Cluster(three_decode_one_prefill())
    for t in (0.0, 1.0, 2.0):
        assert c.tick(t, prefill=2.4, decode=0.1).flips == ()
    d = c.tick(3.0, prefill=2.4, decode=0.1)
    assert [(f.address, f.from_role, f.to_role) for f in d.flips] == [("d1", DECODE, PREFILL)]
    assert d.action == "flip"
    assert "prefill 2.40 > 1 for 3.0 s" in d.reason and "decode 0.10 < 0.5" in d.reason
    assert c.roles()["d1"] == PREFILL
    # The next flip toward prefill must earn its own sustain time.
    assert d.state.prefill_high_since_s == 3.0
    assert c.tick(4.0, prefill=2.4, decode=0.1).flips == ()


def test_a_burst_shorter_than_sustain_does_not_flip():
    c = Cluster(three_decode_one_prefill())
    for t in (0.0, 1.0, 2.0):
        c.tick(t, prefill=2.4, decode=0.1)
    assert c.tick(2.5, prefill=0.8, decode=0.1).state.prefill_high_since_s is None
    for t in (3.0, 4.0, 5.0):
        d = c.tick(t, prefill=2.4, decode=0.1)
        assert d.flips == () and d.action == "hold"
    assert "for 2.0 s of 3 s sustain" in d.reason
    assert c.tick(6.0, prefill=2.4, decode=0.1).flips[0].address == "d1"


def test_after_the_burst_the_worker_flips_back_once_its_cooldown_passes():
    c = Cluster(three_decode_one_prefill(pinned=True))  # the operator keeps p0 on prefill
    for t in (0.0, 1.0, 2.0, 3.0):
        c.tick(t, prefill=2.4, decode=0.1)
    assert c.roles()["d1"] == PREFILL
    # The burst is over; now decodes pile up on the two decode workers left.
    for t in range(10, 33):
        d = c.tick(float(t), prefill=0.1, decode=2.0)
        assert d.flips == ()
    assert "cooling d1 1.0 s" in d.reason and "pinned p0" in d.reason
    d = c.tick(33.0, prefill=0.1, decode=2.0)
    assert [(f.address, f.to_role) for f in d.flips] == [("d1", DECODE)]
    assert c.roles() == {"p0": PREFILL, "d0": DECODE, "d1": DECODE, "d2": DECODE}


def test_both_roles_pressured_holds_and_says_so():
    d = decide(make_input(three_decode_one_prefill(), 2.4, 1.3, PolicyState(0.0, 0.0)), 10.0, CFG)
    assert d.flips == () and d.action == "hold"
    assert "both roles pressured (prefill 2.40, decode 1.30" in d.reason


def test_a_high_ttft_under_decode_pressure_flips_toward_decode():
    """The prefill queue is empty but TTFT is over its SLO because requests wait for a decode
    slot: decode takes a prefill worker instead of both roles reading as pressured."""
    ws = [worker("p0", PREFILL), worker("p1", PREFILL), worker("d0", running=30)]
    waiting_on_decode = PrefillPressure(0.0, 3.0, 0.0, 1000.0, queue_ratio=0.0, ttft_ratio=3.0)
    inp = ControllerInput(tuple(ws), waiting_on_decode, decode_at(1.4), SLO,
                          PolicyState(decode_high_since_s=0.0))
    d = decide(inp, 10.0, CFG)
    assert [(f.address, f.to_role) for f in d.flips] == [("p0", DECODE)]
    assert "prefill TTFT term 3.00 set aside" in d.reason
    # A prefill queue over its share is prefill pressure whatever decode does: both hold.
    queued = dataclasses.replace(waiting_on_decode, queue_ratio=1.5)
    d = decide(dataclasses.replace(inp, prefill=queued), 10.0, CFG)
    assert d.flips == () and "both roles pressured" in d.reason
    # Without decode pressure the TTFT term stands: prefill is pressured and takes a worker.
    calm = ControllerInput((worker("p0", PREFILL), worker("d0"), worker("d1")),
                           waiting_on_decode, decode_at(0.1), SLO,
                           PolicyState(prefill_high_since_s=0.0))
    d = decide(calm, 10.0, CFG)
    assert [(f.address, f.to_role) for f in d.flips] == [("d0", PREFILL)]


def test_the_giving_role_must_be_calm():
    d = decide(make_input(three_decode_one_prefill(), 2.4, 0.7, PolicyState(0.0)), 10.0, CFG)
    assert d.flips == () and "decode 0.70 is not below 0.5" in d.reason


def test_each_role_keeps_its_floor():
    ws = [worker("p0", PREFILL), worker("d0")]
    d = decide(make_input(ws, 2.4, 0.1, PolicyState(0.0)), 10.0, CFG)
    assert d.flips == () and "1 serving, min_per_role 1" in d.reason


def test_pinned_and_busy_workers_are_never_flipped_by_pressure():
    ws = [worker("p0", PREFILL), worker("d0", pinned=True), worker("d1", state=DRAINING),
          worker("d2", running=7), worker("d3", running=6, state=GONE)]
    d = decide(make_input(ws, 2.4, 0.1, PolicyState(0.0)), 10.0, CFG)
    assert [f.address for f in d.flips] == ["d2"]


def test_no_new_flip_while_one_is_in_flight():
    ws = three_decode_one_prefill() + [worker("d3", state=SWITCHING)]
    d = decide(make_input(ws, 2.4, 0.1, PolicyState(0.0)), 10.0, CFG)
    assert d.flips == () and "in flight (d3 to prefill)" in d.reason
    assert d.state.prefill_high_since_s == 10.0  # pressure counts again once it has landed


def test_fluid_role_off_moves_nobody():
    cfg = dataclasses.replace(CFG, fluid_role=False)
    d = decide(make_input(three_decode_one_prefill(), 2.4, 0.1, PolicyState(0.0)), 10.0, cfg)
    assert d.flips == () and d.reason.startswith("roles fixed")


# ---- operator target ----------------------------------------------------------------------------

def two_and_two() -> list[WorkerView]:
    return [worker("p0", PREFILL), worker("p1", PREFILL, queued_prompt_tokens=900.0),
            worker("d0", running=2), worker("d1", running=4)]


def test_target_overrides_pressure_and_reports_the_conflict():
    d = decide(make_input(two_and_two(), 2.4, 0.1, PolicyState(0.0), target=(2, 2)), 10.0, CFG)
    assert d.flips == () and d.action == "hold"
    assert d.conflicts == ("operator target 2:2 holds while prefill pressure is 2.40 "
                           "(decode 0.10)",)
    assert "operator target 2:2 (now 2:2): met" in d.reason


def test_target_steers_one_flip_per_tick_without_cooldown_or_floor():
    c = Cluster([dataclasses.replace(w, last_flip_s=9.0) for w in two_and_two()],
                target=(0, 4))
    d = c.tick(10.0, prefill=2.4, decode=0.1)  # against the pressure: the operator decides
    assert [(f.address, f.to_role) for f in d.flips] == [("p0", DECODE)]
    assert d.action == "target"
    assert "operator target 0:4 leaves 0 prefill workers, under min_per_role 1" in d.conflicts
    c.tick(11.0, prefill=2.4, decode=0.1)
    assert c.roles() == {"p0": DECODE, "p1": DECODE, "d0": DECODE, "d1": DECODE}
    assert c.tick(12.0, prefill=2.4, decode=0.1).flips == ()


def test_target_skips_a_pinned_worker_and_reports_the_shortfall():
    ws = [worker("p0", PREFILL), worker("d0", pinned=True), worker("d1")]
    d = decide(make_input(ws, target=(3, 0)), 10.0, dataclasses.replace(CFG, min_per_role=0))
    assert [f.address for f in d.flips] == ["d1"]
    assert d.conflicts == ("operator target 3:0 is 1 prefill short: pinned decode workers d0 "
                           "are not moved",)


def test_target_waits_for_a_flip_in_flight_instead_of_ordering_it_twice():
    ws = [worker("p0", PREFILL), worker("d0", state=SWITCHING), worker("d1"), worker("d2")]
    d = decide(make_input(ws, target=(2, 2)), 10.0, CFG)
    assert d.flips == () and "met" in d.reason  # d0 counts as the prefill worker it becomes
    d = decide(make_input(ws, target=(3, 1)), 10.0, CFG)
    assert d.flips == () and "waiting on the flip of d0" in d.reason


def test_target_of_the_wrong_size_holds_roles_and_says_why():
    d = decide(make_input(two_and_two(), target=(3, 2)), 10.0, CFG)
    assert d.flips == ()
    assert d.conflicts[0].startswith("operator target 3:2 needs 5 workers but 4 are not gone")


# ---- FluidToken ---------------------------------------------------------------------------------

TOKEN = PolicyConfig(fluid_role=False)


def test_budgets_only_under_prefill_pressure():
    ws = [worker("p0", PREFILL), worker("d0", decode_step_s=0.05)]
    assert decide(make_input(ws, prefill=0.9), 0.0, TOKEN).budgets == ()
    d = decide(make_input(ws, prefill=1.5), 0.0, TOKEN)
    assert [b.address for b in d.budgets] == ["d0"] and d.action == "offload"


def test_budget_keeps_a_decode_step_inside_the_itl_share():
    ws = [worker("p0", PREFILL), worker("d0", decode_step_s=0.05, prefill_tokens_per_s=1000.0)]
    (b,) = decide(make_input(ws, prefill=1.5), 0.0, TOKEN).budgets
    # (0.8 x 0.2 s - 0.05 s) x 1000 tokens/s = 110 tokens; a step with one chunk: 0.16 s;
    # within the 1.0 s TTFT share that is 6 steps: 660 tokens.
    assert (b.chunk_tokens, b.max_tokens) == (110, 660)
    assert b.step_s == pytest.approx(0.16) and b.step_s <= 0.8 * SLO.itl_s


def test_budget_assumes_half_the_itl_slo_for_an_unmeasured_step_and_the_pool_rate():
    ws = [worker("d0")]
    (b,) = decide(make_input(ws, prefill=1.5, tokens_per_s=500.0), 0.0, TOKEN).budgets
    assert b.chunk_tokens == 30  # (0.16 s - 0.1 s) x 500 tokens/s
    assert b.max_tokens == 30 * 6  # six 0.16 s steps fit in the 1.0 s TTFT share


def test_no_budget_for_a_worker_with_high_kv_or_a_queue_or_a_full_step():
    ws = [worker("d0", kv_used_blocks=80), worker("d1", waiting=2),
          worker("d2", decode_step_s=0.15), worker("d3", decode_step_s=0.05),
          worker("d4", decode_step_s=0.05, state=DRAINING), worker("p0", PREFILL)]
    d = decide(make_input(ws, prefill=1.5), 0.0, TOKEN)
    assert [b.address for b in d.budgets] == ["d3"]
    assert "d0 none (kv 0.80 > 0.7)" in d.reason and "d1 none (2 decodes waiting)" in d.reason
    assert "d2 none (chunk 10 < 16 tokens: step 0.150 s of 0.160 s)" in d.reason


def test_a_worker_flipped_away_takes_no_budget():
    d = decide(make_input(three_decode_one_prefill(), 2.4, 0.1, PolicyState(0.0)), 10.0,
               PolicyConfig())
    assert d.action == "flip+offload" and d.flips[0].address == "d1"
    assert [b.address for b in d.budgets] == ["d0", "d2"]


def test_no_budget_when_decode_is_pressured_and_budgets_stand_under_a_target():
    ws = [worker("p0", PREFILL), worker("d0", decode_step_s=0.05, pinned=True)]
    assert decide(make_input(ws, prefill=1.5, decode=1.2), 0.0, TOKEN).budgets == ()
    d = decide(make_input(ws, prefill=1.5, target=(1, 1)), 0.0, TOKEN)
    assert [b.address for b in d.budgets] == ["d0"]


def test_budgets_are_capped():
    ws = [worker("d0", decode_step_s=0.0, prefill_tokens_per_s=1e6)]
    cfg = dataclasses.replace(TOKEN, offload_max_tokens=512)
    (b,) = decide(make_input(ws, prefill=1.5), 0.0, cfg).budgets
    assert b == OffloadBudget("d0", 512, 512, pytest.approx(0.000512))


# ---- plan_rebalance -----------------------------------------------------------------------------

def test_plan_rebalance_moves_the_least_loaded_first():
    plan = plan_rebalance(three_decode_one_prefill(), 3, 1)
    assert [(f.address, f.from_role, f.to_role) for f in plan] == [
        ("d1", DECODE, PREFILL), ("d2", DECODE, PREFILL)]
    assert plan_rebalance(three_decode_one_prefill(), 1, 3) == ()


def test_plan_rebalance_counts_a_switching_worker_where_it_goes_and_skips_gone_ones():
    ws = three_decode_one_prefill() + [worker("d3", state=SWITCHING), worker("d4", state=GONE)]
    assert [f.address for f in plan_rebalance(ws, 3, 2)] == ["d1"]


def test_plan_rebalance_refuses_splits_it_cannot_reach():
    ws = [worker("p0", PREFILL), worker("d0", pinned=True), worker("d1", state=DRAINING),
          worker("d2")]
    with pytest.raises(ValueError, match=r"prefill \+ decode = 5, but 4 workers"):
        plan_rebalance(ws, 3, 2)
    with pytest.raises(ValueError, match="prefill=-1"):
        plan_rebalance(ws, -1, 5)
    with pytest.raises(ValueError, match=r"only 1 can move; pinned: d0; not serving: d1 \(dr"):
        plan_rebalance(ws, 3, 1)
    assert [f.address for f in plan_rebalance(ws, 2, 2)] == ["d2"]


# ---- hygiene ------------------------------------------------------------------------------------

def test_config_is_validated():
    with pytest.raises(ValueError, match="low"):
        PolicyConfig(low=1.5, high=1.0)
    with pytest.raises(ValueError, match="role"):
        WorkerView("w0", "both")
    with pytest.raises(ValueError, match="target"):
        make_input([], target=(-1, 1))


def test_importing_the_policy_loads_neither_torch_nor_grpc():
    code = ("import sys, pdserve.controller.signals, pdserve.controller.policy; "
            "print(sorted(m for m in ('torch', 'grpc') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"
