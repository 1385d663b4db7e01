"""pdserve on a real two-node Ray cluster on this machine (`tests/deploy/ray_local.py`: a head
with resource `head_node`, a second node with `worker_node`), driven through the CLI as a user
drives it:

- `pdserve serve --backend ray --detach` places the prefill worker on the head and the decode
  worker on the other node (per-role custom resources, checked by the actors' Ray node ids), one
  storage node on each of them, the master, router and controller together; a greedy request
  through the router gives the single-process engine's tokens, its KV read from the store.
- kill -9 of the decode worker's process: its actor restarts it, `pdserve ray status` shows the
  restart and a new pid, and the cluster serves the same tokens again.
- `ray.kill` of the prefill worker's actor: its process dies with it, status shows the actor
  dead, and the router serves the same tokens without it (the decode worker prefills).
- `pdserve serve` again under the same name (foreground) sweeps the earlier run (every one of
  its processes gone), serves the same tokens; `pdserve ray down` then leaves no process with
  the cluster's name in its command line, no actor, no placement group and no segment file,
  and the foreground `serve` notices and exits 0.
- With no Ray cluster at the address, serve says so and how to start one, and starts nothing;
  with a resource no node has, it names the worker and the resource and leaves nothing behind.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid

import grpc
import pytest

from pdserve import rpc
from pdserve.controller.cluster_spec import free_ports
from tests.deploy.ray_local import LocalRay
from tests.e2e.test_cluster import generate, worker_stats
from tests.helpers import REPO_ROOT

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'pdserve[ray]')")

PROMPT = list(range(700, 740))  # two full blocks of 16: they go through the store
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def ray_cluster():
    if shutil.which("ray") is None:
        pytest.skip("the `ray` command is not on PATH (pip install 'pdserve[ray]')")
    cluster = LocalRay(str(REPO_ROOT)).start()
    try:
        ray.init(address=cluster.address, namespace="pdserve", log_to_driver=False,
                 logging_level="WARNING")
        yield cluster
    finally:
        ray.shutdown()
        cluster.stop()


@pytest.fixture(scope="module")
def expected_tokens(tiny_llama_dir) -> list[int]:
    from pdserve.engine.config import CacheConfig, EngineConfig
    from pdserve.engine.engine import LLMEngine
    from pdserve.engine.sampling import SamplingParams

    engine = LLMEngine(EngineConfig(tiny_llama_dir, cache=CacheConfig(num_blocks=64)))
    return engine.generate([PROMPT], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))[0]


def cli(cluster: LocalRay, *args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    """`pdserve *args`; `ray status|down` with the test cluster's Ray address and --ray-dir."""
    if args[0] == "ray":
        args = (*args, "--address", cluster.address, "--ray-dir", cluster.pdserve_dir)
    return subprocess.run([sys.executable, "-m", "pdserve.cli", *args], cwd=REPO_ROOT,
                          env=cluster.env, capture_output=True, text=True, timeout=timeout_s)


def serve_args(cluster: LocalRay, model: str, name: str) -> list[str]:
    return ["serve", "--backend", "ray", "--address", cluster.address, "--cluster", name,
            "--model", model, "--port", "0", "--http-port", "0", "--num-blocks", "64",
            "--ray-worker-cpus", "1", "--ray-control-cpus", "0.25",
            "--ray-prefill-resources", '{"head_node": 0.1}',
            "--ray-decode-resources", '{"worker_node": 0.1}',
            "--ray-store-dram-bytes", str(64 << 20), "--ready-timeout-s", "150",
            "--ray-dir", cluster.pdserve_dir]


def ready_fields(line: str) -> dict[str, str]:
    assert line.startswith("pdserve ready on "), line
    words = line.split()
    return {"router": words[3], **dict(w.split("=", 1) for w in words[4:])}


