"""The chart's pods, for the default values, run as real processes on loopback: proof that the
chart wires the processes together (addresses, ports, flags, probes, the start script, the
cluster's internal TLS), not only that its YAML is valid.

The rendered containers' commands, args and variables run as a kubelet would run them
(tests/deploy/pods.py: every Service and pod DNS name mapped to a loopback port of the pod it
reaches, each pod with its own ports, volumes as directories, Secrets written as their `items`
project them). The cluster's certificates are the Secrets the chart names, made from one
`pki.init_folder`: the `pdserve-tls` Secret by default, or the per-kind Secrets cert-manager
would fill (`tls.certManager.enabled`). Two values differ from the defaults, both sizes of
this machine rather than wiring: the model is the tiny test model (a hostPath `model.volume`
at `model.path` /models) and the storage node's DRAM segment is 64 MiB. Pods start in
dependency order, each waiting for its probes (plaintext gRPC on the health ports, as the
kubelet's). A greedy request through the router Service must give the single-process engine's
tokens; the controller pod's label sync must label the worker pods with their roles through a
stand-in Kubernetes API; every pdserve process must run with `--tls-dir` (never
`--insecure-internal`) on its kind's files alone, and a plaintext call to an internal port must
be refused. The test process calls the cluster as its operator (the same folder's operator
certificate).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import subprocess
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve import rpc
from pdserve.core.identity import CONTROLLER, MASTER, OPERATOR
from pdserve.deploy.k8s_labels import ROLE_LABEL, router_members
from pdserve.security import pki, tls
from tests.deploy.chart import KIND_OF, NAMESPACE, RELEASE, component, needs_helm, objects, \
    of_kind
from tests.deploy.pods import FakeCluster, FakeKubeApi, Pod
from tests.e2e.test_cluster import generate
from tests.helpers import REPO_ROOT

pytestmark = needs_helm

SMOKE_VALUES = {"store": {"nodes": {"dramBytes": 64 << 20}}}
CERT_MANAGER = {"tls": {"certManager": {"enabled": True}}}
READY_S = 180.0
# The pods' cluster-internal gRPC ports (mutual TLS, or TLS with per-call proofs): a plaintext
# client must not get through any of them.
INTERNAL_PORTS = {"worker": 50061, "store-master": 50070, "router": 50053, "controller": 50052}


@pytest.fixture(scope="module")
def tls_folder(tmp_path_factory) -> str:
    """One cluster's certificates (a CA, one per kind), as `pdserve certs init` makes them."""
    folder = str(tmp_path_factory.mktemp("helm-smoke-pki") / "tls")
    pki.init_folder(folder, "test")
    return folder


def tls_secrets(folder: str, cert_manager: bool = False) -> dict[str, dict[str, bytes]]:
    """The Secrets of `folder`'s certificates the chart mounts: `<release>-tls` with every file
    but the CA's key and the operator's; with cert-manager, the Secret each kind's Certificate
    fills (ca.crt, tls.crt, tls.key)."""
    files = {f: Path(folder, f).read_bytes() for f in os.listdir(folder)}
    if cert_manager:
        return {f"{RELEASE}-{kind}-tls": {"ca.crt": files[pki.CA_CERT],
                                          "tls.crt": files[pki.cert_file(kind)],
                                          "tls.key": files[pki.key_file(kind)]}
                for kind in sorted(set(KIND_OF.values()))}
    return {f"{RELEASE}-tls": {f: b for f, b in files.items()
                               if f != pki.CA_KEY and not f.startswith(f"{OPERATOR}.")}}


@contextlib.contextmanager
def as_operator(folder: str):
    """This process calls the cluster as the operator of `folder`'s CA; the setting it had
    (the session's, from PDSERVE_TLS_DIR, when any) afterwards."""
    saved = tls.configured()
    tls.configure(tls.MutualTls(tls.TlsFolder(folder), OPERATOR))
    try:
        yield
    finally:
        tls.restore(saved)  # None: the next current() reads the environment again


def plaintext_health(address: str) -> grpc.StatusCode:
    """The status a plaintext gRPC health check at `address` gets (OK when it got an answer)."""
    with grpc.insecure_channel(address) as ch:
        try:
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.RpcError as e:
            return e.code()
    return grpc.StatusCode.OK


