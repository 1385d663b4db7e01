"""Membership as a pure core: every transition, with plain data and an explicit `now`; then its
adapter (`pool.WorkerSet`: picks, health changes, offload leases; no RPC is made) and the
bounded ring of request samples the control API reports."""

from __future__ import annotations

import pytest

from pdserve.router.membership import (
    ACTIVE, DECODE, DRAINING, FAILED, GONE, PREFILL, InvalidBudgetError, Membership,
    UnknownMemberError,
)


def make_membership(**overrides) -> Membership:
    m = Membership(**{"max_missed": 3, "forget_after_s": 60.0, **overrides})
    m.join("p1", PREFILL, 0.0)
    m.join("p0", PREFILL, 0.0)
    m.join("d0", DECODE, 0.0)
    return m


def addresses(members) -> list[str]:
    return [m.address for m in members]


def test_join_adds_active_members_in_stable_address_order():
    m = make_membership()
    assert addresses(m.pool(PREFILL)) == ["p0", "p1"]
    assert addresses(m.pool(DECODE)) == ["d0"]
    assert m.get("p0").state == ACTIVE and m.get("p0").last_seen_s is None
    assert m.serving()


def test_join_is_idempotent_and_never_moves_an_active_member():
    m = make_membership()
    m.join("p0", PREFILL, 1.0)
    assert addresses(m.pool(PREFILL)) == ["p0", "p1"]
    # A registration heartbeat sent before a switch can arrive after the controller admitted
    # the worker in its new pool: only a fresh poll moves an active member.
    m.join("p0", DECODE, 2.0)
    assert addresses(m.pool(PREFILL)) == ["p0", "p1"] and addresses(m.pool(DECODE)) == ["d0"]


def test_a_poll_asked_before_the_controller_moved_a_member_does_not_move_it_back():
    m = make_membership()
    m.set_state("d0", ACTIVE, role=PREFILL, now=5.0)  # the controller completed a flip at 5 s
    m.report("d0", DECODE, now=5.5, stats="old", asked_s=4.9)  # asked before: stale role
    assert m.get("d0").role == PREFILL and m.get("d0").stats == "old"
    assert m.get("d0").last_seen_s == 5.5  # still counts as alive
    m.report("d0", DECODE, now=6.5, asked_s=6.0)  # asked after: someone switched it by hand
    assert m.get("d0").role == DECODE


def test_join_brings_a_gone_member_back_in_the_given_role():
    m = make_membership()
    m.set_state("p0", GONE, now=1.0)
    m.join("p0", DECODE, 2.0)
    p0 = m.get("p0")
    assert (p0.state, p0.role, p0.missed, p0.gone_since_s) == (ACTIVE, DECODE, 0, None)


@pytest.mark.parametrize("state", [DRAINING, FAILED])
def test_join_leaves_draining_and_failed_to_the_controller(state):
    m = make_membership()
    m.set_state("p0", state)
    m.join("p0", PREFILL, 1.0)
    assert m.get("p0").state == state and addresses(m.pool(PREFILL)) == ["p1"]


def test_report_records_the_poll_and_resets_missed():
    m = make_membership()
    m.missed("p0", 1.0)
    m.missed("p0", 2.0)
    stats = object()
    m.report("p0", PREFILL, 3.0, stats)
    p0 = m.get("p0")
    assert (p0.missed, p0.last_seen_s, p0.stats, p0.state) == (0, 3.0, stats, ACTIVE)


def test_report_of_another_role_moves_an_active_member():
    """Someone called SetRole by hand: the old pool would only refuse its requests."""
    m = make_membership()
    m.report("p1", DECODE, 1.0)
    assert addresses(m.pool(PREFILL)) == ["p0"] and addresses(m.pool(DECODE)) == ["d0", "p1"]
    assert "decode" in m.get("p1").reason


def test_report_brings_a_gone_member_back_in_the_reported_role():
    m = make_membership()
    for t in (1.0, 2.0, 3.0):
        m.missed("p0", t)
    assert m.get("p0").state == GONE
    m.report("p0", DECODE, 4.0)
    assert (m.get("p0").state, m.get("p0").role) == (ACTIVE, DECODE)


@pytest.mark.parametrize("state", [DRAINING, FAILED])
def test_report_only_records_for_draining_and_failed(state):
    m = make_membership()
    m.set_state("p0", state)
    m.report("p0", DECODE, 5.0, "stats")
    p0 = m.get("p0")
    assert (p0.state, p0.role, p0.last_seen_s, p0.stats) == (state, PREFILL, 5.0, "stats")


