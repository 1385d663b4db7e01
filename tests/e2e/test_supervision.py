"""The launcher restarts a child that dies, and gives up on one that cannot live.

One supervised cluster (tiny Llama, 1 prefill + 1 decode worker, router, controller, store
master and node; real processes on loopback, free ports), one fault at a time, in order:
kill -9 the prefill worker, the router, the storage node, the store master, the controller.
Each is restarted with its arguments, rejoins (the worker the router's pool, the node the
master, the master its journal), the restart counter of its kind reads 1 on the launcher's
metrics page, and a greedy request gets the single-process engine's tokens again. Last, the
decode worker is killed and its port taken, so every restart dies at once: the launcher gives
up after the policy's bound, says so in its log and the child's, and restarts it no more.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve import rpc
from pdserve.launcher.cluster_spec import free_ports
from pdserve.launcher.local import LocalCluster
from pdserve.launcher.restart import RestartPolicy
from pdserve.core.identity import CONTROLLER, MASTER, ROUTER, WORKER
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling import SamplingParams
from pdserve.proto import kvmaster_pb2 as kpb
from pdserve.proto import kvmaster_pb2_grpc as kpb_grpc
from pdserve.proto import router_pb2 as rpb
from tests.e2e.conftest import cluster_spec
from tests.e2e.test_cluster import generate, worker_stats
from tests.e2e.test_membership import members, wait_for

MAX_TOKENS = 24
# A prompt per phase, two full blocks each (block size 16): each request puts new blocks to
# the store and the decode worker fetches them, so every phase goes through the store.
PROMPTS = {phase: list(range(300 + 50 * i, 300 + 50 * i + 40)) for i, phase in enumerate(
    ("worker", "router", "node", "master", "controller"))}
# Two restarts at most within two minutes: each kind is restarted once by the faults, and the
# crash loop is given up on after its second restart.
POLICY = RestartPolicy(backoff_s=0.3, max_restarts=2, window_s=120.0)


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir):
    # Every port the launcher's way (internal ones left to it): below the ephemeral range, so
    # no connection takes one while a child restarts.
    spec = cluster_spec(tiny_llama_dir, supervise=True, restart_policy=POLICY, controller=True,
                        controller_mode="advisory", router_port=free_ports(1)[0],
                        store_port=None, worker_ports=None, controller_port=None,
                        router_settings={"stats_interval_s": 0.2})
    with LocalCluster(spec) as c:
        yield c


@pytest.fixture(scope="module")
def expected(tiny_llama_dir):
    engine = LLMEngine(EngineConfig(tiny_llama_dir, cache=CacheConfig(num_blocks=64)))
    outs = engine.generate(list(PROMPTS.values()),
                           SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    return dict(zip(PROMPTS, outs))


def child(cluster, name: str):
    [c] = [c for c in cluster.children if c.name == name]
    return c


def metric(cluster, metric_name: str, **labels) -> float:
    with urllib.request.urlopen(cluster.metrics_url, timeout=10) as r:
        text = r.read().decode()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == metric_name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise AssertionError(f"{metric_name}{labels} not on {cluster.metrics_url}:\n{text}")


def kill_and_wait_restart(cluster, name: str, kind: str):
    c = child(cluster, name)
    old = c.proc.pid
    assert metric(cluster, "pdserve:process_up", name=name) == 1.0
    os.kill(old, signal.SIGKILL)
    wait_for(f"{name} restarted", lambda: cluster.restarts.get(kind) == 1 and c.proc.pid != old,
             timeout_s=30)
    with open(c.log_path, errors="replace") as f:
        log = f.read()
    assert f"restarting {name} (exit -9), attempt 1" in log
    return c


def serves(cluster, expected, phase: str) -> None:
    decode = cluster.worker_addresses("decode")[0]
    fetched = worker_stats(decode).kv_blocks_fetched
    ids, *_ = generate(cluster.router_address, token_ids=PROMPTS[phase], max_tokens=MAX_TOKENS,
                       ignore_eos=True)
    assert ids == expected[phase]
    assert worker_stats(decode).kv_blocks_fetched >= fetched + 2  # through the store


def test_a_killed_worker_is_restarted_and_rejoins_the_router(cluster, expected):
    prefill = cluster.worker_addresses("prefill")[0]
    kill_and_wait_restart(cluster, "prefill-0", "worker")
    rpc.wait_healthy(prefill, timeout_s=120, peer=WORKER)
    wait_for("the restarted worker ACTIVE again", lambda: members(
        cluster.router_control_address)[prefill].state == rpb.MEMBER_STATE_ACTIVE)
    serves(cluster, expected, "worker")
    assert worker_stats(prefill).requests_finished == 1  # the new process prefilled it
    assert metric(cluster, "pdserve:process_restarts_total", kind="worker") == 1.0
    assert metric(cluster, "pdserve:process_up", name="prefill-0") == 1.0


def test_a_killed_router_is_restarted_with_the_workers(cluster, expected):
    kill_and_wait_restart(cluster, "router", "router")
    rpc.wait_healthy(cluster.router_address, timeout_s=60, peer=rpc.PUBLIC)
    rpc.wait_healthy(cluster.router_control_address, timeout_s=60, peer=ROUTER)
    roles = {a: m.role for a, m in members(cluster.router_control_address).items()
             if m.state == rpb.MEMBER_STATE_ACTIVE}
    assert sorted(roles) == sorted(c.address for c in cluster.children if c.kind == "worker")
    serves(cluster, expected, "router")
    assert metric(cluster, "pdserve:process_restarts_total", kind="router") == 1.0


def node_ready_lines(cluster) -> int:
    with open(child(cluster, "kvnode-0").log_path, errors="replace") as f:
        return f.read().count('"event": "ready"')


def master_stats(cluster) -> kpb.MasterStatsResponse:
    with rpc.make_channel(cluster.store_address, MASTER) as ch:
        return kpb_grpc.KVMasterStub(ch).Stats(kpb.MasterStatsRequest(), timeout=10)


def test_a_killed_storage_node_is_restarted_and_registers_again(cluster, expected):
    kill_and_wait_restart(cluster, "kvnode-0", "node")
    wait_for("the new node incarnation ready", lambda: node_ready_lines(cluster) == 2)
    wait_for("the node alive at the master", lambda: master_stats(cluster).nodes_alive == 1)
    serves(cluster, expected, "node")
    assert metric(cluster, "pdserve:process_restarts_total", kind="node") == 1.0


def test_a_killed_store_master_is_restarted_from_its_journal(cluster, expected):
    kill_and_wait_restart(cluster, "kvmaster", "master")
    rpc.wait_healthy(cluster.store_address, timeout_s=60, peer=MASTER)
    wait_for("the node alive at the restarted master",
             lambda: master_stats(cluster).nodes_alive == 1)
    serves(cluster, expected, "master")
    assert metric(cluster, "pdserve:process_restarts_total", kind="master") == 1.0


def test_a_killed_controller_is_restarted(cluster, expected):
    kill_and_wait_restart(cluster, "controller", "controller")
    rpc.wait_healthy(cluster.controller_address, timeout_s=60, peer=CONTROLLER)
    serves(cluster, expected, "controller")
    assert metric(cluster, "pdserve:process_restarts_total", kind="controller") == 1.0
    assert cluster.restarts == dict.fromkeys(("worker", "router", "node", "master",
                                              "controller"), 1)


def test_a_crash_loop_is_given_up_on_and_reported(cluster, caplog):
    caplog.set_level(logging.WARNING, logger="pdserve.launcher.supervision")
    c = child(cluster, "decode-1")
    host, port = c.address.rsplit(":", 1)
    proc = c.proc
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()  # its port is free once it is dead: take it, so every restart dies binding it
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        # Connections to the dead worker linger in TIME_WAIT; a listener still excludes
        # every other bind of the port.
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        taken.bind((host, int(port)))
        taken.listen()
        wait_for("given up on decode-1", lambda: cluster.supervision.counts()["gave_up"].get(
            "worker") == 1, timeout_s=90)
        restarts = cluster.restarts["worker"]
        assert restarts == 1 + POLICY.max_restarts  # prefill-0 once, then the loop's bound
        time.sleep(3 * POLICY.backoff_s + 1.0)  # no further restart: given up for good
        assert cluster.restarts["worker"] == restarts and c.proc.poll() is not None
    with open(c.log_path, errors="replace") as f:
        log = f.read()
    assert "restarting decode-1 (exit -9), attempt 1" in log
    assert f"restarting decode-1 (exit {c.proc.returncode}), attempt 2" in log
    assert "giving up on decode-1 (exit" in log
    [report] = [r.getMessage() for r in caplog.records if "giving up on decode-1" in r.getMessage()]
    assert f"(exit {c.proc.returncode})" in report and "cannot bind" in report  # its log's tail
    assert metric(cluster, "pdserve:process_gave_up_total", kind="worker") == 1.0
    assert metric(cluster, "pdserve:process_up", name="decode-1") == 0.0
