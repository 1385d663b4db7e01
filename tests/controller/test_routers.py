"""The controller's one view of several routers, and each router's share of a budget.

Every router's finished requests count; their in-flight counters add up; each worker appears
once, with every router's load on it summed and the stats of the router that heard from it
last; a decode worker's offload budget is split so the routers together hold the controller's.
"""

from __future__ import annotations

from pdserve.controller.policy import OffloadBudget as Budget
from pdserve.controller.routers import merge_signals, share_budgets
from pdserve.proto import router_pb2 as rpb
from pdserve.proto import worker_pb2 as wpb


def worker(address, in_flight, tokens, age, running):
    return rpb.WorkerMember(address=address, in_flight=in_flight, in_flight_tokens=tokens,
                            offload_in_flight_tokens=in_flight * 10, offload_budget_tokens=50,
                            last_seen_age_s=age,
                            stats=wpb.WorkerStats(num_running=running))


def test_two_routers_make_one_view():
    a = rpb.RouterSignals(samples=[rpb.RequestSample(ttft_s=0.1)], in_flight_requests=3,
                          offloaded_requests_total=1, offloaded_tokens_total=100,
                          retries_total=2, admitted_output_tokens_total=640,
                          workers=[worker("w1:1", 2, 200.0, 0.5, 4),
                                                    worker("w2:1", 1, 10.0, 0.2, 1)])
    b = rpb.RouterSignals(samples=[rpb.RequestSample(ttft_s=0.3), rpb.RequestSample()],
                          in_flight_requests=4, offloaded_requests_total=2,
                          offloaded_tokens_total=50, retries_total=1,
                          admitted_output_tokens_total=360, workers=[worker("w1:1", 5, 300.0, 0.1, 7)])
    m = merge_signals([a, b])
    assert sorted(s.ttft_s for s in m.samples) == [0.0, 0.1, 0.3]
    assert (m.in_flight_requests, m.offloaded_requests_total, m.offloaded_tokens_total,
            m.retries_total, m.admitted_output_tokens_total) == (7, 3, 150, 3, 1000)
    w1, w2 = m.workers
    assert (w1.address, w1.in_flight, w1.in_flight_tokens, w1.offload_in_flight_tokens) == (
        "w1:1", 7, 500.0, 70)
    assert w1.offload_budget_tokens == 100  # each router's share, summed back
    assert (w1.stats.num_running, w1.last_seen_age_s) == (7, 0.1)  # the fresher report
    assert (w2.address, w2.in_flight, w2.stats.num_running) == ("w2:1", 1, 1)
    assert merge_signals([a]) == a  # one router: its own view, unchanged


def test_each_router_holds_its_share_of_an_offload_budget():
    budgets = [Budget("d:1", 1000, 64, 0.05), Budget("d:2", 1, 32), Budget("d:3", 0, 64)]
    assert [(b.address, b.max_tokens, b.chunk_tokens, b.step_s)
            for b in share_budgets(budgets, 3)] == [
        ("d:1", 334, 64, 0.05), ("d:2", 1, 32, 0.0), ("d:3", 0, 64, 0.0)]
    assert [b.max_tokens for b in share_budgets(budgets, 0)] == [1000, 1, 0]