def test_a_stalled_member_is_gone_at_once_and_held_out_before_its_polls_count():
    m = make_membership()
    p0 = m.stalled("p0", "did not answer within 30s", 10.0, hold_s=30.0)
    assert (p0.state, p0.gone_since_s, p0.reason) == (GONE, 10.0, "did not answer within 30s")
    assert addresses(m.pool(PREFILL)) == ["p1"]
    m.report("p0", PREFILL, 25.0)  # it answers a poll, but within the hold
    assert m.get("p0").state == GONE and m.get("p0").last_seen_s == 25.0
    m.report("p0", PREFILL, 40.0)
    assert m.get("p0").state == ACTIVE
    m.set_state("p1", FAILED)
    assert m.stalled("p1", "late", 41.0, 30.0).state == FAILED  # the controller's stays
    m.stalled("d0", "late", 42.0, 30.0)
    m.set_state("d0", ACTIVE)  # the controller's re-admission clears the hold
    assert m.get("d0").state == ACTIVE and m.stalled("zz", "late", 43.0, 1.0) is None


def test_report_and_missed_of_an_unknown_address_change_nothing():
    m = make_membership()
    assert m.report("zz", PREFILL, 1.0) is None and m.missed("zz", 1.0) is None
    assert "zz" not in m and len(m.members()) == 3


@pytest.mark.parametrize("state", [ACTIVE, DRAINING])
def test_missed_polls_make_a_member_gone_after_max_missed(state):
    m = make_membership(max_missed=3)
    m.set_state("p0", state)
    m.missed("p0", 1.0)
    m.missed("p0", 2.0)
    assert m.get("p0").state == state
    m.missed("p0", 3.0)
    p0 = m.get("p0")
    assert p0.state == GONE and p0.gone_since_s == 3.0 and "3 consecutive" in p0.reason
    assert addresses(m.pool(PREFILL)) == ["p1"]


def test_a_report_between_misses_restarts_the_count():
    m = make_membership(max_missed=2)
    m.missed("p0", 1.0)
    m.report("p0", PREFILL, 2.0)
    m.missed("p0", 3.0)
    assert m.get("p0").state == ACTIVE


def test_missed_polls_leave_a_failed_member_failed():
    m = make_membership(max_missed=1)
    m.set_state("p0", FAILED, reason="flip timed out")
    m.missed("p0", 1.0)
    assert m.get("p0").state == FAILED and m.get("p0").reason == "flip timed out"


def test_set_state_moves_between_pools_and_keeps_the_role_when_none_is_given():
    m = make_membership()
    m.set_state("p0", DRAINING, reason="flip to decode")
    assert addresses(m.pool(PREFILL)) == ["p1"] and m.get("p0").reason == "flip to decode"
    m.set_state("p0", ACTIVE, DECODE)
    assert addresses(m.pool(DECODE)) == ["d0", "p0"]
    m.set_state("p0", FAILED)
    assert addresses(m.pool(DECODE)) == ["d0"]
    m.set_state("p0", ACTIVE)  # keeps its role
    assert m.get("p0").role == DECODE and m.get("p0").state == ACTIVE


def test_set_state_active_gives_fresh_missed_count():
    m = make_membership(max_missed=2)
    m.missed("p0", 1.0)
    m.set_state("p0", DRAINING)
    m.set_state("p0", ACTIVE)
    m.missed("p0", 2.0)
    assert m.get("p0").state == ACTIVE


def test_set_state_of_an_unknown_address_is_a_key_error_naming_it():
    m = make_membership()
    with pytest.raises(KeyError) as e:
        m.set_state("nowhere:1", DRAINING)
    assert isinstance(e.value, UnknownMemberError) and "nowhere:1" in str(e.value)
    with pytest.raises(ValueError, match="state"):
        m.set_state("p0", "sleeping")
    with pytest.raises(ValueError, match="role"):
        m.set_state("p0", ACTIVE, "both")


def test_serving_needs_an_active_decode_member_and_no_prefill_one():
    m = make_membership()
    m.set_state("d0", DRAINING)
    assert not m.serving()
    m.set_state("d0", ACTIVE)
    m.set_state("p0", FAILED)
    m.set_state("p1", GONE)
    assert m.serving()  # a decode worker prefills the prompts itself
    m.set_state("d0", FAILED)
    assert not m.serving()


