"""The router follows membership on a real cluster (tiny Llama, 2 prefill + 1 decode, loopback).

- A prefill worker drained and switched to decode in the middle of 20 concurrent requests:
  every request ends with exactly the tokens it gets on an idle cluster.
- A worker registered through RouterControl serves requests; killed with SIGKILL, it goes GONE
  after the missed polls and requests keep succeeding on the others.
- A worker switched by hand behind a router's back refuses with FAILED_PRECONDITION: the
  request is re-routed, not failed; the router's own poll then moves the worker's pool.
- Health follows membership (a router started with no workers), and prefill offload onto a
  decode worker within the controller's budget gives the same tokens; with a step time in the
  budget, the side with the lower estimated time to first token serves each request, and the
  router records the choice.
Each test puts the cluster back to 2 prefill + 1 decode.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve import rpc
from pdserve.launcher.local import LocalCluster
from pdserve.core.identity import ROUTER, WORKER
from pdserve.proto import router_pb2 as rpb
from pdserve.proto import router_pb2_grpc as rpb_grpc
from pdserve.proto import worker_pb2 as wpb
from pdserve.proto import worker_pb2_grpc as wpb_grpc
from tests.e2e.conftest import cluster_spec
from tests.e2e.test_cluster import generate, worker_stats
from tests.helpers import free_port, start_process, stop_process

MAX_TOKENS = 24
POLL_S = 0.2  # the routers' stats interval here: GONE after 3 missed polls, well under a second
PROMPTS = [list(range(300 + 7 * i, 300 + 7 * i + 12 + 3 * i)) for i in range(20)]


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir):
    spec = cluster_spec(tiny_llama_dir, prefill_workers=2, decode_workers=1,
                        router_settings={"stats_interval_s": POLL_S})
    with LocalCluster(spec) as c:
        yield c


@dataclass(frozen=True)
class Router:
    address: str  # its client APIs
    control: str  # its control listener (RouterControl)


@pytest.fixture(scope="module")
def stale(cluster):
    """A second router that round-robins both pools and polls rarely: it learns nothing by
    itself during a test, so what it meets is deterministic."""
    address = cluster.add_router("router-stale", free_port(), "round_robin",
                                 {"decode_routing": "round_robin", "stats_interval_s": 600.0})
    [control] = [c.probe for c in cluster.children if c.address == address]
    yield Router(address, control)
    cluster.stop_child(address)


@pytest.fixture(scope="module")
def baseline(cluster):
    """Each prompt's greedy tokens, one request at a time on the idle cluster."""
    return [run(cluster.router_address, p) for p in PROMPTS]


