"""`pdserve serve` as a user runs it: starts every part, serves, and leaves nothing behind.

- SIGTERM while a stream is in flight: the stream ends with its full output (the router stops
  first and its requests finish), then every child is gone and the storage node's
  shared-memory segment is unlinked; a second `serve` with the same log folder starts.
- kill -9 of `pdserve serve`: its children die with it.
- SIGINT while starting: the start is abandoned, every child started so far stopped.
- Two `pdserve serve` on one host with default internal ports (only the router ports differ)
  both serve the engine's tokens and stop cleanly (SIGTERM one, SIGINT the other); a third on
  a router port already taken refuses to start, saying so, before starting anything.
- The admission and key flags reach the processes: the served name is the one /v1/models lists,
  tenant keys and a tenant's rate are enforced by the router, admin keys by the controller.
"""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import httpx
import psutil
import pytest

from pdserve import rpc
from pdserve.launcher.cluster_spec import free_ports
from pdserve.core.identity import MASTER, WORKER
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling import SamplingParams
from pdserve.proto import api_pb2, api_pb2_grpc, common_pb2
from tests.e2e.test_cluster import generate
from tests.e2e.test_ctl import key_only

PROMPT = list(range(700, 740))  # two full blocks: they go through the store


def port() -> int:
    """A free port the launcher's way: outside the kernel's ephemeral range, so no outgoing
    connection takes it in the seconds before the router binds it."""
    return free_ports(1)[0]


def serve(model: str, log_dir, *flags: str) -> tuple[subprocess.Popen, dict[str, str]]:
    """A `pdserve serve` with `flags`, once ready: (process, its ready line's fields)."""
    args = [sys.executable, "-m", "pdserve.cli", "serve", "--model", model, "--num-blocks", "64",
            "--log-dir", str(log_dir), *flags]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()  # blocks until the cluster is healthy (or serve fails)
    if not line.startswith("pdserve ready on"):
        proc.kill()
        raise AssertionError(f"not ready: {line!r}; stderr:\n{proc.communicate()[1]}")
    words = line.split()
    ready = dict(w.split("=", 1) for w in words[4:])
    ready["router"] = words[3]
    return proc, ready


def segments(ready: dict[str, str]) -> list[str]:
    return glob.glob(f"/dev/shm/pdserve-node0-{ready['cluster']}.*")


KINDS = {"pdserve.router": "router", "pdserve.controller": "controller",
         "pdserve.worker": "worker", "pdserve.kvstore.node": "node",
         "pdserve.kvstore.master": "master"}
STOP_ORDER = ("router", "controller", "worker", "node", "master")


