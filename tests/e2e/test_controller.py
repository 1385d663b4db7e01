"""The controller end to end on a real 2 prefill + 2 decode cluster (tiny Llama, loopback).

- A prefill-heavy burst makes the controller flip a decode worker to prefill while 20+
  requests are in flight, and a decode-heavy phase flips one back; no request fails, every
  greedy output equals the engine's, and the workers' role_switches agree with the audit log.
- Prefill offload: with prefill pressured, decode workers prefill requests themselves within
  their budgets; the running decodes' inter-token gaps stay within the ITL SLO; same tokens.
- A controller stopped while a flip drains finishes the flip and logs it as done, instead of
  closing its channel under it (which left the worker out of both pools, logged as failed).
The controller runs as its own process (`python -m pdserve.controller`) in each test, over one
cluster whose roles every test puts back to 2:2.
"""

from __future__ import annotations

import random
import sys
import threading
import time

import grpc
import pytest

from pdserve import rpc
from pdserve.controller.audit import read_records
from pdserve.core.identity import CONTROLLER, ROUTER, WORKER
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling import SamplingParams
from pdserve.proto import api_pb2, api_pb2_grpc, common_pb2
from pdserve.proto import router_pb2 as rpb
from pdserve.proto import router_pb2_grpc as rpb_grpc
from pdserve.proto import worker_pb2 as wpb
from tests.e2e.test_cluster import worker_stats
from tests.helpers import free_port, process_output, start_process, stop_process



@pytest.fixture
def cluster(tiny_2p2d_cluster):
    return tiny_2p2d_cluster


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    """Greedy outputs of the single-process engine, computed on demand and remembered."""
    engine = LLMEngine(EngineConfig(tiny_llama_dir, cache=CacheConfig(num_blocks=512)))
    memo: dict[tuple, list[int]] = {}

    def ref(prompt: list[int], max_tokens: int) -> list[int]:
        key = (tuple(prompt), max_tokens)
        if key not in memo:
            memo[key] = engine.generate([prompt], SamplingParams(max_tokens=max_tokens,
                                                                 ignore_eos=True))[0]
        return memo[key]
    return ref


def start_controller(cluster, tmp_path, *args: str):
    address = f"127.0.0.1:{free_port()}"
    audit = str(tmp_path / "audit.jsonl")
    proc = start_process([sys.executable, "-m", "pdserve.controller", "--router",
                          cluster.router_control_address, "--address", address, "--audit-log",
                          audit, "--tick-s", "0.5", "--metrics-port", "0", *args], address,
                         timeout_s=60, peer=CONTROLLER)
    return proc, address, audit


def metrics_of(proc) -> str:
    """The controller's Prometheus page (its URL is in the ready line)."""
    import urllib.request

    url = wait_for(lambda: next((w.split("=", 1)[1] for w in process_output(proc)[0].split()
                                 if w.startswith("metrics=")), None), 10, "the ready line")
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def members(cluster) -> dict[str, rpb.WorkerMember]:
    with rpc.make_channel(cluster.router_control_address, ROUTER) as ch:
        resp = rpb_grpc.RouterControlStub(ch).ListWorkers(rpb.ListWorkersRequest(), timeout=10)
    return {m.address: m for m in resp.workers}


def roles(cluster) -> dict[str, int]:
    return {a: worker_stats(a).role for a in members(cluster)}


def restore_two_two(cluster, addresses_by_role: dict[str, list[str]]) -> None:
    """Put every worker back in the role it started in (direct SetRole + membership)."""
    from pdserve.proto import worker_pb2_grpc as wpb_grpc

    with rpc.make_channel(cluster.router_control_address, ROUTER) as rch:
        router = rpb_grpc.RouterControlStub(rch)
        for role, addrs in addresses_by_role.items():
            r = wpb.ROLE_PREFILL if role == "prefill" else wpb.ROLE_DECODE
            for a in addrs:
                with rpc.make_channel(a, WORKER) as ch:
                    wpb_grpc.WorkerStub(ch).SetRole(wpb.SetRoleRequest(
                        role=r, drain=True, drain_timeout_s=60), timeout=90)
                router.SetWorkerState(rpb.SetWorkerStateRequest(
                    address=a, state=rpb.MEMBER_STATE_ACTIVE, role=r), timeout=10)