def status(cluster: LocalRay, name: str) -> dict:
    r = cli(cluster, "ray", "status", "--cluster", name, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def wait_for(check, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def cluster_pids(name: str) -> list[int]:
    """Processes whose command line names the cluster (its marker is `pdserve_cluster=NAME`)."""
    needle = f"pdserve_cluster={name}\0".encode()
    out = []
    for path in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            with open(path, "rb") as f:
                if needle in f.read():
                    out.append(int(path.split("/")[2]))
        except OSError:
            pass
    return out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_serve_on_two_ray_nodes_survives_kills_and_comes_down_clean(
        ray_cluster, tiny_llama_dir, expected_tokens):
    name = "t" + uuid.uuid4().hex[:8]
    try:
        serve_kill_and_come_down(ray_cluster, tiny_llama_dir, expected_tokens, name)
    finally:  # a failure above must not leave placement groups that starve the next test
        cli(ray_cluster, "ray", "down", "--cluster", name)


def router_sees_active(router: str, address: str) -> bool:
    """The router's membership has `address` ACTIVE again (its poll or heartbeat came)."""
    from pdserve.proto import router_pb2 as rpb
    from tests.e2e.test_membership import members

    m = members(router).get(address)
    return m is not None and m.state == rpb.MEMBER_STATE_ACTIVE


def membership_text(router: str) -> str:
    """Each member's address, role, state, missed polls and reason, as the router says."""
    from pdserve.proto import router_pb2 as rpb
    from pdserve.proto import worker_pb2 as wpb
    from tests.e2e.test_membership import members

    return "; ".join(f"{a} role={wpb.Role.Name(m.role)} state={rpb.MemberState.Name(m.state)} "
                     f"missed_polls={m.missed_polls} "
                     f"last_seen_age_s={m.last_seen_age_s:.1f} in_flight={m.in_flight} "
                     f"reason={m.reason!r}" for a, m in members(router).items())


def serve_kill_and_come_down(ray_cluster, tiny_llama_dir, expected_tokens, name: str) -> None:
    r = cli(ray_cluster, *serve_args(ray_cluster, tiny_llama_dir, name), "--detach",
            timeout_s=300)
    assert r.returncode == 0, r.stderr
    ready = ready_fields(r.stdout.strip().splitlines()[-1])
    assert ready["cluster"] == name and ready["backend"] == "ray" and "controller" in ready

    # Placement: prefill on the head, decode on the other node, a storage node on each.
    members = status(ray_cluster, name)["members"]
    resources = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
    prefill, decode = members["prefill-0"], members["decode-1"]
    assert prefill["node_id"] != decode["node_id"]
    assert "head_node" in resources[prefill["node_id"]]
    assert "worker_node" in resources[decode["node_id"]]
    stores = {m: s["node_id"] for m, s in members.items() if m.startswith("kvnode-")}
    assert sorted(stores.values()) == sorted([prefill["node_id"], decode["node_id"]])
    assert len({members[m]["node_id"] for m in ("master", "router", "controller")}) == 1
    assert all(s["state"] == "running" and s["restarts"] == 0 for s in members.values())
    assert {m: s["health"] for m, s in members.items() if s["kind"] != "node"} == dict.fromkeys(
        ("master", "router", "controller", "prefill-0", "decode-1"), "SERVING")

    # Same tokens as one process; the decode worker read the prompt's KV from the store.
    ids, *_ = generate(ready["router"], token_ids=PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert ids == expected_tokens
    stats = worker_stats(decode["address"])
    assert stats.kv_blocks_fetched >= 2 and sum(stats.kv_store_reads_by_transport.values()) >= 2

    # kill -9 of a worker's process: its actor restarts it (same address), status says so.
    os.kill(decode["pid"], signal.SIGKILL)
    restarted = wait_for(lambda: (lambda s: s if s["state"] == "running" and s["restarts"] == 1
                                  else None)(status(ray_cluster, name)["members"]["decode-1"]),
                         90, "decode-1 restarted")
    assert restarted["pid"] != decode["pid"] and restarted["exit_code"] == -signal.SIGKILL
    rpc.wait_healthy(decode["address"], timeout_s=120)
    wait_for(lambda: router_sees_active(ready["router"], decode["address"]), 60,
             "the router to take decode-1 back")
    try:
        ids, *_ = generate(ready["router"], token_ids=PROMPT, max_tokens=MAX_TOKENS,
                           ignore_eos=True)
    except grpc.RpcError as e:  # say what the router's membership was right after
        raise AssertionError(f"{e.code().name} {e.details()}; the router's members then: "
                             f"{membership_text(ready['router'])}") from e
    assert ids == expected_tokens

    # ray.kill of a worker's actor: its process dies with it; status shows the actor dead.
    ray.kill(ray.get_actor(f"pdserve-{name}-prefill-0"))
    wait_for(lambda: not alive(prefill["pid"]), 30, "the killed actor's process to die")
    text = cli(ray_cluster, "ray", "status", "--cluster", name)
    assert text.returncode == 0, text.stderr
    row = next(line for line in text.stdout.splitlines() if line.startswith("prefill-0 "))
    assert "actor dead" in row, text.stdout
    ids, *_ = generate(ready["router"], token_ids=PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert ids == expected_tokens

    # The same name again, in the foreground: the earlier run is swept first.
    old = cluster_pids(name)
    assert old
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli",
                             *serve_args(ray_cluster, tiny_llama_dir, name)], cwd=REPO_ROOT,
                            env=ray_cluster.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        line = proc.stdout.readline()  # blocks until ready (or serve fails)
        assert line.startswith("pdserve ready on"), (line, proc.poll())
        again = ready_fields(line)
        assert not [p for p in old if alive(p)]
        members = status(ray_cluster, name)["members"]
        assert members["prefill-0"]["state"] == "running"
        ids, *_ = generate(again["router"], token_ids=PROMPT, max_tokens=MAX_TOKENS,
                           ignore_eos=True)
        assert ids == expected_tokens

        # Down: nothing of the cluster is left, and the foreground serve ends by itself.
        down = cli(ray_cluster, "ray", "down", "--cluster", name)
        assert down.returncode == 0, down.stderr
        assert "stopped 7 actors, removed 3 placement groups" in down.stdout, down.stdout
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert [p for p in cluster_pids(name) if alive(p)] == []
    assert [a for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(f"pdserve-{name}-")] == []
    assert [g for g in ray.util.placement_group_table().values()
            if g["name"].startswith(f"pdserve-{name}-") and g["state"] != "REMOVED"] == []
    assert glob.glob(f"/dev/shm/pdserve-{name}-*") == []
    assert "nothing on this Ray cluster" in status_text(ray_cluster, name)


def status_text(cluster: LocalRay, name: str) -> str:
    r = cli(cluster, "ray", "status", "--cluster", name)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_no_ray_cluster_is_reported_with_how_to_start_one(tiny_llama_dir):
    [port] = free_ports(1)
    r = subprocess.run([sys.executable, "-m", "pdserve.cli", "serve", "--backend", "ray",
                        "--address", f"127.0.0.1:{port}", "--model", tiny_llama_dir, "--detach"],
                       cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert "no Ray cluster reachable" in r.stderr and "ray start --head" in r.stderr, r.stderr
    assert "pdserve ready" not in r.stdout


def test_resources_no_node_has_are_reported_and_nothing_is_left(ray_cluster, tiny_llama_dir):
    name = "t" + uuid.uuid4().hex[:8]
    args = serve_args(ray_cluster, tiny_llama_dir, name)
    args[args.index("--ray-decode-resources") + 1] = '{"no_such_node": 1}'
    args[args.index("--ready-timeout-s") + 1] = "5"
    r = cli(ray_cluster, *args, "--detach", timeout_s=120)
    assert r.returncode == 1
    assert "placement groups not placed within 5s: decode-1" in r.stderr, r.stderr
    assert "no_such_node" in r.stderr
    assert [g for g in ray.util.placement_group_table().values()
            if g["name"].startswith(f"pdserve-{name}-") and g["state"] != "REMOVED"] == []
    assert [a for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(f"pdserve-{name}-")] == []