def assert_runs_with_its_certificates(cluster: FakeCluster, pod: Pod, name: str) -> None:
    """Container `name` of `pod` runs with `--tls-dir` (never `--insecure-internal`) on its
    pod's Secret volume, which holds the CA's certificate and its kind's files alone (keys
    not world-readable)."""
    words = cluster.running_argv(pod, name)
    assert "--insecure-internal" not in words, f"{pod.name}/{name}: {words}"
    assert words.count("--tls-dir") == 1, f"{pod.name}/{name} runs without --tls-dir: {words}"
    folder = words[words.index("--tls-dir") + 1]
    assert folder == pod.dirs["tls"], f"{pod.name}/{name}: --tls-dir {folder}"
    kind = KIND_OF[component(pod.workload)]
    assert sorted(os.listdir(folder)) == sorted(
        [pki.CA_CERT, pki.cert_file(kind), pki.key_file(kind)]), (pod.name, os.listdir(folder))
    mode = stat.S_IMODE(os.stat(Path(folder, pki.key_file(kind))).st_mode)
    assert not mode & 0o007, f"{pod.name}: {kind}.key mode {oct(mode)}"


def start_store(cluster):
    """The store's master and node pods, once ready."""
    for component_, container in (("store-master", "master"), ("store-node", "node")):
        for pod in cluster.pods_of(component_):
            cluster.start(pod, container)
            cluster.wait(pod, container, "startupProbe", READY_S)
            cluster.wait(pod, container, "readinessProbe", READY_S)


def start_controller(cluster, api):
    """The controller pod's two containers (the controller, its label sync), once ready."""
    (controller,) = cluster.pods_of("controller")
    cluster.start(controller, "controller")
    cluster.start(controller, "label-sync", ["--api-url", api.url])
    cluster.wait(controller, "controller", "startupProbe", READY_S)
    cluster.wait(controller, "controller", "readinessProbe", READY_S)
    return controller