def test_forget_gone_drops_members_gone_longer_than_the_limit():
    m = make_membership(forget_after_s=10.0, max_missed=1)
    m.missed("p0", 5.0)
    m.set_state("p1", GONE, now=12.0)
    assert m.forget_gone(15.0) == []
    assert m.forget_gone(15.5) == ["p0"]
    assert "p0" not in m and m.get("p1").state == GONE
    assert m.forget_gone(22.5) == ["p1"]
    assert addresses(m.members()) == ["d0"]


def test_acquire_and_release_count_in_flight_and_offload_tokens():
    m = make_membership()
    m.acquire("p0", 100.0)
    m.acquire("p0", 50.0)
    m.acquire("d0", 0.0, offload_tokens=300)
    assert (m.get("p0").in_flight, m.get("p0").in_flight_tokens) == (2, 150.0)
    assert (m.get("d0").in_flight, m.get("d0").offload_tokens) == (1, 300)
    m.release("p0", 100.0)
    m.release("d0", 0.0, offload_tokens=300)
    assert (m.get("p0").in_flight, m.get("p0").in_flight_tokens) == (1, 50.0)
    assert (m.get("d0").in_flight, m.get("d0").offload_tokens) == (0, 0)
    m.forget("p0")
    m.release("p0", 50.0)  # the request outlived its worker's membership: nothing to count
    with pytest.raises(UnknownMemberError):
        m.acquire("p0")


def test_offload_budgets_replace_the_whole_set_and_name_bad_fields():
    m = make_membership()
    m.join("d1", DECODE, 0.0)
    m.set_offload_budgets({"d0": (512, 64, 0.02), "d1": (256, 32)})
    assert addresses(m.offload_candidates()) == ["d0", "d1"]
    d0 = m.get("d0")
    assert (d0.offload_budget, d0.offload_chunk, d0.offload_step_s) == (512, 64, 0.02)
    assert m.get("d1").offload_step_s == 0.0  # left out: none given
    m.set_offload_budgets({"d1": (128, 16)})
    assert addresses(m.offload_candidates()) == ["d1"] and m.get("d0").offload_budget == 0
    assert m.get("d0").offload_step_s == 0.0
    with pytest.raises(InvalidBudgetError, match=r"^budgets\.address: 'p0'"):
        m.set_offload_budgets({"d0": (1, 1), "p0": (1, 1)})
    with pytest.raises(InvalidBudgetError, match=r"^budgets\.max_tokens"):
        m.set_offload_budgets({"d0": (-1, 1)})
    with pytest.raises(InvalidBudgetError, match=r"^budgets\.chunk_tokens"):
        m.set_offload_budgets({"d0": (1, -1)})
    for bad in (-0.1, float("nan"), float("inf")):
        with pytest.raises(InvalidBudgetError, match=r"^budgets\.step_s"):
            m.set_offload_budgets({"d0": (1, 1, bad)})
    assert m.get("d1").offload_budget == 128  # a refused set leaves the old one in place
    m.set_state("d1", DRAINING)
    assert m.offload_candidates() == []  # only ACTIVE decode members take offloaded work


def test_bad_construction_and_roles_are_refused():
    with pytest.raises(ValueError, match="max_missed"):
        Membership(max_missed=0)
    with pytest.raises(ValueError, match="forget_after_s"):
        Membership(forget_after_s=-1)
    with pytest.raises(ValueError, match="role"):
        Membership().join("x", "both", 0.0)
    with pytest.raises(UnknownMemberError):
        Membership().get("x")


# ---- the adapter (pool.WorkerSet) and the request-sample ring: no RPC is made here -------------

def make_workers(**overrides):
    from pdserve.router.policy import DecodeChooser, RoundRobin
    from pdserve.router.pool import WorkerSet

    # stats_interval_s=0: no poller, so nothing ever dials these addresses.
    return WorkerSet(["127.0.0.1:1", "127.0.0.1:2"], ["127.0.0.1:3"],
                     prefill_policy=RoundRobin(), decode_policy=DecodeChooser(),
                     stats_interval_s=0, **overrides)


def test_pick_counts_in_flight_skips_excluded_and_names_the_empty_pool():
    from pdserve.router.policy import NoWorkerError

    ws = make_workers()
    try:
        with ws.pick(PREFILL, exclude=frozenset({"127.0.0.1:1"})) as (address, stub):
            assert address == "127.0.0.1:2" and stub is ws.stub(address)
            assert ws.get(address).in_flight == 1
        assert ws.get("127.0.0.1:2").in_flight == 0
        ws.set_state("127.0.0.1:3", DRAINING)
        with pytest.raises(NoWorkerError, match="decode"):
            with ws.pick(DECODE):
                pass
        with pytest.raises(NoWorkerError, match="besides"):
            with ws.pick(PREFILL, exclude=frozenset({"127.0.0.1:1", "127.0.0.1:2"})):
                pass
    finally:
        ws.close()


