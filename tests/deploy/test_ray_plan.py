"""pdserve on Ray without a Ray cluster: the pure plan (names read back unambiguously, what a
cluster is expected to hold, status rows, command lines with the router's control address and
each member's own TLS folder or `--insecure-internal`, the spec's checks naming the flag), the
driver's certificates (its CA made once per cluster name, a bundle per member holding only its
kind's key) and an actor's writing of them, the sweep of processes an actor left behind (real
processes, and the TLS folders), and the KubeRay manifest
(`deploy/ray/raycluster.yaml`: the CRD's structure, the image, the shm volumes, and a head
command that the real CLI parses into a spec whose resources the pods provide).
"""

from __future__ import annotations

import json
import os
import shlex
import stat
import subprocess
import sys
import time
import tomllib

import pytest
import yaml
from cryptography import x509

from pdserve.launcher.cluster_spec import ClusterSpec
from pdserve.deploy.ray import certs, plan
from pdserve.deploy.ray.actor import ProcessHost, pid_dir, sweep_node
from pdserve.deploy.ray.plan import GroupInfo, RaySpec, RaySpecError
from pdserve.security import pki, tls
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


ROUTER, HTTP, CONTROL, STORE = "10.0.0.1:7000", "10.0.0.1:8000", "10.0.0.1:7100", "10.0.0.1:6000"


def flags_of(argv: list[str]) -> dict[str, str]:
    """--flag value pairs (a flag without a value maps to "")."""
    out, i = {}, 1
    while i < len(argv):
        takes = i + 1 < len(argv) and not argv[i + 1].startswith("--")
        out[argv[i]] = argv[i + 1] if takes else ""
        i += 2 if takes else 1
    return out


def command_lines(s: RaySpec) -> dict[str, list[str]]:
    """Every member's command line, as backend.py writes them."""
    return {"master": plan.master_args(s, "10.0.0.1:6000", "/j"),
            plan.store_member(NODE_B): plan.node_args(s, NODE_B, "10.0.0.2", STORE),
            "decode-1": plan.worker_args(s, "decode-1", "decode", "10.0.0.2:5000", NODE_B,
                                         STORE, 5001),
            "router": plan.router_args(s, ROUTER, HTTP, CONTROL, STORE),
            "controller": plan.controller_args(s, "10.0.0.1:9000", CONTROL, STORE, "/a",
                                              9001)}


def test_command_lines_bind_the_node_ip_and_use_the_node_as_host_id():
    s = spec(worker_cpus=3)
    lines = command_lines(s)
    worker = lines["decode-1"]
    flags = flags_of(worker)
    assert worker[0] == "worker" and flags["--role"] == "decode"
    assert flags["--address"] == flags["--advertise-address"] == "10.0.0.2:5000"
    assert flags["--host-id"] == NODE_B and flags["--threads"] == "3"
    assert flags["--cluster-id"] == "c1"
    flags = flags_of(lines[plan.store_member(NODE_B)])
    assert flags["--host-id"] == NODE_B and flags["--data-address"] == "10.0.0.2:0"
    assert flags["--node-id"] == plan.store_node_id("c1", NODE_B)
    router = parsed(lines["router"])
    # Pools start empty: a restarted router learns every worker's current role from it.
    assert router.prefill_addresses == router.decode_addresses == ()
    assert (router.http_host, router.http_port) == ("10.0.0.1", 8000)
    assert router.address == ROUTER


def parsed(argv: list[str]):
    """The config a `pdserve <kind> ...` command line gives its process, by its own parser."""
    import importlib

    from pdserve.entrypoints import PROCESSES
    from pdserve.flags import config_from_args
    from pdserve.controller.config import ControllerConfig
    from pdserve.kvstore.master.config import MasterConfig
    from pdserve.kvstore.node.config import NodeConfig
    from pdserve.router.config import RouterConfig
    from pdserve.worker.config import WorkerConfig
    from tests.helpers import parser_of

    cls = {"master": MasterConfig, "node": NodeConfig, "worker": WorkerConfig,
           "router": RouterConfig, "controller": ControllerConfig}[argv[0]]
    main = importlib.import_module(PROCESSES[argv[0]][0]).main
    return config_from_args(cls, parser_of(main).parse_args(argv[1:]))


