"""pdserve on a real two-node Ray cluster on this machine (`tests/deploy/ray_local.py`: a head
with resource `head_node`, a second node with `worker_node`), driven through the CLI as a user
drives it:

- `pdserve serve --backend ray --detach` places the prefill worker on the head and the decode
  worker on the other node (per-role custom resources, checked by the actors' Ray node ids), one
  storage node on each of them, the master, router and controller together; a greedy request
  through the router gives the single-process engine's tokens, its KV read from the store.
- Internal mutual TLS is on by default: the driver keeps the CA (its state folder), each
  actor's folder on its node holds ca.crt and its own kind's certificate and key only (key
  0600), a plaintext caller gets nowhere, and `pdserve ray renew-certs` gives every process a
  new certificate that it uses without a restart.
- kill -9 of the decode worker's process: its actor restarts it, `pdserve ray status` shows the
  restart and a new pid, and the cluster serves the same tokens again.
- `ray.kill` of the prefill worker's actor: its process dies with it, status shows the actor
  dead, and the router serves the same tokens without it (the decode worker prefills).
- `pdserve serve` again under the same name (foreground) sweeps the earlier run (every one of
  its processes gone), serves the same tokens; `pdserve ray down` then leaves no process with
  the cluster's name in its command line, no actor, no placement group, no segment file and no
  member's key, and the foreground `serve` notices and exits 0.
- With no Ray cluster at the address, serve says so and how to start one, and starts nothing;
  with a resource no node has, it names the worker and the resource and leaves nothing behind.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
import uuid

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve import rpc
from pdserve.launcher.cluster_spec import free_ports
from pdserve.core.identity import OPERATOR, ROUTER, WORKER
from pdserve.proto import api_pb2, api_pb2_grpc, common_pb2
from pdserve.proto import router_pb2 as rpb
from pdserve.proto import router_pb2_grpc as rpb_grpc
from pdserve.proto import worker_pb2 as wpb
from pdserve.proto import worker_pb2_grpc as wpb_grpc
from pdserve.security import tls
from tests.deploy.ray_local import LocalRay
from tests.helpers import REPO_ROOT

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'pdserve[ray]')")

PROMPT = list(range(700, 740))  # two full blocks of 16: they go through the store
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def ray_cluster():
    if shutil.which("ray") is None:
        pytest.skip("the `ray` command is not on PATH (pip install 'pdserve[ray]')")
    cluster = LocalRay(str(REPO_ROOT)).start()
    # The driver keeps each cluster's CA under the user's state folder: the test's own.
    cluster.env["PDSERVE_STATE_DIR"] = os.path.join(cluster.temp_dir, "state")
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
    """`pdserve *args`; `ray ...` with the test cluster's Ray address (and --ray-dir)."""
    if args[0] == "ray":
        args = (*args, "--address", cluster.address)
        if args[1] in ("status", "down"):
            args = (*args, "--ray-dir", cluster.pdserve_dir)
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
    # This process calls the cluster's internal ports as its operator, with the certificate
    # the driver keeps beside the CA (made by the first serve of the name).
    folder = os.path.join(ray_cluster.env["PDSERVE_STATE_DIR"], "ray", name, "tls")
    try:
        serve_kill_and_come_down(ray_cluster, tiny_llama_dir, expected_tokens, name, folder)
    finally:  # a failure above must not leave placement groups that starve the next test
        tls.reset()  # the suite's own setting again
        cli(ray_cluster, "ray", "down", "--cluster", name)


def generate(router: str, token_ids: list[int], max_tokens: int) -> list[int]:
    """One greedy Generate through the router's client port (plaintext): its token ids."""
    req = api_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(
        max_tokens=max_tokens, ignore_eos=True))
    req.token_ids.ids.extend(token_ids)
    ids: list[int] = []
    with rpc.make_channel(router, rpc.PUBLIC) as ch:
        for r in api_pb2_grpc.GenerationStub(ch).Generate(req, timeout=300):
            ids.extend(r.token_ids)
    return ids