@pytest.mark.parametrize("cert_manager", [False, True], ids=["tls-secret", "cert-manager"])
def test_default_chart_pods_serve_the_engines_tokens(tiny_llama_dir, tmp_path, tls_folder,
                                                     cert_manager):
    from pdserve.engine.config import CacheConfig, EngineConfig
    from pdserve.engine.engine import LLMEngine
    from pdserve.engine.sampling import SamplingParams

    values = {**SMOKE_VALUES, "model": {"path": "/models",
                                        "volume": {"hostPath": {"path": tiny_llama_dir}}}}
    objs = objects({**values, **(CERT_MANAGER if cert_manager else {})})
    secrets = tls_secrets(tls_folder, cert_manager)
    if cert_manager:  # the stand-in fills exactly the Secrets the chart's Certificates name
        assert {c["spec"]["secretName"] for c in of_kind(objs, "Certificate")
                if not c["spec"].get("isCA")} == set(secrets)
    cluster = FakeCluster(objs, NAMESPACE, tmp_path, secrets=secrets)
    workers = cluster.pods_of("worker")
    assert [p.name for p in workers] == ["pdserve-worker-0", "pdserve-worker-1"]
    api = FakeKubeApi(NAMESPACE, {p.name: dict(p.labels) for p in workers})
    try:
        with as_operator(tls_folder):
            start_store(cluster)
            (router,) = cluster.pods_of("router")
            cluster.start(router, "router")
            cluster.wait(router, "router", "startupProbe", READY_S)
            assert not cluster.probe(router, "router", "readinessProbe"), \
                "a router with no decode worker must not be ready"
            for pod in workers:  # all at once, as the StatefulSet's Parallel policy starts them
                cluster.start(pod, "worker")
            for pod in workers:
                cluster.wait(pod, "worker", "startupProbe", READY_S)
                cluster.wait(pod, "worker", "readinessProbe", READY_S)
            # Ready once it learnt the workers from the store master's membership table.
            cluster.wait(router, "router", "readinessProbe", READY_S)
            for pod in workers:  # each started in its ordinal's role
                role = "prefill" if pod.name.endswith("-0") else "decode"
                assert f"starts as {role}" in cluster.tail(pod, "worker", 200)
            deadline = time.monotonic() + 60  # both joined the router, one in each role
            while True:  # asked on the router's control port, as the operator
                members = router_members(f"127.0.0.1:{router.ports[50053]}")
                if sorted(r for _, r in members) == ["decode", "prefill"]:
                    break
                assert time.monotonic() < deadline, members
                time.sleep(0.2)
            assert {a.rpartition(":")[0] for a, _ in members} == {"127.0.0.1"}, \
                "each advertised its pod DNS name, which the test maps to loopback"
            controller = start_controller(cluster, api)

            prompt = [1, 450, 4996, 17354, 1701, 432, 17204, 975, 278, 17366, 11203]
            engine = LLMEngine(EngineConfig(tiny_llama_dir, cache=CacheConfig(num_blocks=64)))
            want = engine.generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True))[0]
            service = f"pdserve-router.{NAMESPACE}.svc.cluster.local"
            front_door = f"127.0.0.1:{cluster.resolve(service, 50051, router)}"
            ids, _, finish, usage = generate(front_door, token_ids=prompt, max_tokens=24,
                                             ignore_eos=True)
            assert ids == want
            assert usage.completion_tokens == 24

            deadline = time.monotonic() + 60
            while {n: api.pods[n].get(ROLE_LABEL) for n in api.pods} != \
                    {"pdserve-worker-0": "prefill", "pdserve-worker-1": "decode"}:
                assert controller.procs["label-sync"].poll() is None, \
                    cluster.tail(controller, "label-sync")
                assert time.monotonic() < deadline, \
                    (api.pods, cluster.tail(controller, "label-sync"))
                time.sleep(0.2)

            # Closed by default: each pdserve process on its own kind's certificates, ...
            started = {(p.name, n) for p in cluster.pods.values() for n in p.procs}
            # 2 workers, the router, the master, the node, the controller and its label sync.
            assert len(started) == 7, sorted(started)
            for pod in cluster.pods.values():
                for name in pod.procs:
                    assert_runs_with_its_certificates(cluster, pod, name)
            # ... and no plaintext call gets into an internal port, which does answer TLS.
            for comp, port in INTERNAL_PORTS.items():
                for pod in cluster.pods_of(comp):
                    address = f"127.0.0.1:{pod.ports[port]}"
                    assert plaintext_health(address) == grpc.StatusCode.UNAVAILABLE, \
                        f"{pod.name}: a plaintext call to port {port} got through"
                    if comp in ("worker", "store-master"):  # mutual TLS: the operator may ask
                        rpc.wait_healthy(address, timeout_s=10, peer=KIND_OF[comp])
            for pod in cluster.pods.values():  # nothing crashed meanwhile
                for name, proc in pod.procs.items():
                    assert proc.poll() is None, f"{pod.name}/{name}:\n{cluster.tail(pod, name)}"
    finally:
        cluster.stop_all()
        api.close()


ROUTERS = 3