class Load:
    """Closed-loop clients: each keeps one greedy request in flight, from its own prompt list,
    recording (prompt, max_tokens, tokens, token arrival times) or the error."""

    def __init__(self, address: str, prompts: list[list[int]], max_tokens: int,
                 concurrency: int) -> None:
        self.address = address
        self.prompts = prompts
        self.max_tokens = max_tokens
        self.concurrency = concurrency
        self.done: list[tuple[list[int], int, list[int], list[float]]] = []
        self.errors: list[str] = []
        self.in_flight = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(i,), daemon=True)
                         for i in range(concurrency)]

    def start(self) -> "Load":
        for t in self._threads:
            t.start()
        return self

    def _client(self, i: int) -> None:
        k = i
        with rpc.make_channel(self.address, rpc.PUBLIC) as ch:
            stub = api_pb2_grpc.GenerationStub(ch)
            while not self._stop.is_set():
                prompt = self.prompts[k % len(self.prompts)]
                k += self.concurrency
                req = api_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(
                    max_tokens=self.max_tokens, ignore_eos=True))
                req.token_ids.ids.extend(prompt)
                with self._lock:
                    self.in_flight += 1
                ids, times = [], []
                try:
                    for r in stub.Generate(req, timeout=120):
                        if r.token_ids:
                            ids.extend(r.token_ids)
                            times.append(time.monotonic())
                    with self._lock:
                        self.done.append((prompt, self.max_tokens, ids, times))
                except grpc.RpcError as e:
                    with self._lock:
                        self.errors.append(f"{e.code().name}: {e.details()}")
                finally:
                    with self._lock:
                        self.in_flight -= 1

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=180)


def wait_for(cond, timeout_s: float, what: str, poll_s: float = 0.25, why=None):
    """cond() once it is truthy; on timeout an AssertionError with `why()` (the state that
    explains it, e.g. the controller's last decisions)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}"
                         + (f"\n{why()}" if why else ""))


def last_decisions(audit: str, n: int = 6) -> str:
    """The controller's last `n` decisions: reason and pressures, one line each."""
    lines = []
    for r in [r for r in read_records(audit) if r.get("event") == "decision"][-n:]:
        inp = r["input"]
        ratio = {k: {f: round(x, 3) for f, x in inp[k].items() if isinstance(x, float)}
                 for k in ("prefill", "decode")}
        lines.append(f"pressures {ratio}: "
                     f"{r['decision']['reason']}")
    return "\n".join(lines) or "(no decision logged)"


def flips(audit: str, to_role: str) -> list[dict]:
    return [r for r in read_records(audit) if r.get("event") == "flip" and r["ok"]
            and r["to_role"] == to_role and r["from_role"] != to_role]


def long_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 30000) for _ in range(length)] for _ in range(n)]


