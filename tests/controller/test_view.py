"""The controller's view: router signals -> worker views, pressures and the SLO window."""

from __future__ import annotations

import math
import subprocess
import sys

from pdserve.controller.audit import AuditLog, read_records
from pdserve.controller.policy import DECODE, DRAINING, PREFILL, SERVING, SWITCHING
from pdserve.controller.signals import Slo
from pdserve.controller.view import Meters, cluster_view, used_share, window_of
from pdserve.proto import router_pb2 as rpb
from pdserve.proto import worker_pb2 as wpb


def member(address, role, *, state=rpb.MEMBER_STATE_ACTIVE, tokens=0.0, computed=0, busy=0.0,
           steps=0, step_s=0.0, free=100, total=100, running=0, waiting=0):
    return rpb.WorkerMember(
        address=address, role=role, state=state, in_flight_tokens=tokens,
        stats=wpb.WorkerStats(role=role, prompt_tokens_computed=computed, busy_seconds=busy,
                              decode_steps=steps, decode_step_seconds=step_s,
                              num_free_blocks=free, num_total_blocks=total,
                              num_running=running, num_waiting=waiting))


def signals(*members, samples=(), admitted=0):
    return rpb.RouterSignals(workers=list(members), samples=list(samples),
                             admitted_output_tokens_total=admitted)


def test_rates_come_from_counter_deltas_and_the_pool_sums_them():
    meters, slo = Meters(), Slo(ttft_s=1.0, itl_s=0.1, ttft_share=0.5)
    first = signals(member("p0", wpb.ROLE_PREFILL), member("p1", wpb.ROLE_PREFILL),
                    member("d0", wpb.ROLE_DECODE))
    cluster_view(first, meters, slo)
    # p0 computed 1000 tokens in 1 s of work, p1 500 in 1 s; 3000 tokens are queued.
    second = signals(member("p0", wpb.ROLE_PREFILL, tokens=2000, computed=1000, busy=1.0),
                     member("p1", wpb.ROLE_PREFILL, tokens=1000, computed=500, busy=1.0),
                     member("d0", wpb.ROLE_DECODE, steps=10, step_s=0.5))
    v = cluster_view(second, meters, slo)
    by = {w.address: w for w in v.workers}
    assert math.isclose(by["p0"].prefill_tokens_per_s, 1000)
    assert math.isclose(by["d0"].decode_step_s, 0.05)
    # A decode worker's prefill speed is the prefill workers' mean (same machine).
    assert math.isclose(by["d0"].prefill_tokens_per_s, 750)
    assert math.isclose(v.prefill.tokens_per_s, 1500)
    assert math.isclose(v.prefill.work_s, 2.0)  # 3000 tokens / 1500 tokens/s
    assert math.isclose(v.prefill.ratio, 4.0)  # 2 s against 0.5 x 1 s


def test_states_kv_and_switching_workers():
    meters, slo = Meters(), Slo()
    v = cluster_view(signals(
        member("p0", wpb.ROLE_PREFILL),
        member("d0", wpb.ROLE_DECODE, free=20, total=100, running=3, waiting=1),
        member("d1", wpb.ROLE_DECODE, state=rpb.MEMBER_STATE_DRAINING)),
        meters, slo, switching={"d1": PREFILL}, pinned=frozenset({"p0"}),
        last_flip_s={"p0": 5.0})
    by = {w.address: w for w in v.workers}
    assert by["p0"].pinned and by["p0"].last_flip_s == 5.0 and by["p0"].state == SERVING
    assert by["d1"].state == SWITCHING and by["d1"].to_role == PREFILL and by["d0"].kv_used_blocks == 80
    assert by["d0"].role == DECODE and by["p0"].role == PREFILL
    # Only serving decode workers count for the decode pool's KV occupancy.
    assert math.isclose(v.decode.kv_occupancy, 0.8)
    v2 = cluster_view(signals(member("d1", wpb.ROLE_DECODE, state=rpb.MEMBER_STATE_DRAINING)),
                      meters, slo)
    assert v2.workers[0].state == DRAINING


