"""An emulated cluster of 16 workers (4 prefill, 12 decode; store, router, controller, with
supervision) under streaming load: a rebalance that flips workers mid-stream, then kill -9 of a
decode worker and of a prefill worker. Every request must end with exactly the emulated model's
tokens for its id (`engine/emulated.token_of`): none lost, none repeated, none out of order.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from pdserve import rpc
from pdserve.bench.chaos import run_fault
from pdserve.bench.chaos_client import StreamClient, workload
from pdserve.engine.checkpoint_config import load_model_config
from pdserve.engine.emulated import token_of
from pdserve.launcher.local import LocalCluster
from pdserve.proto import worker_pb2 as wpb
from pdserve.proto import worker_pb2_grpc as wpb_grpc
from tests.e2e.conftest import cluster_spec
from tests.helpers import REPO_ROOT

REQUESTS = 40
MAX_TOKENS = 160


@pytest.fixture(scope="module")
def emulated16(smollm2_gguf_path):
    spec = cluster_spec(smollm2_gguf_path, prefill_workers=4, decode_workers=12,
                        engine="emulated", profile="h100-llama3-8b", kv_scale=1 / 256,
                        controller=True, controller_mode="advisory", supervise=True,
                        router_settings={"stats_interval_s": 0.5})
    config = load_model_config(smollm2_gguf_path)
    with LocalCluster(spec) as cluster:
        yield cluster, config


def _expected(specs, config) -> list[list[int]]:
    eos = frozenset(config.eos_token_ids)
    return [[token_of(s.request_id, i, s.seed if s.temperature > 0 else None,
                      config.vocab_size, eos) for i in range(s.max_tokens)] for s in specs]


def _roles(cluster) -> dict[str, int]:
    out = {"prefill": 0, "decode": 0}
    for c in cluster.children:
        if c.name.startswith(("prefill-", "decode-")):
            with rpc.make_channel(c.address, "worker") as ch:
                role = wpb_grpc.WorkerStub(ch).GetStats(wpb.GetStatsRequest(), timeout=10).role
            out["prefill" if role == wpb.ROLE_PREFILL else "decode"] += 1
    return out


def test_a_rebalance_mid_stream_loses_and_repeats_no_token(emulated16):
    cluster, config = emulated16
    specs = workload(REQUESTS, 40, MAX_TOKENS, config.vocab_size, seed=1, ids="flip-")
    want = _expected(specs, config)
    deadline = time.monotonic() + 300
    clients = [StreamClient(cluster.router_address, s, deadline) for s in specs]
    for c in clients:
        c.start()
        time.sleep(0.02)
    while sum(len(c.ids) >= 8 for c in clients) < REQUESTS // 2:
        time.sleep(0.02)
    streaming = sum(c.is_alive() for c in clients)
    cmd = [sys.executable, "-m", "pdserve.cli", "ctl", "--address",
           cluster.controller_address, "--tls-dir", cluster.security.folder.path,
           "rebalance", "--prefill", "8", "--decode", "8", "--drain-timeout", "60"]
    p = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert streaming >= REQUESTS // 2  # the flips came mid-stream
    for c in clients:
        c.join(timeout=max(1.0, deadline - time.monotonic()))
    assert [c.error for c in clients if c.error] == []
    assert [c.ids for c in clients] == want
    assert _roles(cluster) == {"prefill": 8, "decode": 8}


@pytest.mark.parametrize("fault", ["decode", "prefill"])
def test_kill_9_of_an_emulated_worker_loses_and_repeats_no_token(emulated16, fault):
    cluster, config = emulated16
    specs = workload(REQUESTS, 40, MAX_TOKENS, config.vocab_size, seed=2, ids=f"kill-{fault}-")
    r = run_fault(cluster, fault, specs, _expected(specs, config))
    assert r.in_flight_at_kill >= 12, r  # and the rest sent while it is down
    assert (r.lost, r.wrong, r.completed_correct) == (0, 0, REQUESTS), r
    assert r.restarted and r.heal_s is not None and r.serves_after, r
    assert r.not_serving_s == 0.0, r