def test_prefill_burst_flips_a_decode_worker_and_a_decode_phase_flips_back(
        cluster, reference, tmp_path):
    start = {r: cluster.worker_addresses(r) for r in ("prefill", "decode")}
    before = {a: worker_stats(a).role_switches for a in members(cluster)}
    proc, _, audit = start_controller(
        cluster, tmp_path, "--fluid-token", "false", "--sustain-s", "1", "--cooldown-s", "2",
        "--ttft-slo-ms", "100", "--itl-slo-ms", "1000", "--window-s", "10")
    try:
        # Phase 1, prefill-heavy: 24 clients keep 300-token prompts with 4-token answers coming.
        burst = Load(cluster.router_address, long_prompts(24, 300, seed=1), 4, 24).start()
        try:
            wait_for(lambda: flips(audit, "prefill"), 90, "a flip toward prefill",
                     why=lambda: last_decisions(audit))
            in_flight_at_flip = burst.in_flight
        finally:
            burst.stop()
        assert in_flight_at_flip >= 20
        wait_for(lambda: sorted(roles(cluster).values()).count(wpb.ROLE_PREFILL) == 3, 30,
                 "3 prefill workers")
        # Phase 2, decode-heavy: short prompts, long answers fill the lone decode worker's KV.
        long_answers = Load(cluster.router_address, long_prompts(30, 20, seed=2), 300, 30).start()
        try:
            wait_for(lambda: flips(audit, "decode"), 120, "a flip back toward decode",
                     why=lambda: last_decisions(audit))
        finally:
            long_answers.stop()
        page = metrics_of(proc)
        assert 'pdserve:role_switches_total{from="decode",to="prefill"}' in page
        assert 'pdserve:role_switches_total{from="prefill",to="decode"}' in page
        assert 'pdserve:controller_decisions_total{action="flip"' in page
        assert "pdserve:role_switch_seconds_count" in page
        assert 'pdserve:workers{role="prefill",state="serving"}' in page
        assert 'pdserve:pressure{role="prefill"}' in page
    finally:
        assert stop_process(proc, timeout_s=15) == 0
    try:
        assert burst.errors == [] and long_answers.errors == []
        assert len(burst.done) >= 24 and len(long_answers.done) >= 1
        for prompt, max_tokens, ids, _ in burst.done + long_answers.done:
            assert ids == reference(prompt, max_tokens)
        # The workers' own switch counters agree with the audit log's completed flips.
        after = {a: worker_stats(a).role_switches for a in members(cluster)}
        logged = [r for r in read_records(audit) if r.get("event") == "flip" and r["ok"]
                  and r["from_role"] != r["to_role"]]
        assert sum(after.values()) - sum(before.values()) == len(logged) >= 2
        for r in logged:
            assert after[r["address"]] > before[r["address"]]
        assert all(worker_stats(a).weight_loads == 1 for a in after)
        assert all(m.state == rpb.MEMBER_STATE_ACTIVE for m in members(cluster).values())
        decisions = [r for r in read_records(audit) if r.get("event") == "decision"]
        assert decisions and all(r["input"]["prefill"] and r["decision"]["reason"]
                                 for r in decisions)
    finally:
        restore_two_two(cluster, start)


def calibrated_itl_slo_s(cluster, floor_s: float = 0.2) -> float:
    """An ITL SLO this machine can keep: at least `floor_s`, and at least 4x the p90 gap of
    4 long answers decoding with nothing else running (a slow CI host decodes slower, and an
    SLO it cannot meet even unloaded would leave decode no slack to offload onto)."""
    alone = Load(cluster.router_address, long_prompts(4, 16, seed=5), 40, 4).start()
    wait_for(lambda: len(alone.done) >= 4, 120, "4 calibration answers")
    alone.stop()
    assert alone.errors == []
    gaps = sorted(b - a for *_, times in alone.done for a, b in zip(times, times[1:]))
    return max(floor_s, 4 * gaps[int(0.9 * (len(gaps) - 1))])