def test_serving_changes_reach_the_watcher_in_order_and_gone_forgets():
    ws = make_workers()
    seen: list[bool] = []
    try:
        ws.watch(seen.append)
        ws.set_state("127.0.0.1:3", FAILED)
        ws.set_state("127.0.0.1:3", ACTIVE)
        ws.set_state("127.0.0.1:1", GONE)  # the other prefill worker still serves
        assert seen == [True, False, True]
        assert [m.address for m in ws.members()] == ["127.0.0.1:2", "127.0.0.1:3"]
        with pytest.raises(UnknownMemberError):
            ws.stub("127.0.0.1:1")
    finally:
        ws.close()


def test_offload_lease_holds_the_budget_until_the_request_ends():
    from pdserve.router.picks import LiveRequest

    ws = make_workers()
    request = LiveRequest(list(range(100)))
    try:
        assert ws.take_offload(request, None) == (None, None)  # no budget yet
        ws.set_offload_budgets({"127.0.0.1:3": (150, 32)})
        (address, taken, chunk), d = ws.take_offload(request, None)
        assert (address, chunk, d.choice) == ("127.0.0.1:3", 32, "decode")
        assert ws.get(address).offload_tokens == 100
        assert ws.take_offload(request, None) == (None, None)  # 200 would pass the budget
        ws.release_taken(address, taken)
        assert ws.get("127.0.0.1:3").offload_tokens == 0
    finally:
        ws.close()


def test_the_prefill_pick_is_counted_only_where_the_request_goes():
    """The route weighs the prefill pool's pick against the budgets before counting it: a
    deflected request leaves nothing counted on the prefill worker; one the pool keeps is
    counted there and takes no budget."""
    from pdserve.router.picks import LiveRequest

    ws = make_workers()
    request = LiveRequest(list(range(100)))
    try:
        ws.set_offload_budgets({"127.0.0.1:3": (150, 32)})  # no step time: it decides
        chosen = ws.choose_prefill(request)
        assert (ws.get(chosen[0]).in_flight, chosen[1]) == (0, (100, 0))
        (address, taken, _), d = ws.take_offload(request, chosen)
        assert (address, d.choice) == ("127.0.0.1:3", "decode")
        assert ws.get(chosen[0]).in_flight == 0
        ws.release_taken(address, taken)
        # A step time and no measured prefill rate: the pool keeps it, no budget is taken.
        ws.set_offload_budgets({"127.0.0.1:3": (150, 32, 0.01)})
        chosen = ws.choose_prefill(request)
        off, d = ws.take_offload(request, chosen)
        assert off is None and (d.choice, d.reason) == ("prefill", "no prefill rate measured")
        assert ws.take_prefill(request, frozenset(), chosen) == chosen
        assert (ws.get(chosen[0]).in_flight, ws.get(chosen[0]).in_flight_tokens) == (1, 100)
        assert ws.get("127.0.0.1:3").offload_tokens == 0
        ws.release_taken(*chosen)
        # A pick that left the pool meanwhile is not counted: the policy chooses again.
        chosen = ws.choose_prefill(request)
        ws.set_state(chosen[0], DRAINING)
        other = ws.take_prefill(request, frozenset(), chosen)
        assert other[0] != chosen[0] and ws.get(other[0]).in_flight == 1
        ws.release_taken(*other)
    finally:
        ws.close()


def test_request_samples_are_bounded_and_windowed():
    from pdserve.router.control import RequestSignals, Sample, tpot_of

    s = RequestSignals(max_samples=3)
    for t in range(5):
        s.started()
        s.finished(Sample(float(t), 0.1, 0.01, 10, 5, False, 0, "length"))
    assert len(s) == 3 and s.in_flight == 0
    assert [x.finished_s for x in s.window(now=4.5, window_s=1.0)] == [4.0]
    assert [x.finished_s for x in s.window(now=4.5, window_s=100.0)] == [2.0, 3.0, 4.0]
    assert tpot_of(1.0, 0.2, 5) == pytest.approx(0.2) and tpot_of(1.0, 0.2, 1) == 0.0