def test_every_command_line_is_its_process_config_as_the_spec_says():
    s = spec(cluster=ClusterSpec(model_path="/m", cluster_id="c1", dtype="float32",
                                 spec_method="ngram", max_in_flight=7,
                                 router_settings={"kv_fetch_weight": 1.5},
                                 controller_settings={"cooldown_s": 5.0}), worker_cpus=2)
    configs = {m: parsed(a) for m, a in command_lines(s).items()}
    assert configs["master"].journal_dir == "/j" and configs["master"].cluster_id == "c1"
    assert configs[plan.store_member(NODE_B)].masters == (STORE,)
    worker = configs["decode-1"]
    assert (worker.model_path, worker.dtype, worker.spec_method, worker.threads,
            worker.store_address, worker.register_with, worker.metrics_port) == (
        "/m", "float32", "ngram", 2, STORE, "", 5001)
    router = configs["router"]
    assert (router.max_in_flight, router.kv_fetch_weight, router.store_address,
            router.max_model_len_tokens) == (7, 1.5, STORE, 1024 * 16)
    controller = configs["controller"]
    assert (controller.router_address, controller.store_address, controller.cooldown_s,
            controller.audit_log) == (CONTROL, STORE, 5.0, "/a")


def test_workers_join_the_cluster_on_the_master_and_the_controller_finds_the_routers_there():
    lines = command_lines(spec())
    assert flags_of(lines["router"])["--control-address"] == CONTROL
    assert flags_of(lines["router"])["--store-address"] == STORE
    assert "--register-with" not in flags_of(lines["decode-1"])
    assert flags_of(lines["decode-1"])["--store-address"] == STORE
    assert flags_of(lines["controller"])["--router"] == CONTROL
    assert flags_of(lines["controller"])["--store"] == STORE
    assert plan.probe_peer("router") == "router" and plan.probe_peer("decode-1") == "worker"
    assert plan.probe_peer(plan.store_member(NODE_B)) is None  # a ready line, no gRPC
    line = plan.ready_line(ROUTER, HTTP, "10.0.0.1:9000", "c1", CONTROL)
    assert line == (f"pdserve ready on {ROUTER} http={HTTP} controller=10.0.0.1:9000 "
                    f"control={CONTROL} cluster=c1 backend=ray")


def test_every_command_line_carries_its_own_members_tls_folder():
    s = spec(base_dir="/srv/pd")
    for member, argv in command_lines(s).items():
        flags = flags_of(argv)
        assert flags["--tls-dir"] == f"/srv/pd/c1/tls/{member}", member
        assert "--insecure-internal" not in flags, member
        assert flags["--tls-dir"] == plan.member_tls_dir("/srv/pd", "c1", member)
    assert len({flags_of(a)["--tls-dir"] for a in command_lines(s).values()}) == 5


def test_insecure_internal_is_passed_to_every_process_and_no_folder():
    s = spec(cluster=ClusterSpec(model_path="/m", cluster_id="c1", insecure_internal=True))
    for member, argv in command_lines(s).items():
        assert "--insecure-internal" in argv, member
        assert "--tls-dir" not in argv, member