def test_window_counts_failed_requests_as_missing_the_slo():
    slo = Slo(ttft_s=1.0, itl_s=0.1)
    w = window_of([
        rpb.RequestSample(ttft_s=0.5, tpot_s=0.05, output_tokens=10, finish="length"),
        rpb.RequestSample(ttft_s=2.0, tpot_s=0.05, output_tokens=10, finish="stop"),
        rpb.RequestSample(ttft_s=0.1, tpot_s=0.0, output_tokens=0, finish="UNAVAILABLE")], slo)
    assert w.requests == 3 and math.isclose(w.attainment, 1 / 3)
    assert w.itl_p90_s is not None and w.ttft_p90_s is not None


def test_audit_log_rotates_at_its_bound(tmp_path):
    path = str(tmp_path / "a.jsonl")
    log = AuditLog(path, max_bytes=4096)
    for i in range(200):
        log.write({"event": "decision", "i": i, "pad": "x" * 40})
    assert (tmp_path / "a.jsonl").stat().st_size <= 4096
    records = read_records(path)
    assert records[-1]["i"] == 199 and len(records) < 200  # the oldest went with the rotation


def test_the_controller_and_ctl_import_no_torch():
    code = ("import sys; import pdserve.controller.service, pdserve.controller.server, "
            "pdserve.controller.ctl, pdserve.controller.ctl_view; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_decode_itl_is_the_live_step_time_when_no_request_has_finished_yet():
    meters, slo = Meters(), Slo(ttft_s=1.0, itl_s=0.1)
    cluster_view(signals(member("d0", wpb.ROLE_DECODE, running=4)), meters, slo)
    # 10 decode steps took 3 s: 0.3 s per token for the 4 running requests, none finished.
    v = cluster_view(signals(member("d0", wpb.ROLE_DECODE, running=4, steps=10, step_s=3.0)),
                     meters, slo)
    assert v.recent.itl_p90_s is None
    assert math.isclose(v.decode.itl_ratio, 3.0)


def test_admitted_decode_work_is_the_max_tokens_rate_times_the_share_used():
    meters, slo = Meters(), Slo(ttft_s=1.0, itl_s=0.1)
    d0 = member("d0", wpb.ROLE_DECODE, running=1, free=90)
    # Recent answers used half their max_tokens (one stopped early at 32 of 128, one ran to
    # its 64); an aborted one does not count.
    done = [rpb.RequestSample(output_tokens=32, max_tokens=128, finish="stop"),
            rpb.RequestSample(output_tokens=64, max_tokens=64, finish="length"),
            rpb.RequestSample(output_tokens=1, max_tokens=4096, finish="abort")]
    assert math.isclose(used_share(done), 0.5)
    assert used_share([]) == 1.0
    assert cluster_view(signals(d0, samples=done, admitted=1000), meters, slo,
                        now=0.0).decode_tokens_per_s == 0.0  # one view: no rate yet
    v = cluster_view(signals(d0, samples=done, admitted=1800), meters, slo,
                     pressure_window_s=5.0, now=2.0)
    assert math.isclose(v.decode_tokens_per_s, 800 / 2 * 0.5)
    # Admissions stop at 6 s. Past the window the rate is 0, but the work admitted before it
    # is still decoding: the figure falls by half each window, no faster.
    seen = []
    for t, total in ((4.0, 2600), (6.0, 3400), (8.0, 3400), (10.0, 3400), (12.0, 3400),
                     (60.0, 3400)):
        seen.append((t, cluster_view(signals(d0, samples=done, admitted=total), meters, slo,
                                     pressure_window_s=5.0, now=t).decode_tokens_per_s))
    for (t1, w1), (t2, w2) in zip(seen, seen[1:]):
        assert w2 >= w1 * 0.5 ** ((t2 - t1) / 5.0) - 1e-9
    assert math.isclose(seen[-2][1], seen[-3][1] * 0.5 ** (2 / 5.0))  # rate 0: the decay alone
    assert seen[-1][1] < 1.0
    # A router that restarted (its total fell) starts the count afresh, not negative.
    v = cluster_view(signals(d0, samples=done, admitted=100), meters, slo, now=61.0)
    assert v.decode_tokens_per_s == 0.0