def worker_stats(address: str) -> wpb.WorkerStats:
    with rpc.make_channel(address, WORKER) as ch:
        return wpb_grpc.WorkerStub(ch).GetStats(wpb.GetStatsRequest(), timeout=30)


def router_members(control: str) -> dict[str, rpb.WorkerMember]:
    """The router's membership, asked on its control listener."""
    with rpc.make_channel(control, ROUTER) as ch:
        r = rpb_grpc.RouterControlStub(ch).ListWorkers(rpb.ListWorkersRequest(), timeout=10)
    return {m.address: m for m in r.workers}


def router_sees_active(control: str, address: str) -> bool:
    """The router's membership has `address` ACTIVE again (its poll or heartbeat came)."""
    m = router_members(control).get(address)
    return m is not None and m.state == rpb.MEMBER_STATE_ACTIVE


def membership_text(control: str) -> str:
    """Each member's address, role, state, missed polls and reason, as the router says."""
    return "; ".join(f"{a} role={wpb.Role.Name(m.role)} state={rpb.MemberState.Name(m.state)} "
                     f"missed_polls={m.missed_polls} "
                     f"last_seen_age_s={m.last_seen_age_s:.1f} in_flight={m.in_flight} "
                     f"reason={m.reason!r}" for a, m in router_members(control).items())


def assert_each_member_holds_only_its_own_key(members: dict, driver_folder: str,
                                              nodes_folder: str) -> None:
    """Every member's folder on its node: ca.crt and its own kind's certificate and key (key
    0600, folder 0700), never another kind's key nor the CA's, which stays with the driver."""
    assert os.path.isfile(os.path.join(driver_folder, "ca.key"))
    assert stat.S_IMODE(os.stat(driver_folder).st_mode) == 0o700
    for member, st in members.items():
        kind, folder = st["kind"], st["tls_dir"]
        assert st["tls"] == "mutual" and st["cert_not_after"], (member, st)
        assert folder == os.path.join(nodes_folder, "tls", member), st
        assert sorted(os.listdir(folder)) == sorted(["ca.crt", f"{kind}.crt", f"{kind}.key"]), (
            member, os.listdir(folder))
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700, member
        assert stat.S_IMODE(os.stat(os.path.join(folder, f"{kind}.key")).st_mode) == 0o600
    decode = members["decode-1"]["tls_dir"]
    assert os.path.isfile(os.path.join(decode, "worker.key"))
    assert not os.path.exists(os.path.join(decode, "master.key"))


def cert_serial(folder: str, kind: str) -> int:
    from pdserve.security import pki

    with open(os.path.join(folder, f"{kind}.crt"), "rb") as f:
        return pki.info(f.read()).serial