def test_several_router_pods_follow_one_membership_table(tiny_llama_dir, tmp_path, tls_folder):
    """Three router pods (the autoscaler's minimum): each learns both workers from the store
    master's membership table and serves the engine's tokens; the table lists each router at
    its own pod's control port; the controller (`--store`) and its label sync run beside them."""
    from pdserve.engine.config import CacheConfig, EngineConfig
    from pdserve.engine.engine import LLMEngine
    from pdserve.engine.sampling import SamplingParams
    from pdserve.kvstore.members_client import MembersClient
    from pdserve.proto import controller_pb2, controller_pb2_grpc

    values = {**SMOKE_VALUES, "model": {"path": "/models",
                                        "volume": {"hostPath": {"path": tiny_llama_dir}}},
              "router": {"autoscaling": {"enabled": True, "minReplicas": ROUTERS,
                                         "maxReplicas": 2 * ROUTERS}}}
    objs = objects(values)
    assert [o for o in of_kind(objs, "Deployment") if o["metadata"]["name"] == "pdserve-router"
            and "replicas" not in o["spec"]], "the autoscaler owns the router count"
    cluster = FakeCluster(objs, NAMESPACE, tmp_path, secrets=tls_secrets(tls_folder))
    routers, workers = cluster.pods_of("router"), cluster.pods_of("worker")
    assert len(routers) == ROUTERS and len({r.ip for r in routers}) == ROUTERS
    api = FakeKubeApi(NAMESPACE, {p.name: dict(p.labels) for p in workers})
    try:
        with as_operator(tls_folder):
            start_store(cluster)
            for pod in routers + workers:
                cluster.start(pod, "router" if pod in routers else "worker")
            for pod in workers:
                cluster.wait(pod, "worker", "startupProbe", READY_S)
                cluster.wait(pod, "worker", "readinessProbe", READY_S)
            for pod in routers:
                cluster.wait(pod, "router", "startupProbe", READY_S)
                cluster.wait(pod, "router", "readinessProbe", READY_S)
            deadline = time.monotonic() + 60
            for pod in routers:  # every router knows both workers, one in each role
                while sorted(r for _, r in router_members(
                        f"127.0.0.1:{pod.ports[50053]}")) != ["decode", "prefill"]:
                    assert time.monotonic() < deadline, cluster.tail(pod, "router")
                    time.sleep(0.2)
            (master,) = cluster.pods_of("store-master")
            table = MembersClient(f"127.0.0.1:{master.ports[50070]}")
            try:  # each router listed at its pod IP's control port (this test's loopback port)
                listed = {m.address for m in table.watch().members if m.kind == "router"}
            finally:
                table.close()
            assert listed == {f"127.0.0.1:{r.ports[50053]}" for r in routers}

            controller = start_controller(cluster, api)

            prompt = [1, 450, 4996, 17354, 1701, 432, 17204, 975, 278, 17366, 11203]
            engine = LLMEngine(EngineConfig(tiny_llama_dir, cache=CacheConfig(num_blocks=64)))
            want = engine.generate([prompt], SamplingParams(max_tokens=16, ignore_eos=True))[0]
            for pod in routers:  # each router serves, at its own pod's client port
                ids, _, _, _ = generate(f"127.0.0.1:{pod.ports[50051]}", token_ids=prompt,
                                        max_tokens=16, ignore_eos=True)
                assert ids == want, pod.name

            # The controller sees both workers through the routers it found in the table.
            deadline = time.monotonic() + 60
            with rpc.make_channel(f"127.0.0.1:{controller.ports[50052]}", CONTROLLER) as ch:
                stub = controller_pb2_grpc.ControllerStub(ch)
                while len(stub.Status(controller_pb2.ControllerStatusRequest(),
                                      timeout=10).workers) != 2:
                    assert time.monotonic() < deadline, cluster.tail(controller, "controller")
                    time.sleep(0.5)
            while {n: api.pods[n].get(ROLE_LABEL) for n in api.pods} != \
                    {"pdserve-worker-0": "prefill", "pdserve-worker-1": "decode"}:
                assert time.monotonic() < deadline, cluster.tail(controller, "label-sync")
                time.sleep(0.2)
            started = {(p.name, n) for p in cluster.pods.values() for n in p.procs}
            assert len(started) == 6 + ROUTERS, sorted(started)
            for pod in cluster.pods.values():  # nothing crashed meanwhile
                for name, proc in pod.procs.items():
                    assert proc.poll() is None, f"{pod.name}/{name}:\n{cluster.tail(pod, name)}"
    finally:
        cluster.stop_all()
        api.close()


