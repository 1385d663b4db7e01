"""The KV store is no single point of failure (tiny Llama; master, storage node, one prefill and
one decode worker and a router as real processes on loopback, a cluster of this module's own:
these tests kill its store).

(a) The storage node killed with SIGKILL under 20 streaming greedy requests: every request ends
    with exactly the single-process engine's tokens; once the master declares the node dead the
    prefill worker's puts are refused and it reports degraded (GetStats, /metrics) while the
    decode worker recomputes prompts; a new node process with the same id removes the killed
    one's segment file, registers, puts succeed again and degraded mode clears.
(b) The master killed with SIGKILL: requests keep completing (degraded: "no master answered");
    the master restarted from its journal knows the node again, and degraded mode clears.
(c) A storage node of another cluster is refused with both ids named and exits 1.
(d) With Redis HA (when redis-server is installed): the leader killed with SIGKILL under 20
    streaming requests; the standby takes over through the lease, every request completes with
    the engine's tokens, and the workers' puts reach the new leader.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from pdserve import rpc
from pdserve.core.identity import MASTER, WORKER
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling import SamplingParams
from pdserve.proto import api_pb2, api_pb2_grpc, common_pb2
from pdserve.proto import kvmaster_pb2 as mpb
from pdserve.proto import kvmaster_pb2_grpc as mpb_grpc
from tests.e2e.test_cluster import worker_stats
from tests.helpers import REPO_ROOT, free_port, process_output, start_process, stop_process
from tests.kvstore.master.conftest import redis_server  # noqa: F401 - a fixture used below
from tests.kvstore.node.conftest import start_node, stop_node

CLUSTER = "faults"
MAX_TOKENS = 24
NODE_TIMEOUT_S = 2.0
PROMPTS = [[(31 * i + 17 * j) % 900 + 5 for j in range(20 + (i * 7) % 29)] for i in range(60)]


def master_args(address: str, *store: str) -> list[str]:
    return [sys.executable, "-m", "pdserve.kvstore.master", "--address", address,
            "--node-timeout-s", str(NODE_TIMEOUT_S), "--tick-s", "0.2", "--cluster-id", CLUSTER,
            *store]


def node_args(node_id: str, masters: str, shm_dir: str, cluster: str = CLUSTER) -> list[str]:
    return [sys.executable, "-m", "pdserve.kvstore.node", "--node-id", node_id,
            "--dram-bytes", str(64 << 20), "--shm-dir", shm_dir, "--master", masters,
            "--heartbeat-s", "0.3", "--cluster-id", cluster]


def start_workers(model: str, masters: str) -> tuple[list, list[str]]:
    """A prefill and a decode worker, loading at the same time: (processes, addresses)."""
    addrs = [f"127.0.0.1:{free_port()}" for _ in range(2)]

    def start(i: int):
        return start_process([
            sys.executable, "-m", "pdserve.worker", "--role", ("prefill", "decode")[i],
            "--model", model, "--address", addrs[i], "--store-address", masters,
            "--cluster-id", CLUSTER, "--num-blocks", "512", "--threads", "1",
            "--metrics-port", "0"], addrs[i], timeout_s=240)

    with ThreadPoolExecutor(2) as pool:
        procs = list(pool.map(start, range(2)))
    return procs, addrs


def start_router(model: str, prefill: str, decode: str):
    address = f"127.0.0.1:{free_port()}"
    return start_process([sys.executable, "-m", "pdserve.router", "--model", model,
                          "--address", address, "--prefill", prefill, "--decode", decode,
                          "--max-model-len-tokens", "8192", "--stats-interval-s", "0.5"],
                         address, timeout_s=120), address


class Cluster:
    def __init__(self) -> None:
        self.procs: list = []
        self.node = None
        self.node_ready: dict = {}
        self.master = None

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                stop_process(p, timeout_s=15)
        if self.node is not None and self.node.poll() is None:
            stop_node(self.node)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    engine = LLMEngine(EngineConfig(tiny_llama_dir, cache=CacheConfig(num_blocks=512)))
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    return {i: engine.generate([p], params)[0] for i, p in enumerate(PROMPTS)}


@pytest.fixture(scope="module")
def shm_dir():
    path = tempfile.mkdtemp(prefix="pdserve-faults-", dir="/dev/shm")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir, shm_dir, tmp_path_factory):
    c = Cluster()
    c.master_address = f"127.0.0.1:{free_port()}"
    c.journal = str(tmp_path_factory.mktemp("journal"))
    try:
        c.master = start_process(master_args(c.master_address, "--journal-dir", c.journal),
                                 c.master_address)
        c.procs.append(c.master)
        c.node, c.node_ready = start_node(node_args("faults-node", c.master_address, shm_dir))
        (c.prefill_proc, c.decode_proc), (c.prefill, c.decode) = start_workers(
            tiny_llama_dir, c.master_address)
        c.procs += [c.prefill_proc, c.decode_proc]
        router, c.router = start_router(tiny_llama_dir, c.prefill, c.decode)
        c.procs.append(router)
        yield c
    finally:
        c.stop()


class Stream(threading.Thread):
    """One streaming greedy Generate on its own thread."""

    def __init__(self, router: str, i: int) -> None:
        super().__init__(daemon=True)
        self.router, self.i = router, i
        self.ids: list[int] = []
        self.finish = None
        self.error: BaseException | None = None
        self.first = threading.Event()

    def run(self) -> None:
        req = api_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(
            max_tokens=MAX_TOKENS, ignore_eos=True))
        req.token_ids.ids.extend(PROMPTS[self.i])
        try:
            with rpc.make_channel(self.router, rpc.PUBLIC) as ch:
                for r in api_pb2_grpc.GenerationStub(ch).Generate(req, timeout=240):
                    self.ids.extend(r.token_ids)
                    self.first.set()
                    if r.finish_reason:
                        self.finish = r.finish_reason
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e
        finally:
            self.first.set()


def start_streams(router: str, indices) -> list[Stream]:
    streams = [Stream(router, i) for i in indices]
    for s in streams:
        s.start()
    return streams


def check(streams: list[Stream], reference) -> None:
    for s in streams:
        s.join(timeout=240)
        assert not s.is_alive(), f"request {s.i} hangs"
        assert s.error is None, f"request {s.i}: {s.error}"
        assert s.finish == common_pb2.FINISH_REASON_LENGTH
        assert s.ids == reference[s.i], f"request {s.i}: tokens differ from the engine's"


def wait_for(what: str, cond, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while not (value := cond()):
        assert time.monotonic() < deadline, f"not within {timeout_s}s: {what}"
        time.sleep(0.1)
    return value


def metrics_url(proc) -> str:
    out, _ = process_output(proc)
    return re.search(r" metrics=(\S+)", out).group(1)


def scrape(url: str, name: str) -> float:
    with urllib.request.urlopen(url, timeout=30) as r:
        text = r.read().decode()
    return sum(float(line.rpartition(" ")[2]) for line in text.splitlines()
               if line.startswith(name))


def nodes_alive(master: str) -> int:
    with rpc.make_channel(master, MASTER) as ch:
        return mpb_grpc.KVMasterStub(ch).Stats(mpb.MasterStatsRequest(), timeout=5).nodes_alive


def test_a_storage_node_killed_under_load_loses_nothing_and_rejoins(cluster, reference,
                                                                   shm_dir):
    c = cluster
    check(start_streams(c.router, range(2)), reference)  # warm: the store serves
    assert not worker_stats(c.prefill).store_degraded
    recomputed = worker_stats(c.decode).kv_recomputed_requests
    stale = c.node_ready["segments"][0]["shm_path"]
    streams = start_streams(c.router, range(2, 12))
    streams[0].first.wait(60)
    c.node.kill()  # SIGKILL under load
    c.node.wait()
    stop_node(c.node)
    assert os.path.exists(stale)  # nobody could unlink it
    wait_for("the master declares the node dead", lambda: nodes_alive(c.master_address) == 0)
    streams += start_streams(c.router, range(12, 22))  # 20 requests across the outage
    check(streams, reference)
    stats = worker_stats(c.prefill)
    assert stats.store_degraded and "no storage node" in stats.store_degraded_reason
    assert stats.store_errors["put"] >= 1
    for worker in (c.prefill, c.decode):  # degraded still serves: health says so
        rpc.wait_healthy(worker, timeout_s=10, peer=WORKER)
    url = metrics_url(c.prefill_proc)
    assert scrape(url, "pdserve:store_degraded{") == 1
    assert scrape(url, 'pdserve:store_errors_total{model_name="') >= 1
    assert worker_stats(c.decode).kv_recomputed_requests > recomputed

    c.node, c.node_ready = start_node(node_args("faults-node", c.master_address, shm_dir))
    assert not os.path.exists(stale)  # the new incarnation removed the killed one's file
    assert os.path.exists(c.node_ready["segments"][0]["shm_path"])
    wait_for("degraded mode cleared", lambda: not worker_stats(c.prefill).store_degraded)
    put, fetched = worker_stats(c.prefill).kv_blocks_put, worker_stats(c.decode).kv_blocks_fetched
    check(start_streams(c.router, range(22, 26)), reference)
    assert worker_stats(c.prefill).kv_blocks_put > put  # puts succeed again
    assert worker_stats(c.decode).kv_blocks_fetched > fetched
    assert scrape(url, "pdserve:store_degraded{") == 0


def test_the_master_killed_under_load_then_restarted_from_its_journal(cluster, reference):
    c = cluster
    assert wait_for("a node registered", lambda: nodes_alive(c.master_address) == 1)
    c.master.kill()  # SIGKILL
    c.master.wait()
    recomputed = worker_stats(c.decode).kv_recomputed_requests
    streams = start_streams(c.router, range(26, 46))
    check(streams, reference)
    stats = worker_stats(c.prefill)
    assert stats.store_degraded and "no master answered" in stats.store_degraded_reason
    assert worker_stats(c.decode).kv_recomputed_requests >= recomputed + 1

    c.procs.remove(c.master)
    c.master = start_process(master_args(c.master_address, "--journal-dir", c.journal),
                             c.master_address)
    c.procs.append(c.master)
    assert wait_for("the node known to the restarted master",
                    lambda: nodes_alive(c.master_address) == 1)
    wait_for("degraded mode cleared", lambda: not worker_stats(c.prefill).store_degraded)
    put = worker_stats(c.prefill).kv_blocks_put
    check(start_streams(c.router, range(46, 50)), reference)
    assert worker_stats(c.prefill).kv_blocks_put > put
    assert not worker_stats(c.prefill).store_degraded


def test_a_node_of_another_cluster_is_refused_naming_both_ids(cluster, shm_dir):
    p = subprocess.run(node_args("intruder", cluster.master_address, shm_dir, "elsewhere"),
                       cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert p.returncode == 1
    assert "cluster id mismatch" in p.stderr
    assert "'elsewhere'" in p.stderr and f"'{CLUSTER}'" in p.stderr
    assert not [n for n in os.listdir(shm_dir) if "intruder" in n]
    assert nodes_alive(cluster.master_address) == 1


def is_leader(address: str) -> bool:
    with rpc.make_channel(address, MASTER) as ch:
        return mpb_grpc.KVMasterStub(ch).GetLeader(mpb.GetLeaderRequest(), timeout=5).is_leader


def test_ha_master_failover_under_load(redis_server, tiny_llama_dir, shm_dir,  # noqa: F811
                                       reference):
    masters = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    joined = ",".join(masters)
    redis = ("--redis-url", f"redis://127.0.0.1:{redis_server}", "--leader-lease-s", "2")
    c = Cluster()
    try:
        c.procs.append(start_process(master_args(masters[0], *redis), masters[0]))
        wait_for("the first master leads", lambda: is_leader(masters[0]))
        c.procs.append(start_process(master_args(masters[1], *redis), masters[1]))
        c.node, _ = start_node(node_args("ha-node", joined, shm_dir))
        wait_for("the node registered", lambda: nodes_alive(masters[0]) == 1)
        (p, d), (prefill, decode) = start_workers(tiny_llama_dir, joined)
        c.procs += [p, d]
        router, address = start_router(tiny_llama_dir, prefill, decode)
        c.procs.append(router)
        check(start_streams(address, range(50, 52)), reference)
        c.procs[0].kill()  # SIGKILL the leader
        c.procs[0].wait()
        streams = start_streams(address, range(30, 50))
        check(streams, reference)
        wait_for("the standby took over", lambda: is_leader(masters[1]))
        wait_for("the node heartbeats the new leader", lambda: nodes_alive(masters[1]) == 1)
        wait_for("degraded mode cleared", lambda: not worker_stats(prefill).store_degraded)
        put = worker_stats(prefill).kv_blocks_put
        check(start_streams(address, range(52, 56)), reference)
        assert worker_stats(prefill).kv_blocks_put > put  # puts reach the new leader
    finally:
        c.stop()
    assert not [n for n in os.listdir(shm_dir) if "ha-node" in n]  # stopped: its file is gone

