"""The Helm chart, checked without a cluster: rendered by the real Helm engine for several value
sets, linted, every object validated against the Kubernetes OpenAPI schema, and the relations
Kubernetes would rely on (selectors, Service target ports, budgets, probes) checked object by
object. The pod-level smoke test (the rendered commands run as processes) is test_helm_smoke.py.
"""

from __future__ import annotations

import pytest

from tests.deploy.chart import (RELEASE, VALUE_SETS, argv, container, container_port,
                                containers, flag, helm, matches, merged, named, needs_helm,
                                objects, of_kind, render, selected_templates, workloads, CHART)

pytestmark = needs_helm

FULL = "pdserve"  # the release is named like the chart: the objects' prefix
# The oldest Kubernetes the chart supports (Chart.yaml kubeVersion) and the newest schema shipped.
KUBE_VERSIONS = ("1.27.0", None)


@pytest.fixture(scope="module", params=sorted(VALUE_SETS))
def rendered(request) -> tuple[str, list[dict]]:
    return request.param, objects(VALUE_SETS[request.param])


def test_lint_is_clean_for_every_value_set():
    for name, values in VALUE_SETS.items():
        report = helm.lint(str(CHART), values, strict=True, kube_version="v1.30.0")
        problems = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
        assert not problems, f"{name}: {problems}"


def test_every_object_is_valid_kubernetes(rendered):
    import kubernetes_validate as kv

    name, objs = rendered
    seen = set()
    for o in objs:
        seen.add(o["kind"])
        if o["kind"] == "ServiceMonitor":  # a CRD: no schema ships with Kubernetes
            assert o["apiVersion"] == "monitoring.coreos.com/v1"
            assert {e["port"] for e in o["spec"]["endpoints"]} == {"http", "metrics"}
            continue
        if o["apiVersion"] == "cert-manager.io/v1":  # CRDs too: test_helm_security.py
            assert o["kind"] in ("Certificate", "Issuer")
            continue
        for version in KUBE_VERSIONS:
            try:
                kv.validate(o, version or kv.latest_version(), strict=True)
            except kv.ValidationError as e:
                pytest.fail(f"{name}: {o['kind']} {o['metadata']['name']} (Kubernetes "
                            f"{version or 'latest'}): {e}")
    assert {"StatefulSet", "Deployment", "Service", "PodDisruptionBudget"} <= seen
    assert ("NetworkPolicy" in seen) == VALUE_SETS[name].get("networkPolicy", {}).get(
        "enabled", True)


def test_no_empty_keys_are_rendered(rendered):
    """An optional block left empty must vanish, not render as `key: null`."""
    name, objs = rendered

    def walk(node, path):
        if isinstance(node, dict):
            for k, v in node.items():
                assert v is not None, f"{name}: {path}.{k} is null"
                walk(v, f"{path}.{k}")
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{path}[{i}]")

    for o in objs:
        walk(o, f"{o['kind']}/{o['metadata']['name']}")