def stop_and_check(proc: subprocess.Popen, ready: dict[str, str], sig: int) -> None:
    """Signal `pdserve serve`; it exits 0, its children having exited in the stop order
    (router first, the store master last), leaving no process and no segment behind."""
    children = psutil.Process(proc.pid).children(recursive=True)
    kind = {c.pid: KINDS[c.cmdline()[c.cmdline().index("-m") + 1]] for c in children}
    assert children and segments(ready)
    exits: dict[int, float] = {}
    done = threading.Event()

    def watch() -> None:  # when each child is first seen gone
        while not done.is_set() and len(exits) < len(children):
            for c in children:
                if c.pid not in exits and not c.is_running():
                    exits[c.pid] = time.monotonic()
            time.sleep(0.005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    proc.send_signal(sig)
    try:
        assert proc.wait(timeout=60) == 0, proc.stderr.read()
        gone, alive = psutil.wait_procs(children, timeout=10)
    finally:
        done.set()
        watcher.join()
    assert not alive, f"left behind: {[p.pid for p in alive]}"
    assert not segments(ready), "the storage node's segment was left in /dev/shm"
    last_of = {k: max(t for p, t in exits.items() if kind[p] == k) for k in set(kind.values())}
    first_of = {k: min(t for p, t in exits.items() if kind[p] == k) for k in set(kind.values())}
    order = [k for k in STOP_ORDER if k in last_of]
    for before, after in zip(order, order[1:]):
        assert last_of[before] <= first_of[after], f"{after} exited before {before} did"


@pytest.fixture(scope="module")
def expected(tiny_llama_dir):
    engine = LLMEngine(EngineConfig(tiny_llama_dir, cache=CacheConfig(num_blocks=64)))
    return engine.generate([PROMPT], SamplingParams(max_tokens=200, ignore_eos=True))[0]


def test_sigterm_lets_the_stream_in_flight_finish_and_leaves_nothing(tiny_llama_dir, tmp_path,
                                                                    expected):
    proc, ready = serve(tiny_llama_dir, tmp_path, "--port", str(port()), "--http-port", "0")
    try:
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(children) == 6  # store master and node, prefill and decode workers, router,
        # and the controller
        assert set(ready) >= {"router", "http", "metrics", "controller", "cluster"}
        with urllib.request.urlopen(ready["metrics"], timeout=10) as r:
            page = r.read().decode()
        assert 'pdserve:process_restarts_total{kind="worker"} 0.0' in page
        assert page.count("pdserve:process_up{") == 6
        got, errors, first = [], [], threading.Event()

        def stream() -> None:
            req = api_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(
                max_tokens=len(expected), ignore_eos=True))
            req.token_ids.ids.extend(PROMPT)
            try:
                with rpc.make_channel(ready["router"], rpc.PUBLIC) as ch:
                    for r in api_pb2_grpc.GenerationStub(ch).Generate(req, timeout=60):
                        got.extend(r.token_ids)
                        first.set()
            except Exception as e:  # noqa: BLE001 - reported by the main thread
                errors.append(e)
                first.set()

        t = threading.Thread(target=stream)
        t.start()
        assert first.wait(60) and not errors
        assert len(got) < len(expected)  # in flight
        stop_and_check(proc, ready, signal.SIGTERM)
        t.join(timeout=60)
        assert not errors and got == expected  # in flight at SIGTERM, finished in full
        # The same --log-dir serves again: the store's journal of the cluster before is not
        # this one's.
        proc, again = serve(tiny_llama_dir, tmp_path, "--port", str(port()), "--no-http")
        assert again["cluster"] != ready["cluster"]
        stop_and_check(proc, again, signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_children_die_with_a_killed_serve(tiny_llama_dir, tmp_path):
    """Even kill -9 of `pdserve serve` leaves nothing: children carry a parent-death signal.
    (Internal ports given explicitly here: they are honoured.)"""
    store, controller, worker_base = free_ports(3)
    proc, ready = serve(tiny_llama_dir, tmp_path, "--port", str(port()), "--store-port",
                        str(store), "--controller-port", str(controller), "--worker-base-port",
                        str(worker_base), "--no-http")
    try:
        assert ready["controller"] == f"127.0.0.1:{controller}" and "http" not in ready
        assert rpc.wait_healthy(f"127.0.0.1:{store}", timeout_s=10, peer=MASTER) is None
        assert rpc.wait_healthy(f"127.0.0.1:{worker_base + 1}", timeout_s=10,
                                peer=WORKER) is None
        children = psutil.Process(proc.pid).children(recursive=True)
        names = {c.pid: " ".join(c.cmdline()[:4]) for c in children}
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        gone, alive = psutil.wait_procs(children, timeout=20)
        assert not alive, f"left behind: {[(p.pid, names[p.pid]) for p in alive]}"
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.scenario  # two whole clusters at once: with the long scenarios (.ci/scenarios)
def test_two_clusters_share_a_host_and_a_taken_router_port_is_refused(tiny_llama_dir, tmp_path,
                                                                       expected):
    port_a = port()
    a, ready_a = serve(tiny_llama_dir, tmp_path / "a", "--port", str(port_a), "--http-port", "0")
    b = None
    try:
        b, ready_b = serve(tiny_llama_dir, tmp_path / "b", "--port", str(port()),
                           "--http-port", "0")
        assert ready_a["cluster"] != ready_b["cluster"]
        assert segments(ready_a) and segments(ready_b)
        for ready in (ready_a, ready_b):
            ids, *_ = generate(ready["router"], token_ids=PROMPT, max_tokens=len(expected),
                               ignore_eos=True)
            assert ids == expected

        third = subprocess.run(
            [sys.executable, "-m", "pdserve.cli", "serve", "--model", tiny_llama_dir,
             "--port", str(port_a), "--http-port", "0", "--log-dir", str(tmp_path / "c")],
            capture_output=True, text=True, timeout=120)
        assert third.returncode == 1
        assert f"127.0.0.1:{port_a} (the router's gRPC port) is in use" in third.stderr
        assert not (tmp_path / "c").exists()  # refused before anything started

        stop_and_check(a, ready_a, signal.SIGTERM)
        stop_and_check(b, ready_b, signal.SIGINT)  # Ctrl-C reaches only the launcher
    finally:
        for p in (a, b):
            if p is not None and p.poll() is None:
                p.kill()


def test_a_stop_signal_while_starting_stops_every_child(tiny_llama_dir, tmp_path):
    """Ctrl-C during a start does not wait for the cluster to come up: the start is abandoned
    and whatever was started is stopped."""
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "serve", "--model",
                             tiny_llama_dir, "--port", str(port()), "--http-port", "0",
                             "--log-dir", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "decode-1.log").exists():  # store and workers spawned
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.02)
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(children) == 4
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0 and "stopped while starting" in err, err
        assert "pdserve ready" not in out
        gone, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, f"left behind: {[p.pid for p in alive]}"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_node_of_another_cluster_is_refused_by_the_master(tiny_llama_dir, tmp_path):
    from pdserve.launcher.local import LocalCluster
    from tests.e2e.conftest import cluster_spec

    with LocalCluster(cluster_spec(tiny_llama_dir, controller=False)) as cluster:
        stray = subprocess.run(
            [sys.executable, "-m", "pdserve.kvstore.node", "--node-id", "stray",
             "--dram-bytes", str(1 << 20), "--master", cluster.store_address,
             "--cluster-id", "othercluster"], capture_output=True, text=True, timeout=60)
        out = stray.stdout + stray.stderr
        assert stray.returncode != 0
        assert cluster.cluster_id in out and "othercluster" in out