@pytest.mark.parametrize("ordinal, label, want", [
    (0, "", "prefill"), (1, "", "decode"), (0, "decode", "decode"), (1, "prefill", "prefill"),
    (2, "bogus", "decode"),
])
def test_worker_start_script_takes_the_label_role_else_the_ordinal(tmp_path, tls_folder,
                                                                   ordinal, label, want):
    objs = objects({"model": {"path": "/models/m"}})
    cluster = FakeCluster(objs, NAMESPACE, tmp_path, secrets=tls_secrets(tls_folder))
    pod = cluster.pods["pdserve-worker-0"]
    words, env = cluster.command(pod, "worker")
    labels = tmp_path / "labels"
    labels.write_text(f'app.kubernetes.io/component="worker"\n{ROLE_LABEL}="{label}"\n'
                      if label else 'app.kubernetes.io/component="worker"\n')
    script = words[:4]  # /bin/sh -c SCRIPT NAME; then the command it execs
    env = {**os.environ, **env, "POD_NAME": f"pdserve-worker-{ordinal}",
           "ROLE_LABEL_FILE": str(labels)}
    out = subprocess.run(script + ["sh", "-c", 'echo "$PDSERVE_WORKER_ROLE $*"', "x"],
                         env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == [want, "--model", "/models/m"]


def test_start_script_finds_the_images_default_model(tmp_path, tls_folder):
    from pdserve.engine.loader import ModelNotFoundError, default_model_path

    try:
        expected = default_model_path()
    except ModelNotFoundError as e:
        pytest.skip(f"the default model is not installed here: {e}")
    cluster = FakeCluster(objects(), NAMESPACE, tmp_path, secrets=tls_secrets(tls_folder))
    (router,) = cluster.pods_of("router")
    words, env = cluster.command(router, "router")
    assert "MODEL_PATH" not in env
    env = {**os.environ, **env, "PATH": f"{cluster.bin}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": str(REPO_ROOT)}
    out = subprocess.run(words[:4] + ["echo"], env=env, capture_output=True, text=True,
                         check=True, cwd=REPO_ROOT)
    assert out.stdout.split() == ["--model", expected]


def _leader(cluster: FakeCluster, masters) -> tuple[object, int]:
    """(the master pod that leads, the storage nodes it counts alive)."""
    from pdserve.proto import kvmaster_pb2 as pb
    from pdserve.proto import kvmaster_pb2_grpc as pb_grpc

    for pod in masters:
        if pod.procs["master"].poll() is not None:
            continue
        with rpc.make_channel(f"127.0.0.1:{pod.ports[50070]}", MASTER) as ch:
            stub = pb_grpc.KVMasterStub(ch)
            try:
                if stub.GetLeader(pb.GetLeaderRequest(), timeout=2).is_leader:
                    return pod, stub.Stats(pb.MasterStatsRequest(), timeout=2).nodes_alive
            except Exception:  # a master still starting or just killed: ask the next one
                continue
    return None, 0


@pytest.mark.skipif(not shutil.which("redis-server"), reason="needs redis-server (apt-get "
                                                             "install redis-server)")
def test_ha_store_pods_fail_over_to_the_standby_master(tmp_path, tls_folder):
    """The HA store as the chart wires it (the chart's Redis, two masters, two storage nodes):
    one master leads with both nodes registered; after the leader is killed the standby
    leads, with both nodes, through the addresses the chart gave them."""
    # Nodes missing heartbeats for 3 s count as dead, so the check after the failover shows
    # that the nodes' heartbeats reach the new leader, not only its journal's memory of them.
    objs = objects({"store": {"ha": {"enabled": True},
                              "master": {"extraArgs": ["--node-timeout-s", "3"]},
                              "nodes": {"replicas": 2, "dramBytes": 32 << 20}}})
    cluster = FakeCluster(objs, NAMESPACE, tmp_path, secrets=tls_secrets(tls_folder))
    masters, nodes = cluster.pods_of("store-master"), cluster.pods_of("store-node")
    assert len(masters) == 2 and len(nodes) == 2
    try:
        with as_operator(tls_folder):  # the masters answer the operator
            (redis,) = cluster.pods_of("redis")
            cluster.start(redis, "redis")
            cluster.wait(redis, "redis", "readinessProbe", 30)
            for pod in masters:
                cluster.start(pod, "master")
            for pod in nodes:
                cluster.start(pod, "node")
            for pod, name in [(p, "master") for p in masters] + [(p, "node") for p in nodes]:
                cluster.wait(pod, name, "startupProbe", READY_S)
                cluster.wait(pod, name, "readinessProbe", READY_S)

            def wait_leader(exclude=None):
                deadline = time.monotonic() + 60
                while True:
                    leader, alive = _leader(cluster, masters)
                    if leader is not None and leader is not exclude and alive == 2:
                        return leader
                    assert time.monotonic() < deadline, (
                        f"no master leads with 2 nodes (leader {leader and leader.name}, "
                        f"{alive}):\n" + "\n".join(cluster.tail(p, "master") for p in masters))
                    time.sleep(0.2)

            first = wait_leader()
            first.procs["master"].kill()  # as a node failure would: no clean hand-over
            second = wait_leader(exclude=first)
            time.sleep(4)  # past the node timeout: alive now means heartbeating to this leader
            assert wait_leader(exclude=first) is second
            for pod in nodes:
                assert pod.procs["node"].poll() is None, cluster.tail(pod, "node")
    finally:
        cluster.stop_all()