def test_selectors_services_and_budgets_reach_existing_pods(rendered):
    name, objs = rendered
    for w in workloads(objs):
        labels = w["spec"]["template"]["metadata"]["labels"]
        assert matches(w["spec"]["selector"]["matchLabels"], labels), w["metadata"]["name"]
        assert "pdserve.io/role" not in w["spec"]["selector"]["matchLabels"] or \
            VALUE_SETS[name].get("staticMode"), "only fixed roles may be selected on"
        if w["kind"] == "StatefulSet":  # its pods' DNS names come from this Service
            svc = named(objs, "Service", w["spec"]["serviceName"])
            assert svc["spec"].get("clusterIP") == "None"
            assert matches(svc["spec"]["selector"], labels)
    for svc in of_kind(objs, "Service"):
        pods = selected_templates(objs, svc["spec"]["selector"])
        assert pods, f"{name}: Service {svc['metadata']['name']} selects no pods"
        for port in svc["spec"]["ports"]:
            for w in pods:
                assert container_port(w, port["targetPort"]) is not None, (
                    f"{name}: Service {svc['metadata']['name']} port {port['name']} -> "
                    f"{port['targetPort']}, absent from {w['metadata']['name']}")
    budgets = of_kind(objs, "PodDisruptionBudget")
    assert budgets
    for pdb in budgets:
        assert selected_templates(objs, pdb["spec"]["selector"]["matchLabels"]), \
            f"{name}: PodDisruptionBudget {pdb['metadata']['name']} selects no pods"
    for sm in of_kind(objs, "ServiceMonitor"):
        scraped = [s for s in of_kind(objs, "Service")
                   if matches(sm["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])]
        ports = {p["name"] for s in scraped for p in s["spec"]["ports"]}
        assert {e["port"] for e in sm["spec"]["endpoints"]} <= ports


def test_probes_outlast_a_model_load_and_a_saturated_worker(rendered):
    name, objs = rendered
    for w in workloads(objs):
        spec = w["spec"]["template"]["spec"]
        for c in spec["containers"]:
            if c["name"] in ("label-sync", "redis"):
                continue
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                probe = c[kind]
                assert "initialDelaySeconds" not in probe, "startupProbe guards the start"
                if "grpc" in probe:  # the standard health service on the process's port
                    assert probe["grpc"]["port"] in [p["containerPort"] for p in c["ports"]]
            if c["name"] == "worker":
                start = c["startupProbe"]
                assert start["failureThreshold"] * start["periodSeconds"] >= 600
                assert c["readinessProbe"]["timeoutSeconds"] >= 5
                assert c["livenessProbe"]["timeoutSeconds"] >= 5
                # Longer than the controller's drain timeout (60 s by default).
                assert spec["terminationGracePeriodSeconds"] > 60
            if c["name"] == "router":
                grace = float(flag(c, "--shutdown-grace-s") or 30)
                assert spec["terminationGracePeriodSeconds"] > grace
                # Alive while it serves at all; ready only while a request can be served.
                assert c["livenessProbe"]["grpc"]["service"] == "pdserve.v1.RouterControl"
                assert "service" not in c["readinessProbe"]["grpc"]


def test_default_values_run_the_default_model_on_cpu_with_one_worker_statefulset():
    objs = objects()
    sts = named(objs, "StatefulSet", f"{FULL}-worker")
    assert sts["spec"]["replicas"] == 2
    worker = container(sts, "worker")
    assert "nvidia.com/gpu" not in str(worker["resources"])
    assert worker["resources"]["limits"]["cpu"] == "2"
    env = {e["name"]: e for e in worker["env"]}
    assert "MODEL_PATH" not in env, "the image's default model, found by the start script"
    assert "default_model_path" in worker["command"][2]
    assert env["INITIAL_PREFILL_WORKERS"]["value"] == "1"
    assert env["PDSERVE_WORKER_THREADS"]["valueFrom"]["resourceFieldRef"]["resource"] == \
        "limits.cpu"
    # It joins the cluster through the store master, whose membership table the routers follow.
    assert "--register-with" not in argv(worker)
    assert flag(worker, "--store-address") == \
        f"{FULL}-master-0.{FULL}-master.pdserve-test.svc.cluster.local:50070"
    assert "--role" not in argv(worker), "the role comes from the ordinal or the label"
    assert "--model" not in argv(worker)
    for absent in ("--cluster-id", "--shutdown-grace-s", "--max-predicted-ttft-s"):
        assert all(absent not in argv(c) for w in workloads(objs) for c in containers(w))
    node = container(named(objs, "StatefulSet", f"{FULL}-node"), "node")
    shm = named(objs, "StatefulSet", f"{FULL}-node")["spec"]["template"]["spec"]["volumes"][0]
    assert shm["emptyDir"]["medium"] == "Memory"
    assert int(shm["emptyDir"]["sizeLimit"]) > int(flag(node, "--dram-bytes"))
    assert {"mountPath": "/dev/shm", "name": shm["name"]} in node["volumeMounts"]
    assert named(objs, "Deployment", f"{FULL}-controller")
    assert flag(container(named(objs, "StatefulSet", f"{FULL}-master"), "master"),
                "--journal-dir")


def test_gpu_values_ask_for_a_gpu_per_worker():
    objs = objects(VALUE_SETS["gpu"])
    sts = named(objs, "StatefulSet", f"{FULL}-worker")
    assert sts["spec"]["replicas"] == 4
    worker = container(sts, "worker")
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
    env = {e["name"]: e for e in worker["env"]}
    assert env["INITIAL_PREFILL_WORKERS"]["value"] == "2"
    start = worker["startupProbe"]
    assert start["failureThreshold"] * start["periodSeconds"] >= 1800


def test_ha_values_run_standby_masters_over_redis():
    objs = objects(VALUE_SETS["ha"])
    masters = named(objs, "StatefulSet", f"{FULL}-master")
    assert masters["spec"]["replicas"] == 2
    master = container(masters, "master")
    assert flag(master, "--redis-url") == "$(REDIS_URL)" and "--journal-dir" not in argv(master)
    redis_url = {e["name"]: e.get("value") for e in master["env"]}["REDIS_URL"]
    assert redis_url == f"redis://{FULL}-redis.pdserve-test.svc.cluster.local:6379/0"
    assert named(objs, "Service", f"{FULL}-redis")
    addresses = [f"{FULL}-master-{i}.{FULL}-master.pdserve-test.svc.cluster.local:50070"
                 for i in range(2)]
    node = container(named(objs, "StatefulSet", f"{FULL}-node"), "node")
    worker = container(named(objs, "StatefulSet", f"{FULL}-worker"), "worker")
    assert flag(node, "--master").split(",") == addresses
    assert flag(worker, "--store-address").split(",") == addresses
    for c in (master, node, worker):
        assert flag(c, "--cluster-id") == "pdserve-ha-example"
    router = container(named(objs, "Deployment", f"{FULL}-router"), "router")
    assert flag(router, "--shutdown-grace-s") == "30"
    external = objects(merged(VALUE_SETS["ha"], {"store": {"ha": {"redis": {
        "url": "redis://redis.example:6379/3"}}}}))
    assert not [o for o in external if o["metadata"]["name"] == f"{FULL}-redis"]


def test_static_mode_renders_two_worker_statefulsets_and_no_controller():
    objs = objects(VALUE_SETS["static"])
    kinds = {(o["kind"], o["metadata"]["name"]) for o in objs}
    assert not [k for k in kinds if "controller" in k[1]], "no controller, no RBAC"
    assert not of_kind(objs, "Role") and not of_kind(objs, "ServiceAccount")
    sets = {s["metadata"]["name"]: s for s in of_kind(objs, "StatefulSet")
            if s["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
            == "worker"}
    assert set(sets) == {f"{FULL}-prefill", f"{FULL}-decode"}
    for role, replicas in (("prefill", 1), ("decode", 2)):
        s = sets[f"{FULL}-{role}"]
        assert s["spec"]["replicas"] == replicas
        assert s["spec"]["selector"]["matchLabels"]["pdserve.io/role"] == role
        assert flag(container(s, "worker"), "--role") == role
        assert s["spec"]["serviceName"] == f"{FULL}-worker"


def test_optional_flags_render_only_when_set():
    objs = objects({"clusterId": "c1", "router": {"shutdownGraceSeconds": 120,
                                                  "maxPredictedTtftSeconds": 0}})
    router = named(objs, "Deployment", f"{FULL}-router")
    c = container(router, "router")
    assert flag(c, "--shutdown-grace-s") == "120" and flag(c, "--max-predicted-ttft-s") == "0"
    assert router["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 135
    for kind, name, cname in (("StatefulSet", "master", "master"), ("StatefulSet", "node", "node"),
                              ("StatefulSet", "worker", "worker")):
        assert flag(container(named(objs, kind, f"{FULL}-{name}"), cname), "--cluster-id") == "c1"
    assert flag(c, "--cluster-id") is None, "the router has no cluster id"


def test_controller_may_only_read_and_label_pods_of_its_namespace():
    objs = objects()
    (role,) = of_kind(objs, "Role")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"],
                              "verbs": ["get", "list", "watch", "patch"]}]
    assert not of_kind(objs, "ClusterRole") and not of_kind(objs, "ClusterRoleBinding")
    (binding,) = of_kind(objs, "RoleBinding")
    deployment = named(objs, "Deployment", f"{FULL}-controller")
    assert binding["subjects"][0]["name"] == \
        deployment["spec"]["template"]["spec"]["serviceAccountName"]
    sync = container(deployment, "label-sync")
    assert flag(sync, "--selector") == \
        f"app.kubernetes.io/instance={RELEASE},app.kubernetes.io/component=worker"
    for w in workloads(objs):  # no other pod gets an API token
        if w is not deployment:
            assert w["spec"]["template"]["spec"]["automountServiceAccountToken"] is False


@pytest.mark.parametrize("values, where", [
    ({"bogus": 1}, "bogus"),
    ({"workers": {"bogus": 1}}, "bogus"),
    ({"store": {"nodes": {"bogus": 1}}}, "bogus"),
    ({"workers": {"initialRoles": {"prefill": -1, "decode": 1}}}, "/workers/initialRoles/prefill"),
    ({"workers": {"initialRoles": {"prefill": 1, "decode": 0}}}, "/workers/initialRoles/decode"),
    ({"workers": {"numBlocks": "many"}}, "/workers/numBlocks"),
    ({"router": {"replicas": -1}}, "/router/replicas"),
    ({"router": {"autoscaling": {"minReplicas": 0}}}, "/router/autoscaling/minReplicas"),
    ({"router": {"autoscaling": {"requestsInFlight": {"averageValue": "lots"}}}},
     "/router/autoscaling/requestsInFlight/averageValue"),
    ({"router": {"autoscaling": {"bogus": 1}}}, "bogus"),
    ({"clusterId": "has space"}, "/clusterId"),
    ({"store": {"ha": {"replicas": 1}}}, "/store/ha/replicas"),
    ({"controller": {"mode": "sometimes"}}, "/controller/mode"),
])
def test_schema_refuses_bad_values_naming_the_field(values, where):
    with pytest.raises(helm.HelmError) as e:
        render(values)
    assert where in str(e.value)



MASTER_0 = f"{FULL}-master-0.{FULL}-master.pdserve-test.svc.cluster.local:50070"


def test_several_routers_scaled_by_an_autoscaler_share_the_membership_table():
    import kubernetes_validate as kv

    objs = objects({"router": {"replicas": 3, "autoscaling": {"enabled": True}}})
    for o in objs:
        if o["apiVersion"] != "cert-manager.io/v1":
            for version in KUBE_VERSIONS:
                kv.validate(o, version or kv.latest_version(), strict=True)
    (hpa,) = of_kind(objs, "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    router = named(objs, "Deployment", f"{FULL}-router")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": router["metadata"]["name"]}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 8)
    assert hpa["spec"]["metrics"] == [{"type": "Pods", "pods": {
        "metric": {"name": "pdserve_requests_in_flight"},
        "target": {"type": "AverageValue", "averageValue": "64"}}}]
    assert "behavior" not in hpa["spec"]
    assert "replicas" not in router["spec"], "the HPA owns the count"
    # Every router lists itself in the table at its pod IP's control port, and follows it.
    for w in of_kind(objs, "Deployment"):
        if w["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"] == "router":
            c = container(w, "router")
            assert flag(c, "--advertise-control-address") == "$(POD_IP):50053"
            env = {e["name"]: e for e in c["env"]}
            assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
            assert flag(c, "--store-address") == MASTER_0
            assert "--share-port" not in argv(c), "one router per pod"
    for sts in of_kind(objs, "StatefulSet"):
        for c in containers(sts):
            assert "--register-with" not in argv(c), sts["metadata"]["name"]
    controller = named(objs, "Deployment", f"{FULL}-controller")
    c = container(controller, "controller")
    assert flag(c, "--store") == MASTER_0 and "--router" not in argv(c)
    # Its label sync asks any one router (each knows every worker).
    assert flag(container(controller, "label-sync"), "--router") == \
        f"{FULL}-router-control.pdserve-test.svc.cluster.local:50053"
    (pdb,) = [b for b in of_kind(objs, "PodDisruptionBudget")
              if b["metadata"]["name"] == f"{FULL}-router"]
    assert pdb["spec"]["maxUnavailable"] == 1
    assert router["spec"]["strategy"] == {
        "type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}


def test_router_replicas_without_an_autoscaler_and_its_other_metrics():
    objs = objects({"router": {"replicas": 3}})
    assert named(objs, "Deployment", f"{FULL}-router")["spec"]["replicas"] == 3
    assert not of_kind(objs, "HorizontalPodAutoscaler")
    behavior = {"scaleDown": {"stabilizationWindowSeconds": 600}}
    objs = objects({"router": {"autoscaling": {
        "enabled": True, "minReplicas": 3, "maxReplicas": 3,
        "requestsInFlight": {"metricName": "", "averageValue": 64},
        "targetCPUUtilizationPercentage": 70, "behavior": behavior}}})
    (hpa,) = of_kind(objs, "HorizontalPodAutoscaler")
    assert hpa["spec"]["metrics"] == [{"type": "Resource", "resource": {
        "name": "cpu", "target": {"type": "Utilization", "averageUtilization": 70}}}]
    assert hpa["spec"]["behavior"] == behavior
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (3, 3)


@pytest.mark.parametrize("autoscaling, message", [
    ({"minReplicas": 4, "maxReplicas": 3}, "minReplicas (4) must not exceed maxReplicas (3)"),
    ({"requestsInFlight": {"metricName": "", "averageValue": 64}}, "needs a metric"),
])
def test_an_autoscaler_that_cannot_work_is_refused(autoscaling, message):
    with pytest.raises(helm.HelmError) as e:
        render({"router": {"autoscaling": {"enabled": True, **autoscaling}}})
    assert message in str(e.value)


def test_readme_documents_every_value_and_only_real_ones():
    import json
    import re

    schema = json.loads((CHART / "values.schema.json").read_text())

    def leaves(node, path):
        if node.get("type") == "object" and node.get("properties"):
            for k, v in node["properties"].items():
                yield from leaves(v, f"{path}.{k}" if path else k)
        else:
            yield path

    paths = set(leaves(schema, ""))
    rows = set(re.findall(r"^\| `([A-Za-z0-9_.]+)` \|", (CHART / "README.md").read_text(), re.M))
    undocumented = [p for p in sorted(paths)
                    if not any(p == r or p.startswith(r + ".") for r in rows)]
    assert not undocumented, f"values missing from README.md's table: {undocumented}"
    stale = [r for r in sorted(rows) if not any(p == r or p.startswith(r + ".") for p in paths)]
    assert not stale, f"README.md documents values the chart does not have: {stale}"