def test_decode_workers_prefill_within_budget_and_keep_their_itl(cluster, reference, tmp_path):
    # A chunk step must fit both the ITL share (0.8 x the ITL SLO) and the TTFT share (0.8 x
    # the TTFT SLO); both SLOs scale with this machine's unloaded decode pace.
    itl_slo_s = calibrated_itl_slo_s(cluster)
    ttft_slo_s = 1.25 * itl_slo_s
    proc, _, audit = start_controller(
        cluster, tmp_path, "--fluid-role", "false", "--ttft-slo-ms", f"{1000 * ttft_slo_s:.0f}",
        "--ttft-share", "0.8", "--itl-slo-ms", f"{1000 * itl_slo_s:.0f}")
    budgets_seen: dict[str, list[tuple[int, int]]] = {}  # worker -> (in flight, budget)
    try:
        decodes = Load(cluster.router_address, long_prompts(4, 16, seed=3), 200, 4).start()
        burst = Load(cluster.router_address, long_prompts(24, 100, seed=4), 2, 24).start()
        try:
            def offloaded():
                ms = members(cluster)
                for address, m in ms.items():
                    if m.offload_budget_tokens:
                        budgets_seen.setdefault(address, []).append(
                            (m.offload_in_flight_tokens, m.offload_budget_tokens))
                with rpc.make_channel(cluster.router_control_address, ROUTER) as ch:
                    sig = rpb_grpc.RouterControlStub(ch).GetSignals(
                        rpb.GetSignalsRequest(window_s=600), timeout=10)
                burst_offloaded = sum(1 for x in sig.samples
                                      if x.offloaded and x.prompt_tokens == 100)
                # Prefills of the burst ran on decode workers while long answers were decoding.
                return burst_offloaded >= 3 and len(decodes.done) >= 4
            wait_for(offloaded, 120, "3 burst requests prefilled on decode workers",
                     why=lambda: f"{len(decodes.done)} long answers done, errors "
                                 f"{burst.errors + decodes.errors}\n{last_decisions(audit)}")
        finally:
            burst.stop()
            decodes.stop()
    finally:
        assert stop_process(proc, timeout_s=15) == 0
    assert burst.errors == [] and decodes.errors == []
    for prompt, max_tokens, ids, _ in burst.done + decodes.done:
        assert ids == reference(prompt, max_tokens)
    budgets = [r["decision"]["budgets"] for r in read_records(audit)
               if r.get("event") == "decision" and r["decision"]["budgets"]]
    assert budgets, "no decision gave a budget"
    # The router admits an offload only within the budget. A budget the controller lowers
    # while offloads are in flight can leave more in flight than the new budget, but never
    # more than the largest budget the controller gave that worker.
    largest: dict[str, int] = {}
    for b in (b for d in budgets for b in d):
        largest[b["address"]] = max(largest.get(b["address"], 0), b["max_tokens"])
    assert budgets_seen
    for address, seen in budgets_seen.items():
        assert all(used <= max(budget, largest[address]) for used, budget in seen), \
            (address, seen, largest)
    # The running decodes (long answers) kept their pace while decode workers prefilled.
    gaps = sorted(b - a for *_, times in decodes.done for a, b in zip(times, times[1:]))
    assert gaps, "no long answer finished"
    p90 = gaps[int(0.9 * (len(gaps) - 1))]
    assert p90 <= itl_slo_s, f"ITL p90 {p90:.3f}s over the {itl_slo_s:.3f} s SLO"


def test_a_flip_in_flight_when_the_controller_stops_is_finished_and_logged(
        cluster, reference, tmp_path):
    from pdserve.controller.config import ControllerConfig
    from pdserve.controller.connector import LiveConnector
    from pdserve.controller.routers import Routers
    from pdserve.controller.service import Controller

    start = {r: cluster.worker_addresses(r) for r in ("prefill", "decode")}
    before = {a: worker_stats(a).role_switches for a in members(cluster)}
    audit = str(tmp_path / "audit.jsonl")
    # Long answers keep both decode workers busy, so a flip of one drains for a while.
    load = Load(cluster.router_address, long_prompts(4, 20, seed=3), 400, 4).start()
    try:
        busy = wait_for(lambda: [a for a in start["decode"] if worker_stats(a).num_running],
                        60, "a decode worker with requests running")
        ctl = Controller(ControllerConfig(
            router_address=cluster.router_control_address, store_address=cluster.store_address,
            audit_log=audit, drain_timeout_s=60),
            LiveConnector(Routers(cluster.router_control_address, cluster.store_address)))
        ctl.start_flip(busy[0], "prefill", "stopping mid-flip")
        time.sleep(0.2)  # the drain has begun: the worker holds running requests
        ctl.stop()  # before: closed the channel under the flip, logged as failed
    finally:
        load.stop()
    try:
        logged = [r for r in read_records(audit) if r.get("event") == "flip"]
        assert len(logged) == 1 and logged[0]["ok"], logged
        assert logged[0]["drained_requests"] >= 1
        after = {a: worker_stats(a).role_switches for a in members(cluster)}
        assert after[busy[0]] == before[busy[0]] + 1
        assert load.errors == [] and load.done
        for prompt, max_tokens, ids, _ in load.done:
            assert ids == reference(prompt, max_tokens)
    finally:
        restore_two_two(cluster, start)
