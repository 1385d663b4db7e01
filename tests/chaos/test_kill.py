"""kill -9 of each process kind under 20 streaming requests (tiny Llama, 2 prefill + 2 decode
workers, store master and node, router, controller: real processes on loopback, one cluster
that the tests break one process at a time).

For every fault: each request completes with exactly the tokens of a fault-free run (even
requests greedy, odd ones sampled with their own seed), the killed process is restarted and
healthy again, the router's health never says NOT_SERVING while something could serve (only a
dead router itself is "not serving", and only until its replacement answers), and the cluster
serves a fresh request afterwards. After the cluster stops, none of its processes and none of
its shared-memory segments is left.
"""

from __future__ import annotations

import os

import pytest

from pdserve.bench.chaos import reference, run_fault
from pdserve.bench.chaos_client import workload
from pdserve.launcher.local import LocalCluster
from tests.e2e.conftest import cluster_spec

REQUESTS = 20
MAX_TOKENS = 120
# The router goes last: its clients resend, which the other faults must never need.
ORDER = ("decode", "prefill", "node", "master", "controller", "router")


def _shm() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def _pids_with(text: str) -> list[int]:
    """Live processes whose command line mentions `text` (e.g. the cluster's log dir)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    out.append(int(pid))
        except OSError:
            continue
    return out


@pytest.fixture(scope="module")
def chaos(tiny_llama_dir):
    """(cluster, specs, fault-free tokens); on teardown, checks nothing is left behind."""
    from pdserve.engine.loader import load_model_config

    spec = cluster_spec(tiny_llama_dir, prefill_workers=2, decode_workers=2, num_blocks=256,
                        controller=True, controller_mode="advisory", supervise=True,
                        router_settings={"stats_interval_s": 0.2})
    cluster = LocalCluster(spec).start()
    try:
        specs = workload(REQUESTS, 24, MAX_TOKENS, load_model_config(tiny_llama_dir).vocab_size)
        yield cluster, specs, reference(cluster.router_address, specs)
    finally:
        cluster.stop()
    left = _pids_with(cluster.cluster_id) + _pids_with(cluster.router_address)
    assert left == [], f"processes of the cluster outlived its stop(): {left}"
    segments = [n for n in _shm() if cluster.cluster_id in n]
    assert segments == [], f"shared-memory segments outlived the cluster: {segments}"


@pytest.mark.parametrize("fault", ORDER)
def test_kill_9_loses_no_request_and_heals(chaos, fault):
    cluster, specs, ref = chaos
    r = run_fault(cluster, fault, specs, ref)
    assert r.in_flight_at_kill >= 12, r  # and the rest sent while it is down
    assert (r.lost, r.wrong, r.completed_correct) == (0, 0, REQUESTS), r
    assert r.restarted and r.heal_s is not None, r
    assert r.serves_after, r
    if fault == "router":
        assert r.not_serving_s <= r.heal_s + 1.0, r
    else:
        assert r.not_serving_s == 0.0, r
        assert r.resends == 0, r
