"""Degraded mode: the roles serve every request while the KV store cannot, and say so.

In one process (a prefill and a decode engine, each on its own loop) over a real distributed
store whose processes the tests start late or not at all: with no master, a prefill still
answers with its first token, the decode side recomputes the prompt and its tokens equal the
engine's alone (invariant 1); the worker reports degraded (GetStats and /metrics) until the
store serves again, then puts and fetches resume. With a master but no storage node, puts are
refused and the probe keeps the worker degraded until a node registers. A worker process of
another cluster than its store master's exits 1 naming both ids. The pure `StoreHealth` rules
are checked on their own, and so is the contract with the router: a failure a worker cannot
absorb is a status `router/retry.py` re-routes (then prefills on a decode worker), never INTERNAL.
"""

from __future__ import annotations

import subprocess
import sys
import time

import grpc
import pytest

from pdserve.worker.decode.role import DecodeRole
from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling import SamplingParams
from pdserve.kvstore.dist_client import DistStoreClient
from pdserve.kvstore.retry import StoreRetryPolicy
from pdserve.worker.prefill.role import PrefillCancelled, PrefillRole, PrefillTimeout
from pdserve.proto import worker_pb2 as wpb
from pdserve.router.retry import RETRYABLE_CODES, RetryPolicy
from pdserve.worker.engine_loop import EngineBusy, EngineLoop
from pdserve.worker.guarded_store import GuardedStore, StoreFailure
from pdserve.worker.metrics import StoreHealthCollector
from pdserve.worker.service import WorkerService, _status_of
from pdserve.worker.store_health import StoreHealth
from tests.helpers import REPO_ROOT, free_port
from tests.kvstore.test_dist_store import _env, start_master, start_node, stop

MODEL = "tiny@float32"
PROMPTS = [[(7 * i + 3) % 500 + 3 for i in range(37)],
           [(13 * i + 5) % 600 + 3 for i in range(29)],
           [(17 * i + 1) % 700 + 3 for i in range(45)]]
PARAMS = SamplingParams(max_tokens=10, ignore_eos=True)


def make_loop(path: str) -> EngineLoop:
    return EngineLoop(LLMEngine(EngineConfig(
        path, cache=CacheConfig(block_size_tokens=4, num_blocks=128),
        scheduler=SchedulerConfig(max_num_batched_tokens=16)))).start()


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    engine = LLMEngine(EngineConfig(tiny_llama_dir, cache=CacheConfig(
        block_size_tokens=4, num_blocks=128)))
    return {i: engine.generate([p], PARAMS)[0] for i, p in enumerate(PROMPTS)}


@pytest.fixture
def roles(tiny_llama_dir):
    """(store, prefill role, decode role, service) over a store at an address nobody serves
    yet; the store client's budget is short, the probe frequent."""
    master = f"127.0.0.1:{free_port()}"
    store = GuardedStore(DistStoreClient(master, retry=StoreRetryPolicy(budget_s=0.5)),
                         StoreHealth(probe_interval_s=0.3)).start(poll_s=0.05)
    p_loop, d_loop = make_loop(tiny_llama_dir), make_loop(tiny_llama_dir)
    prefill, decode = PrefillRole(p_loop, store, MODEL), DecodeRole(d_loop, store)
    service = WorkerService(d_loop, PrefillRole(d_loop, store, MODEL), decode, wpb.ROLE_DECODE,
                            MODEL)
    yield master, store, prefill, decode, service
    p_loop.stop()
    d_loop.stop()
    store.close()


def run(prefill: PrefillRole, decode: DecodeRole, i: int) -> list[int]:
    res = prefill.prefill(f"r{i}", PROMPTS[i], PARAMS)
    out = [res.first_token]
    for c in decode.decode(f"r{i}", PROMPTS[i], res.first_token, PARAMS, res.block_hashes,
                           res.keys, "", lambda: True):
        out.extend(c.token_ids)
    return out