def test_the_client_ports_tls_files_reach_the_router_only(tmp_path):
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"  # the router's config checks they exist
    cert.write_text("")
    key.write_text("")
    s = spec(cluster=ClusterSpec(model_path="/m", cluster_id="c1", tls_cert=str(cert),
                                 tls_key=str(key)))
    lines = command_lines(s)
    flags = flags_of(lines["router"])
    assert flags["--tls-cert"] == str(cert) and flags["--tls-key"] == str(key)
    assert "--tls-client-ca" not in flags
    assert not [m for m, a in lines.items() if m != "router" and "--tls-cert" in a]


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

    args = build_parser().parse_args(["serve", "--backend", "ray", "--store-port", "7000"])
    with pytest.raises(ValueError, match="--store-port is not used with --backend ray"):
        ray_spec(args, "/m", {})
    # The router's client ports bind what --host and --http-host say, as `pdserve serve`.
    args = build_parser().parse_args(["serve", "--backend", "ray", "--host", "0.0.0.0",
                                      "--http-host", "10.0.0.5"])
    cluster = ray_spec(args, "/m", {}).cluster
    assert (cluster.host, cluster.http_host) == ("0.0.0.0", "10.0.0.5")


def test_the_driver_makes_the_ca_once_and_issues_each_member_its_own_kind(tmp_path,
                                                                           monkeypatch):
    monkeypatch.setenv("PDSERVE_STATE_DIR", str(tmp_path / "state"))
    folder = certs.state_folder("c1")
    assert folder == str(tmp_path / "state" / "ray" / "c1" / "tls")
    with pytest.raises(certs.CertError, match=f"no CA of cluster c1 in {folder}"):
        certs.issuer("c1", None, make=False)  # renew-certs before any serve
    issuer = certs.issuer("c1", None)
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(os.path.join(folder, "ca.key")).st_mode) == 0o600
    with open(os.path.join(folder, "ca.crt"), "rb") as f:
        ca = f.read()
    assert certs.issuer("c1", None).folder == folder  # a re-run keeps the CA
    with open(os.path.join(folder, "ca.crt"), "rb") as f:
        assert f.read() == ca

    bundle = issuer.bundle("decode-1", "worker")
    assert sorted(bundle) == ["ca.crt", "worker.crt", "worker.key"]  # no CA key, no other kind
    assert bundle["ca.crt"] == ca
    info = pki.info(bundle["worker.crt"])
    assert str(info.identity) == "worker/decode-1"
    lifetime = info.not_after - info.not_before
    assert abs(lifetime.total_seconds() - certs.LIFETIME_S - 300) < 60  # 5 min backdated
    x509.load_pem_x509_certificate(bundle["worker.crt"]).verify_directly_issued_by(
        x509.load_pem_x509_certificate(ca))
    assert issuer.bundle("decode-1", "worker")["worker.key"] != bundle["worker.key"]


def test_a_users_folder_without_the_ca_key_hands_out_its_own_certificates(tmp_path):
    folder = tmp_path / "mine"
    pki.init_folder(str(folder), "c1")
    os.unlink(folder / "ca.key")
    issuer = certs.issuer("c1", str(folder))
    assert issuer.folder == str(folder) and not issuer.has_ca_key
    bundle = issuer.bundle("master", "master")
    assert bundle == {n: (folder / n).read_bytes() for n in ("ca.crt", "master.crt",
                                                             "master.key")}
    with pytest.raises(certs.CertError, match="--tls-dir .*: no ca.crt"):
        certs.issuer("c1", str(tmp_path / "empty"))