def serve_kill_and_come_down(ray_cluster, tiny_llama_dir, expected_tokens, name: str,
                             folder: str) -> None:
    r = cli(ray_cluster, *serve_args(ray_cluster, tiny_llama_dir, name), "--detach",
            timeout_s=300)
    assert r.returncode == 0, r.stderr
    ready = ready_fields(r.stdout.strip().splitlines()[-1])
    assert ready["cluster"] == name and ready["backend"] == "ray" and "controller" in ready
    assert "internal mutual TLS" in r.stderr and folder in r.stderr, r.stderr
    # The client ports bind --host / --http-host (127.0.0.1 by default, as `pdserve serve`).
    assert ready["router"].startswith("127.0.0.1:") and ready["http"].startswith("127.0.0.1:")
    assert httpx.get(f"http://{ready['http']}/health", timeout=30).status_code == 200
    control = ready["control"]
    tls.configure(tls.MutualTls(tls.TlsFolder(folder), OPERATOR))

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

    # Closed inside: each member holds only its own kind's key; plaintext gets nowhere.
    assert_each_member_holds_only_its_own_key(members, folder,
                                              os.path.join(ray_cluster.pdserve_dir, name))
    for address in (members["master"]["address"], decode["address"], control):
        with grpc.insecure_channel(address) as ch, pytest.raises(grpc.RpcError) as err:
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, address

    # Same tokens as one process; the decode worker read the prompt's KV from the store.
    ids = generate(ready["router"], PROMPT, MAX_TOKENS)
    assert ids == expected_tokens
    stats = worker_stats(decode["address"])
    assert stats.kv_blocks_fetched >= 2 and sum(stats.kv_store_reads_by_transport.values()) >= 2

    # New certificates for every process, from the driver's CA, used without a restart.
    before = {m: cert_serial(s["tls_dir"], s["kind"]) for m, s in members.items()}
    renewed = cli(ray_cluster, "ray", "renew-certs", "--cluster", name)
    assert renewed.returncode == 0, renewed.stdout + renewed.stderr
    assert sorted(line.split(":")[0] for line in renewed.stdout.splitlines()) == sorted(members)
    assert all(cert_serial(s["tls_dir"], s["kind"]) != before[m] for m, s in members.items())
    assert all(s["restarts"] == 0 for s in status(ray_cluster, name)["members"].values())
    time.sleep(1.5)  # a process looks at its files at most once a second
    assert generate(ready["router"], PROMPT, MAX_TOKENS) == expected_tokens

    # kill -9 of a worker's process: its actor restarts it (same address), status says so.
    os.kill(decode["pid"], signal.SIGKILL)
    restarted = wait_for(lambda: (lambda s: s if s["state"] == "running" and s["restarts"] == 1
                                  else None)(status(ray_cluster, name)["members"]["decode-1"]),
                         90, "decode-1 restarted")
    assert restarted["pid"] != decode["pid"] and restarted["exit_code"] == -signal.SIGKILL
    rpc.wait_healthy(decode["address"], timeout_s=120, peer=WORKER)
    wait_for(lambda: router_sees_active(control, decode["address"]), 60,
             "the router to take decode-1 back")
    try:
        ids = generate(ready["router"], PROMPT, MAX_TOKENS)
    except grpc.RpcError as e:  # say what the router's membership was right after
        raise AssertionError(f"{e.code().name} {e.details()}; the router's members then: "
                             f"{membership_text(control)}") from e
    assert ids == expected_tokens

    # ray.kill of a worker's actor: its process dies with it; status shows the actor dead.
    ray.kill(ray.get_actor(f"pdserve-{name}-prefill-0"))
    wait_for(lambda: not alive(prefill["pid"]), 30, "the killed actor's process to die")
    text = cli(ray_cluster, "ray", "status", "--cluster", name)
    assert text.returncode == 0, text.stderr
    row = next(line for line in text.stdout.splitlines() if line.startswith("prefill-0 "))
    assert "actor dead" in row, text.stdout
    assert "internal mutual TLS, certificates valid until" in text.stdout, text.stdout
    assert generate(ready["router"], PROMPT, MAX_TOKENS) == expected_tokens

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
        assert generate(again["router"], PROMPT, MAX_TOKENS) == expected_tokens

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
    assert glob.glob(os.path.join(ray_cluster.pdserve_dir, name, "tls", "*")) == []
    assert os.path.isfile(os.path.join(folder, "ca.key"))  # kept for the next serve
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
    started = time.monotonic()
    r = cli(ray_cluster, *args, "--detach", timeout_s=120)
    assert r.returncode == 1
    # Known at once from the cluster's resources: said before any wait, with the arithmetic.
    assert "cannot place the cluster: the placement groups need 1 no_such_node in all" in \
        r.stderr and "the Ray cluster has 0" in r.stderr, r.stderr
    assert time.monotonic() - started < 60
    assert [g for g in ray.util.placement_group_table().values()
            if g["name"].startswith(f"pdserve-{name}-") and g["state"] != "REMOVED"] == []
    assert [a for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(f"pdserve-{name}-")] == []
