"""pdserve on Ray without a Ray cluster: the pure plan (names read back unambiguously, what a
cluster is expected to hold, status rows, command lines, the spec's checks naming the flag),
the sweep of processes an actor left behind (real processes), and the KubeRay manifest
(`deploy/ray/raycluster.yaml`: the CRD's structure, the image, the shm volumes, and a head
command that the real CLI parses into a spec whose resources the pods provide).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
import tomllib

import pytest
import yaml

from pdserve.controller.cluster_spec import ClusterSpec
from pdserve.deploy.ray import plan
from pdserve.deploy.ray.actor import pid_dir, sweep_node
from pdserve.deploy.ray.plan import GroupInfo, RaySpec, RaySpecError
from tests.helpers import REPO_ROOT

NODE_A, NODE_B = "a1" * 28, "b2" * 28  # Ray node ids are 56 hex digits


def spec(**overrides) -> RaySpec:
    cluster = overrides.pop("cluster", ClusterSpec(model_path="/m", cluster_id="c1"))
    return RaySpec(cluster, **overrides)


def test_names_read_back_only_for_their_own_cluster():
    assert plan.full_name("c1", "prefill-0") == "pdserve-c1-prefill-0"
    assert plan.member_of("c1", "pdserve-c1-prefill-0") == "prefill-0"
    assert plan.member_of("c1", "pdserve-c1-kvnode-a1a1a1a1a1a1") == "kvnode-a1a1a1a1a1a1"
    # Cluster "c1-x" starts like "c1": its members are never taken for c1's.
    assert plan.member_of("c1", "pdserve-c1-x-router") is None
    assert plan.member_of("c1-x", "pdserve-c1-x-router") == "router"
    assert plan.member_of("c1", "pdserve-c2-router") is None
    assert plan.member_of("c1", "pdserve-c1-prefill") is None


def test_expected_members_come_from_the_placement_groups():
    groups = [GroupInfo("pdserve-c1-control", "CREATED", (NODE_A,) * 3),
              GroupInfo("pdserve-c1-prefill-0", "CREATED", (NODE_A,)),
              GroupInfo("pdserve-c1-decode-1", "CREATED", (NODE_B,)),
              GroupInfo("pdserve-c1-decode-2", "REMOVED", (NODE_B,)),
              GroupInfo("pdserve-c1-x-control", "CREATED", (NODE_A,) * 3)]
    members = plan.expected_members("c1", groups)
    assert members == ["router", "controller", "decode-1", "prefill-0",
                       plan.store_member(NODE_A), plan.store_member(NODE_B), "master"]
    live = {"router": {"state": "running", "health": "SERVING", "pid": 7, "restarts": 0,
                       "address": "h:1", "node_id": NODE_A},
            "decode-1": {"state": "restarting", "exit_code": -9, "restarts": 2}}
    rows = {r[0]: r for r in plan.status_rows(members, live)}
    assert rows["router"][2:] == ("running", "SERVING", "7", "0", "h:1", NODE_A[:12])
    assert rows["decode-1"][2] == "restarting (exit -9)"
    assert rows["prefill-0"][2] == "actor dead"


def test_command_lines_bind_the_node_ip_and_use_the_node_as_host_id():
    s = spec(worker_cpus=3)
    worker = plan.worker_args(s, "decode", "10.0.0.2:5000", NODE_B, "10.0.0.1:6000",
                              "10.0.0.1:7000", 5001)
    flags = dict(zip(worker[1::2], worker[2::2]))
    assert worker[0] == "worker" and flags["--role"] == "decode"
    assert flags["--address"] == flags["--advertise-address"] == "10.0.0.2:5000"
    assert flags["--host-id"] == NODE_B and flags["--threads"] == "3"
    assert flags["--register-with"] == "10.0.0.1:7000" and flags["--cluster-id"] == "c1"
    node = plan.node_args(s, NODE_B, "10.0.0.2", "10.0.0.1:6000")
    flags = dict(zip(node[1::2], node[2::2]))
    assert flags["--host-id"] == NODE_B and flags["--data-address"] == "10.0.0.2:0"
    assert flags["--node-id"] == plan.store_node_id("c1", NODE_B)
    router = plan.router_args(s, "10.0.0.1:7000", "10.0.0.1:8000", "10.0.0.1:6000")
    flags = dict(zip(router[1::2], router[2::2]))
    # Pools start empty: a restarted router learns every worker's current role from it.
    assert flags["--prefill"] == flags["--decode"] == ""
    assert flags["--http-host"] == "10.0.0.1" and flags["--http-port"] == "8000"


def test_bundles_and_the_checks_that_name_the_flag():
    s = spec(worker_gpus=1, decode_resources={"big": 1.0}, control_resources={"head": 0.1})
    assert s.worker_bundle("decode") == {"CPU": 1.0, "GPU": 1, "big": 1.0}
    assert s.worker_bundle("prefill") == {"CPU": 1.0, "GPU": 1}
    assert s.control_bundles() == [{"CPU": 0.5, "head": 0.1}] * 3
    no_controller = ClusterSpec(model_path="/m", cluster_id="c1", controller=False)
    assert spec(cluster=no_controller).control_members() == ("master", "router")
    for kwargs, flag in ((dict(worker_cpus=0), "ray_worker_cpus"),
                         (dict(worker_gpus=-1), "ray_worker_gpus"),
                         (dict(control_cpus=0), "ray_control_cpus"),
                         (dict(prefill_resources={"GPU": 1}), "ray_prefill_resources"),
                         (dict(decode_resources={"x": 0}), "ray_decode_resources"),
                         (dict(base_dir="rel"), "ray_dir")):
        with pytest.raises(RaySpecError, match=flag):
            spec(**kwargs)
    with pytest.raises(RaySpecError, match="--cluster"):
        spec(cluster=ClusterSpec(model_path="/m"))
    with pytest.raises(RaySpecError, match="--ray-decode-resources: not JSON"):
        plan.parse_resources("--ray-decode-resources", "{big: 1}")
    with pytest.raises(RaySpecError, match="expected a JSON object"):
        plan.parse_resources("--ray-decode-resources", "[1]")


def test_local_only_flags_are_refused_with_the_ray_backend():
    from pdserve.cli import build_parser
    from pdserve.deploy.ray.cli import ray_spec

    args = build_parser().parse_args(["serve", "--backend", "ray", "--host", "0.0.0.0"])
    with pytest.raises(ValueError, match="--host is not used with --backend ray"):
        ray_spec(args, "/m", {})


def _sleeper(marker: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *marker, "-c", "import time; time.sleep(60)"],
                            start_new_session=True)


def test_sweep_stops_recorded_processes_of_its_cluster_only(tmp_path):
    base, node = str(tmp_path / "base"), NODE_A
    mine = _sleeper(plan.cluster_marker("c1"))
    other = _sleeper(plan.cluster_marker("c1x"))  # a reused pid: another cluster's process
    shm = tmp_path / "shm"
    shm.mkdir()
    segments = [f"pdserve-{plan.store_node_id('c1', node)}.0123abcd.dram0",
                f"pdserve-{plan.store_node_id('c1', NODE_B)}.0123abcd.dram0"]
    for name in segments:
        (shm / name).write_bytes(b"x")
    try:
        os.makedirs(pid_dir(base, "c1", node))
        for member, p in (("decode-1", mine), ("prefill-0", other)):
            with open(os.path.join(pid_dir(base, "c1", node), f"{member}.pid"), "w") as f:
                f.write(f"{p.pid}\n")
        time.sleep(0.2)  # both have exec'd: their command lines carry the marker
        assert sweep_node(base, "c1", node, timeout_s=5, shm_dir=str(shm)) == [mine.pid]
        assert mine.wait(timeout=10) == -15  # SIGTERM to its process group
        assert other.poll() is None
        assert os.listdir(pid_dir(base, "c1", node)) == []
        assert sorted(os.listdir(shm)) == segments[1:]  # only this node's segment
    finally:
        for p in (mine, other):
            p.kill()
            p.wait()


def test_kuberay_manifest_runs_the_cli_on_resources_its_pods_provide():
    with open(REPO_ROOT / "deploy/ray/raycluster.yaml") as f:
        docs = [d for d in yaml.safe_load_all(f) if d]
    with open(REPO_ROOT / "pyproject.toml", "rb") as f:
        version = tomllib.load(f)["project"]["version"]
    assert len(docs) == 1
    rc = docs[0]
    assert rc["apiVersion"] == "ray.io/v1" and rc["kind"] == "RayCluster"
    assert rc["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    head, groups = rc["spec"]["headGroupSpec"], rc["spec"]["workerGroupSpecs"]
    assert groups and all(g["groupName"] and g["replicas"] >= 1 for g in groups)
    for group in [head, *groups]:
        pod = group["template"]["spec"]
        [container] = pod["containers"]
        assert container["image"] == f"pdserve:{version}-ray"  # build.sh --with-ray
        assert container["command"] == ["/bin/bash", "-lc", "--"]
        assert "$KUBERAY_GEN_RAY_START_CMD" in container["args"][0]
        shm = [v["name"] for v in pod["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory"]
        assert [m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"
                and m["name"] in shm]

    # The head's pdserve command, parsed by the real CLI into a valid spec.
    from pdserve.cli import build_parser
    from pdserve.deploy.ray.cli import ray_spec

    head_container = head["template"]["spec"]["containers"][0]
    [line] = [ln for ln in head_container["args"][0].splitlines()
              if ln.startswith("exec pdserve ")]
    args = build_parser().parse_args(shlex.split(line)[2:])
    assert args.func.__name__ == "cmd_serve" and args.backend == "ray" and not args.detach
    assert args.address == "127.0.0.1:6379"
    s = ray_spec(args, "/model", {})
    ports = {p["name"]: p["containerPort"] for p in head_container["ports"]}
    assert ports["grpc"] == args.port and ports["http"] == args.http_port

    def provided(group) -> dict[str, float]:  # KubeRay passes a JSON string, quoted once more
        out = json.loads(json.loads(group["rayStartParams"].get("resources", '"{}"')))
        return {**out, "CPU": float(group["rayStartParams"]["num-cpus"])}

    head_has = provided(head)
    for name, amount in {"CPU": s.control_cpus, **s.control_resources}.items():
        assert head_has.get(name, 0) >= amount * len(s.control_members()), name
    # Every worker's bundle fits on a worker pod, and the pods hold them all.
    slots = 0
    for g in groups:
        has = provided(g)
        fits = min(has.get(k, 0) // v for k, v in s.worker_bundle("prefill").items())
        assert s.worker_bundle("decode").keys() == s.worker_bundle("prefill").keys()
        slots += int(fits) * g["replicas"]
    assert slots >= s.cluster.prefill_workers + s.cluster.decode_workers