def run(router: str, prompt: list[int]) -> list[int]:
    ids, _, finish, _ = generate(router, token_ids=prompt, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert finish, "no finish reason"
    return ids


def control(router: str):
    """RouterControl of the router whose control listener is `router`."""
    return rpb_grpc.RouterControlStub(rpc.make_channel(router, ROUTER))


def members(router: str) -> dict[str, rpb.WorkerMember]:
    resp = control(router).ListWorkers(rpb.ListWorkersRequest(), timeout=10)
    return {m.address: m for m in resp.workers}


def wait_for(what: str, cond, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout_s}s: {what}")


def set_role(worker: str, role: int) -> wpb.SetRoleResponse:
    with rpc.make_channel(worker, WORKER) as ch:
        return wpb_grpc.WorkerStub(ch).SetRole(
            wpb.SetRoleRequest(role=role, drain=True, drain_timeout_s=120), timeout=150)


def switch(router: str, worker: str, role: int) -> None:
    """What the controller does: out of its pool, drain and switch, back in the new pool."""
    ctl = control(router)
    ctl.SetWorkerState(rpb.SetWorkerStateRequest(address=worker, state=rpb.MEMBER_STATE_DRAINING,
                                                 reason="test: role switch"), timeout=10)
    set_role(worker, role)
    ctl.SetWorkerState(rpb.SetWorkerStateRequest(address=worker, state=rpb.MEMBER_STATE_ACTIVE,
                                                 role=role), timeout=10)


def signals(router: str) -> rpb.RouterSignals:
    return control(router).GetSignals(rpb.GetSignalsRequest(window_s=600), timeout=10)


def test_drain_and_switch_mid_load_loses_no_request_and_changes_no_token(cluster, baseline):
    victim = cluster.worker_addresses("prefill")[1]
    switches = worker_stats(victim).role_switches
    errors: list[BaseException] = []

    def switch_to_decode():
        try:
            switch(cluster.router_control_address, victim, wpb.ROLE_DECODE)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    switcher = threading.Thread(target=switch_to_decode)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = []
        for i, p in enumerate(PROMPTS):
            futures.append(pool.submit(run, cluster.router_address, p))
            if i == 7:  # the first requests are in flight, the rest still to come
                switcher.start()
            time.sleep(0.03)
        outputs = [f.result() for f in futures]
    switcher.join()
    assert not errors, errors
    assert outputs == baseline
    m = members(cluster.router_control_address)[victim]
    assert (m.role, m.state) == (wpb.ROLE_DECODE, rpb.MEMBER_STATE_ACTIVE)
    assert worker_stats(victim).role_switches == switches + 1
    assert worker_stats(victim).weight_loads == 1
    # The switched worker decodes now, with the same tokens.
    assert [run(cluster.router_address, p) for p in PROMPTS[:3]] == baseline[:3]
    switch(cluster.router_control_address, victim, wpb.ROLE_PREFILL)


def test_registered_worker_serves_then_goes_gone_when_killed(cluster, stale, baseline,
                                                             tiny_llama_dir):
    addr = f"127.0.0.1:{free_port()}"
    proc = start_process([sys.executable, "-m", "pdserve.worker", "--role", "decode", "--model",
                          tiny_llama_dir, "--address", addr, "--store-address",
                          cluster.store_address, "--num-blocks", "256", "--block-size-tokens",
                          "16", "--threads", "1"], addr, timeout_s=180)
    try:
        ctl = control(cluster.router_control_address)
        m = ctl.RegisterWorker(rpb.RegisterWorkerRequest(address=addr), timeout=10)
        assert (m.role, m.state) == (wpb.ROLE_DECODE, rpb.MEMBER_STATE_ACTIVE)
        assert m.stats.role == wpb.ROLE_DECODE and m.last_seen_age_s >= 0
        # Idempotent: registering again changes nothing.
        again = ctl.RegisterWorker(rpb.RegisterWorkerRequest(address=addr), timeout=10)
        assert (again.role, again.state) == (m.role, m.state)
        with ThreadPoolExecutor(8) as pool:
            outputs = list(pool.map(lambda p: run(cluster.router_address, p), PROMPTS[:8]))
        assert outputs == baseline[:8]
        assert worker_stats(addr).requests_finished > 0, "the registered worker got no request"

        control(stale.control).RegisterWorker(rpb.RegisterWorkerRequest(address=addr,
                                                                role=wpb.ROLE_DECODE), timeout=10)
        retries = signals(stale.control).retries_total
        proc.kill()
        proc.wait()
        # Round-robin over both decode workers: of two requests, one at least meets the dead
        # worker (the stale router never polls it) and must be re-routed, not failed.
        assert [run(stale.address, p) for p in PROMPTS[:2]] == baseline[:2]
        assert signals(stale.control).retries_total > retries
        control(stale.control).SetWorkerState(rpb.SetWorkerStateRequest(
            address=addr, state=rpb.MEMBER_STATE_GONE), timeout=10)
        outputs, deadline = [], time.monotonic() + 20
        while members(cluster.router_control_address)[addr].state != rpb.MEMBER_STATE_GONE:
            assert time.monotonic() < deadline, "the killed worker was never marked GONE"
            outputs.append(run(cluster.router_address, PROMPTS[len(outputs) % 8]))
        assert outputs == [baseline[i % 8] for i in range(len(outputs))]
        m = members(cluster.router_control_address)[addr]
        assert m.missed_polls >= 3 and "poll" in m.reason
        assert run(cluster.router_address, PROMPTS[9]) == baseline[9]
        # GONE through the control API forgets it.
        ctl.SetWorkerState(rpb.SetWorkerStateRequest(address=addr, state=rpb.MEMBER_STATE_GONE),
                           timeout=10)
        assert addr not in members(cluster.router_control_address)
    finally:
        stop_process(proc)


def test_worker_switched_behind_the_routers_back_is_retried_not_failed(cluster, stale,
                                                                      baseline):
    prefill = cluster.worker_addresses("prefill")
    try:
        set_role(prefill[0], wpb.ROLE_DECODE)  # nobody tells the routers
        before = signals(stale.control)
        outputs = [run(stale.address, p) for p in PROMPTS[:4]]
        assert outputs == baseline[:4]
        s = signals(stale.control)
        # Round-robin over the two prefill workers sends some of the four to the switched one.
        assert s.retries_total > before.retries_total
        new = s.samples[len(s.samples) - 4:]
        assert sum(x.retries for x in new) == s.retries_total - before.retries_total
        assert all(x.finish == "length" and x.output_tokens == MAX_TOKENS for x in new)
        # The main router's poll sees the reported role and moves the worker to that pool.
        wait_for("the switched worker in the decode pool", lambda: members(
            cluster.router_control_address)[prefill[0]].role == wpb.ROLE_DECODE)
    finally:
        set_role(prefill[0], wpb.ROLE_PREFILL)
    wait_for("the worker back in the prefill pool", lambda: members(
        cluster.router_control_address)[prefill[0]].role == wpb.ROLE_PREFILL)


def test_control_api_names_bad_fields_and_unknown_workers(cluster):
    ctl = control(cluster.router_control_address)
    with pytest.raises(grpc.RpcError) as e:
        ctl.SetWorkerState(rpb.SetWorkerStateRequest(address="127.0.0.1:1",
                                                     state=rpb.MEMBER_STATE_DRAINING), timeout=10)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and "127.0.0.1:1" in e.value.details()
    prefill = cluster.worker_addresses("prefill")[0]
    with pytest.raises(grpc.RpcError) as e:
        ctl.SetOffloadBudgets(rpb.SetOffloadBudgetsRequest(budgets=[
            rpb.OffloadBudget(address=prefill, max_tokens=100, chunk_tokens=16)]), timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("budgets.address")
    dead = f"127.0.0.1:{free_port()}"
    with pytest.raises(grpc.RpcError) as e:
        ctl.RegisterWorker(rpb.RegisterWorkerRequest(address=dead), timeout=30)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and dead in e.value.details()
    assert dead not in members(cluster.router_control_address)


def test_offloaded_requests_keep_their_tokens(cluster, baseline):
    decode = cluster.worker_addresses("decode")[0]
    before = worker_stats(decode).local_prefill_requests
    totals = signals(cluster.router_control_address)
    ctl = control(cluster.router_control_address)
    ctl.SetOffloadBudgets(rpb.SetOffloadBudgetsRequest(budgets=[
        rpb.OffloadBudget(address=decode, max_tokens=4096, chunk_tokens=16)]), timeout=10)
    try:
        assert members(cluster.router_control_address)[decode].offload_budget_tokens == 4096
        outputs = [run(cluster.router_address, p) for p in PROMPTS[:3]]
    finally:
        ctl.SetOffloadBudgets(rpb.SetOffloadBudgetsRequest(), timeout=10)
    assert outputs == baseline[:3]
    assert worker_stats(decode).local_prefill_requests == before + 3
    s = signals(cluster.router_control_address)
    assert s.offloaded_requests_total == totals.offloaded_requests_total + 3
    assert s.offloaded_tokens_total - totals.offloaded_tokens_total == sum(map(len, PROMPTS[:3]))
    assert [x.offloaded for x in s.samples[-3:]] == [True] * 3
    assert members(cluster.router_control_address)[decode].offload_in_flight_tokens == 0


def deflections(cluster) -> dict[str, float]:
    """The router's pdserve:deflections_total by choice."""
    with urllib.request.urlopen(f"http://{cluster.http_address}/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("pdserve:deflections_total{"):
            choice = line.split('choice="', 1)[1].split('"', 1)[0]
            out[choice] = float(line.rsplit(" ", 1)[1])
    return out


def test_each_request_records_its_deflection_and_the_faster_side_serves_it(cluster, baseline):
    """Budgets with a step time: the router weighs the prefill pool's estimated time to first
    token (its measured rate) against the decode worker's (chunks of the prompt, a step each),
    sends the request to the faster side, and records the path, the choice and both
    estimates in the request's sample and the choice in pdserve:deflections_total."""
    router, decode = cluster.router_control_address, cluster.worker_addresses("decode")[0]

    def rate_measured():
        with urllib.request.urlopen(f"http://{cluster.http_address}/health", timeout=30) as r:
            if json.loads(r.read())["prefill_tokens_per_s"]:
                return True
        run(cluster.router_address, PROMPTS[-1])  # prefill work for the polls to measure
        return False

    wait_for("a measured prefill rate", rate_measured, 120)
    before = deflections(cluster)
    ctl = control(router)
    got = []
    try:
        # Prefill 16 tokens a step, steps of a minute: the idle pool is faster.
        ctl.SetOffloadBudgets(rpb.SetOffloadBudgetsRequest(budgets=[rpb.OffloadBudget(
            address=decode, max_tokens=4096, chunk_tokens=16, step_s=60.0)]), timeout=10)
        got.append(run(cluster.router_address, PROMPTS[0]))
        kept = signals(router).samples[-1]
        # Steps of a microsecond: the decode worker is faster.
        ctl.SetOffloadBudgets(rpb.SetOffloadBudgetsRequest(budgets=[rpb.OffloadBudget(
            address=decode, max_tokens=4096, chunk_tokens=16, step_s=1e-6)]), timeout=10)
        got.append(run(cluster.router_address, PROMPTS[1]))
        sent = signals(router).samples[-1]
    finally:
        ctl.SetOffloadBudgets(rpb.SetOffloadBudgetsRequest(), timeout=10)
    assert got == baseline[:2]
    steps = [-(-len(p) // 16) for p in PROMPTS[:2]]
    assert (kept.path, kept.deflection, kept.offloaded) == ("disaggregated", "prefill", False)
    assert kept.decode_ttft_estimate_s == pytest.approx(steps[0] * 60.0)
    assert 0 < kept.prefill_ttft_estimate_s < kept.decode_ttft_estimate_s
    assert (sent.path, sent.deflection, sent.offloaded) == ("offload", "decode", True)
    assert sent.decode_ttft_estimate_s == pytest.approx(steps[1] * 1e-6)
    assert 0 < sent.decode_ttft_estimate_s < sent.prefill_ttft_estimate_s
    after = deflections(cluster)
    assert {c: after.get(c, 0) - before.get(c, 0) for c in ("decode", "prefill")} == {
        "decode": 1, "prefill": 1}
    assert members(router)[decode].offload_in_flight_tokens == 0


def test_health_follows_membership(cluster, tiny_llama_dir):
    """A router with no workers yet: NOT_SERVING until a decode worker is ACTIVE (a prefill
    worker alone cannot finish a request)."""
    address = f"127.0.0.1:{free_port()}"
    with tempfile.TemporaryFile() as log:
        control_address = f"127.0.0.1:{free_port()}"
        proc = subprocess.Popen([sys.executable, "-m", "pdserve.router", "--model", tiny_llama_dir,
                                 "--address", address, "--control-address", control_address,
                                 "--stats-interval-s", str(POLL_S)],
                                stdout=log, stderr=subprocess.STDOUT)
        try:
            rpc.wait_healthy(control_address, 120, service="pdserve.v1.RouterControl",
                             peer=ROUTER)
            health = health_pb2_grpc.HealthStub(rpc.make_channel(address, rpc.PUBLIC))

            def status() -> int:
                return health.Check(health_pb2.HealthCheckRequest(), timeout=10).status

            ctl = control(control_address)
            assert status() == health_pb2.HealthCheckResponse.NOT_SERVING
            prefill = cluster.worker_addresses("prefill")[0]
            decode = cluster.worker_addresses("decode")[0]
            ctl.RegisterWorker(rpb.RegisterWorkerRequest(address=prefill), timeout=10)
            assert status() == health_pb2.HealthCheckResponse.NOT_SERVING
            ctl.RegisterWorker(rpb.RegisterWorkerRequest(address=decode, role=wpb.ROLE_DECODE),
                               timeout=10)
            assert status() == health_pb2.HealthCheckResponse.SERVING
            assert len(run(address, PROMPTS[0])) == MAX_TOKENS
            ctl.SetWorkerState(rpb.SetWorkerStateRequest(
                address=decode, state=rpb.MEMBER_STATE_DRAINING), timeout=10)
            assert status() == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.RpcError) as e:
                run(address, PROMPTS[0])
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert e.value.details().startswith("no decode worker is active")
        finally:
            proc.terminate()
            proc.wait(timeout=15)