def test_an_actor_writes_only_its_own_kinds_bundle_key_0600(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_STATE_DIR", str(tmp_path / "state"))
    issuer = certs.issuer("c1", None)
    host = ProcessHost.__new__(ProcessHost)  # its file handling alone, without Ray
    host.member, host.kind = "prefill-0", "worker"
    host.tls_dir = plan.member_tls_dir(str(tmp_path / "node"), "c1", "prefill-0")
    host._write_tls(issuer.bundle("prefill-0", "worker"))
    assert sorted(os.listdir(host.tls_dir)) == ["ca.crt", "worker.crt", "worker.key"]
    assert stat.S_IMODE(os.stat(host.tls_dir).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(os.path.join(host.tls_dir, "worker.key")).st_mode) == 0o600
    tls.TlsFolder(host.tls_dir).material("worker")  # the process can use it
    with pytest.raises(ValueError, match="a worker's TLS bundle is ca.crt, worker.crt and "
                                         "worker.key, got ca.crt, master.crt, master.key"):
        host._write_tls(issuer.bundle("master", "master"))
    # Renewing with another CA's certificate would cut it off from the others: refused.
    host.tls = "mutual"
    other = certs.issuer("c2", None)
    with pytest.raises(ValueError, match="another CA than the cluster's"):
        host.renew_tls(other.bundle("prefill-0", "worker"))
    assert tls.TlsFolder(host.tls_dir).material("worker").ca_pem == (
        issuer.bundle("x", "worker")["ca.crt"])


def test_the_tls_flags_of_serve_reach_the_spec(tmp_path, monkeypatch):
    from pdserve.cli import build_parser
    from pdserve.deploy.ray.cli import ray_spec

    monkeypatch.delenv("PDSERVE_TLS_DIR", raising=False)
    monkeypatch.delenv("PDSERVE_INSECURE_INTERNAL", raising=False)
    parse = build_parser().parse_args
    assert ray_spec(parse(["serve", "--backend", "ray"]), "/m", {}).cluster.tls_dir is None
    s = ray_spec(parse(["serve", "--backend", "ray", "--insecure-internal"]), "/m", {})
    assert s.cluster.insecure_internal and "--insecure-internal" in plan.master_args(s, "a", "j")
    monkeypatch.chdir(tmp_path)
    s = ray_spec(parse(["serve", "--backend", "ray", "--tls-dir", "rel"]), "/m", {})
    assert s.cluster.tls_dir == str(tmp_path / "rel") and not s.cluster.insecure_internal
    monkeypatch.setenv("PDSERVE_INSECURE_INTERNAL", "1")
    with pytest.raises(ValueError, match="--tls-dir and --insecure-internal exclude"):
        ray_spec(parse(["serve", "--backend", "ray", "--tls-dir", "rel"]), "/m", {})


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
    keys = [os.path.join(plan.member_tls_dir(base, c, "decode-1"), "worker.key")
            for c in ("c1", "c1x")]
    for key in keys:
        os.makedirs(os.path.dirname(key))
        with open(key, "w") as f:
            f.write("k")
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
        assert not os.path.exists(plan.tls_root(base, "c1"))  # the members' keys
        assert os.path.exists(keys[1])  # another cluster's
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


def test_a_cluster_that_can_never_be_placed_is_told_at_once_with_the_arithmetic():
    # One 2-CPU machine: 2 workers x 1 CPU + 3 control processes x 0.5 CPU = 3.5 CPUs.
    one_machine = [{"CPU": 2.0, "memory": 8e9}]
    why = plan.unplaceable(spec(), one_machine)
    assert why is not None and "need 3.5 CPU in all (2 workers x 1 + 3 control processes " \
        "x 0.5) and the Ray cluster has 2 (1 nodes)" in why and "--ray-worker-cpus" in why
    # A quarter of a CPU per worker fits there.
    assert plan.unplaceable(spec(worker_cpus=0.25), one_machine) is None
    # Enough in all, but no one node holds the control group (its bundles are packed).
    why = plan.unplaceable(spec(worker_cpus=0.25, control_cpus=1.0),
                           [{"CPU": 2.0}, {"CPU": 2.0}])
    assert why is not None and "no Ray node can hold the store master, router and " \
        "controller (3 CPU on one node)" in why
    # A resource no node has.
    why = plan.unplaceable(spec(decode_resources={"h100": 1.0}), [{"CPU": 64.0}])
    assert why is not None and "need 1 h100 in all" in why and "has 0" in why
    assert plan.unplaceable(spec(), []) == "the Ray cluster has no alive node"