def test_admission_and_key_flags_reach_the_router_and_controller(tiny_llama_dir, tmp_path):
    (tmp_path / "keys").write_text("sk-test-0001 alice\n")
    (tmp_path / "admin").write_text("admin-key-0001 ops\n")
    proc, ready = serve(tiny_llama_dir, tmp_path / "logs", "--port", str(port()), "--http-port",
                        "0", "--served-model-name", "tiny", "--api-keys-file",
                        str(tmp_path / "keys"), "--admin-keys-file", str(tmp_path / "admin"),
                        "--tenant-rate-rps", "0.01", "--tenant-burst", "1")
    try:
        with httpx.Client(base_url=f"http://{ready['http']}/v1", timeout=60) as c:
            assert c.get("/models").status_code == 401
            key = {"authorization": "Bearer sk-test-0001"}
            assert [m["id"] for m in c.get("/models", headers=key).json()["data"]] == ["tiny"]
            body = {"model": "tiny", "prompt": "hi", "max_tokens": 2, "temperature": 0}
            assert c.post("/completions", json=body, headers=key).status_code == 200
            assert c.post("/completions", json=body, headers=key).status_code == 429  # burst 1
        env, flags = key_only()  # an operator with no certificate: the key alone speaks
        status = [sys.executable, "-m", "pdserve.cli", "ctl", "--address", ready["controller"],
                  *flags]
        refused = subprocess.run([*status, "status"], env=env, capture_output=True, text=True,
                                 timeout=120)
        assert refused.returncode != 0 and "admin key" in refused.stdout + refused.stderr
        ok = subprocess.run([*status, "--admin-key", "admin-key-0001", "status"], env=env,
                            capture_output=True, text=True, timeout=120)
        assert ok.returncode == 0, ok.stderr
        stop_and_check(proc, ready, signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