def wait_for(what: str, cond, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while not (value := cond()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s}s"
        time.sleep(0.05)
    return value


def metrics(service: WorkerService) -> dict[str, float]:
    out = {}
    for family in StoreHealthCollector(MODEL, service.metrics_snapshot).collect():
        for s in family.samples:
            out[s.name + "".join(f",{v}" for k, v in s.labels.items() if k == "op")] = s.value
    return out


def test_no_master_requests_are_served_by_recomputation_then_the_store_catches_up(
        roles, reference, tmp_path):
    master, store, prefill, decode, service = roles
    assert run(prefill, decode, 0) == reference[0]
    view = store.view()
    assert view.degraded and "no master answered" in view.reason
    assert prefill.put_failures == 1 and prefill.blocks_put == 0
    assert decode.kv_recomputed_requests == 1 and decode.blocks_fetched == 0
    stats = service.GetStats(wpb.GetStatsRequest(), None)
    assert stats.store_degraded and "no master answered" in stats.store_degraded_reason
    assert stats.kv_recomputed_requests == 1
    assert stats.store_errors["exists"] >= 1 and stats.store_errors["get"] >= 1
    m = metrics(service)
    assert m["pdserve:store_degraded"] == 1 and m["pdserve:kv_recomputed_requests_total"] == 1
    assert m["pdserve:store_errors_total,longest_prefix"] >= 1

    # The store comes up at that address: the probe clears degraded mode without traffic ...
    procs = [start_master(master, str(tmp_path / "journal"))]
    try:
        procs.append(start_node("late-node", master)[0])
        wait_for("degraded mode cleared by the probe", lambda: not store.view().degraded)
        assert service.GetStats(wpb.GetStatsRequest(), None).store_degraded_reason == ""
        assert metrics(service)["pdserve:store_degraded"] == 0
        # ... and the next requests hand their KV over through it again.
        assert run(prefill, decode, 1) == reference[1]
        assert prefill.put_failures == 1 and prefill.blocks_put == -(-len(PROMPTS[1]) // 4)
        assert decode.blocks_fetched == prefill.blocks_put
        assert decode.kv_recomputed_requests == 1
        assert not store.view().degraded
    finally:
        for p in reversed(procs):
            stop(p)


def test_a_master_without_storage_nodes_refuses_puts_and_the_probe_waits_for_a_node(
        roles, reference, tmp_path):
    master, store, prefill, decode, service = roles
    procs = [start_master(master, str(tmp_path / "journal"))]
    try:
        # While the store is down the worker's store client fails fast; its probe finds the
        # master (which has no nodes): only then does a put reach it.
        wait_for("the probe reached the new master",
                 lambda: "no storage node" in store.view().reason)
        assert run(prefill, decode, 2) == reference[2]
        view = store.view()
        assert view.degraded and "no storage nodes are registered" in view.reason
        assert prefill.put_failures == 1 and decode.kv_recomputed_requests == 1
        time.sleep(1.0)  # several probe rounds: a master alone does not make the store whole
        view = store.view()
        assert view.degraded and view.errors.get("probe", 0) >= 1
        assert "no storage node" in view.reason
        procs.append(start_node("node-after", master)[0])
        wait_for("degraded mode cleared once a node registered",
                 lambda: not store.view().degraded)
        assert run(prefill, decode, 0) == reference[0]
        assert prefill.put_failures == 1 and prefill.blocks_put > 0
    finally:
        for p in reversed(procs):
            stop(p)


def test_a_worker_of_another_cluster_exits_one_naming_both_ids(tiny_llama_dir, tmp_path):
    master = f"127.0.0.1:{free_port()}"
    m = start_master(master, str(tmp_path / "journal"), "--cluster-id", "blue")
    try:
        p = subprocess.run([sys.executable, "-m", "pdserve.worker", "--model", tiny_llama_dir,
                            "--address", f"127.0.0.1:{free_port()}", "--store-address", master,
                            "--cluster-id", "green"], cwd=REPO_ROOT, env=_env(),
                           capture_output=True, text=True, timeout=120)
    finally:
        stop(m)
    assert p.returncode == 1, p.stderr
    assert "refused by the store master: cluster id mismatch" in p.stderr
    assert "'green'" in p.stderr and "'blue'" in p.stderr


def test_store_health_rules():
    h = StoreHealth(probe_interval_s=2.0)
    assert not h.view().degraded and not h.probe_due(100.0)
    h.failed("put", "no storage nodes are registered", 10.0)
    v = h.view()
    assert v.degraded and v.since_s == 10.0 and v.reason == "put: no storage nodes are registered"
    h.succeeded("exists", 10.5)  # another operation answering does not clear a failing put
    assert h.view().degraded and not h.probe_due(11.0) and h.probe_due(12.5)
    h.failed("get", "no master answered", 11.0)
    assert h.view().reason == "get: no master answered"
    h.failed("put", "no storage nodes are registered", 11.2)
    h.succeeded("get", 11.3)  # the latest failure still standing is named
    assert h.view().reason == "put: no storage nodes are registered"
    h.failed("get", "no master answered", 11.4)
    h.succeeded("put", 11.5)
    v = h.view()
    assert v.degraded and v.reason == "get: no master answered" and v.since_s == 10.0
    h.succeeded("get", 12.0)
    v = h.view()
    assert not v.degraded and v.reason == "" and v.since_s is None
    assert v.errors == {"put": 2, "get": 2}
    h.failed("probe", "x" * 1000, 13.0)
    assert len(h.view().reason) <= 300
    h.whole(14.0)
    assert not h.view().degraded
    with pytest.raises(ValueError, match="op must be one of"):
        h.failed("delete", "?", 1.0)
    with pytest.raises(ValueError, match="probe_interval_s"):
        StoreHealth(probe_interval_s=0)


def test_failures_a_worker_cannot_absorb_are_statuses_the_router_re_routes():
    for error in (StoreFailure("KV store unavailable (put): no master answered"),
                  EngineBusy("worker busy: nothing was done")):
        code, message = _status_of(error)
        assert code == grpc.StatusCode.UNAVAILABLE and str(error) in message
        # Re-routed to another prefill worker, then prefilled on a decode worker.
        assert code.name in RETRYABLE_CODES and RetryPolicy.prefill_fallback(code.name)
    code, message = _status_of(PrefillTimeout("prefill of r did not finish within 600s"))
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED and "did not finish" in message
    assert _status_of(PrefillCancelled("the caller went away"))[0] == grpc.StatusCode.CANCELLED
    code, message = _status_of(TimeoutError())  # never an empty message
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED and message
