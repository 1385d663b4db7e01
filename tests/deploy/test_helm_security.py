"""The chart deploys a closed cluster, checked on the rendered objects: each pod holds only its
own kind's certificate and key, and no key ever appears in the manifests; every process is told
its TLS folder (or, only when asked, to run in plaintext); the router's control API is off the
public Service; every container runs restricted with a read-only root filesystem; and the
NetworkPolicies admit exactly the callers each port has.
"""

from __future__ import annotations

import json
import os

import pytest
import yaml

from tests.deploy.chart import (ANYONE, KIND_OF, RELEASE, TLS_DIR, VALUE_SETS, admitted, argv,
                                component, container, container_port, containers,
                                effective_security, flag, helm, matches, merged, mount_of,
                                named, needs_helm, objects, of_kind, pod_spec, policy_for,
                                render, secret_volumes, selected_templates, volume, workloads)

pytestmark = needs_helm

FULL = "pdserve"
DNS = "pdserve-test.svc.cluster.local"
KINDS = sorted(KIND_OF.values())
SECURE_SETS = [n for n in sorted(VALUE_SETS) if n != "insecure"]


@pytest.fixture(scope="module", params=sorted(VALUE_SETS))
def rendered(request) -> tuple[str, dict, list[dict]]:
    return request.param, VALUE_SETS[request.param], objects(VALUE_SETS[request.param])


def pdserve_workloads(objs: list[dict]) -> list[dict]:
    """The workloads running pdserve itself (not the chart's Redis)."""
    return [w for w in workloads(objs) if component(w) in KIND_OF]


def cert_manager(values: dict) -> bool:
    return values.get("tls", {}).get("certManager", {}).get("enabled", False)


# ---- internal TLS ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", SECURE_SETS)
def test_every_pod_mounts_only_its_own_kinds_key_read_only_and_gets_tls_dir(name):
    values, objs = VALUE_SETS[name], objects(VALUE_SETS[name])
    seen = set()
    for w in pdserve_workloads(objs):
        kind = KIND_OF[component(w)]
        seen.add(kind)
        tls = volume(w, "tls")
        assert tls is not None, f"{name}: {w['metadata']['name']} has no TLS volume"
        secret = tls["secret"]
        files = {i["path"]: i["key"] for i in secret["items"]}
        # Only its own certificate and key, and the CA's certificate: never the CA's key.
        assert set(files) == {"ca.crt", f"{kind}.crt", f"{kind}.key"}, (name, kind, files)
        if cert_manager(values):
            assert secret["secretName"] == f"{FULL}-{kind}-tls"
            assert files == {"ca.crt": "ca.crt", f"{kind}.crt": "tls.crt",
                             f"{kind}.key": "tls.key"}
        else:
            assert secret["secretName"] == f"{FULL}-tls"
            assert files == {f: f for f in files}
        assert secret["defaultMode"] == 0o440, "keys readable by the pod's group only"
        assert "optional" not in secret, "a missing key must stop the pod, not start it bare"
        assert pod_spec(w)["securityContext"]["fsGroup"] == 10001, "the process's group"
        for c in containers(w):  # the controller's label sync too: it calls the router
            m = mount_of(c, TLS_DIR)
            assert m == {"name": "tls", "mountPath": TLS_DIR, "readOnly": True}, (name, c["name"])
            assert flag(c, "--tls-dir") == TLS_DIR and "--insecure-internal" not in argv(c)
    assert seen == set(KINDS) - ({"controller"} if values.get("staticMode") else set())
    for w in workloads(objs):
        if component(w) not in KIND_OF:  # the chart's Redis holds no certificate
            assert volume(w, "tls") is None
    assert "ca.key" not in json.dumps(objs)


def test_an_operator_made_secret_is_named_by_tls_secret_name():
    objs = objects({"tls": {"secretName": "my-pdserve-certs"}})
    for w in pdserve_workloads(objs):
        assert volume(w, "tls")["secret"]["secretName"] == "my-pdserve-certs"
    assert not [o for o in objs if o["apiVersion"] == "cert-manager.io/v1"]


def test_tls_off_runs_every_process_in_plaintext_by_explicit_flag():
    objs = objects(VALUE_SETS["insecure"])
    for w in pdserve_workloads(objs):
        assert volume(w, "tls") is None
        for c in containers(w):
            assert "--insecure-internal" in argv(c) and "--tls-dir" not in argv(c), c["name"]
    assert not [o for o in objs if o["apiVersion"] == "cert-manager.io/v1"]
    # Ignored when TLS is off: no Certificates without TLS.
    objs = objects(merged(VALUE_SETS["insecure"], VALUE_SETS["cert-manager"]))
    assert not [o for o in objs if o["apiVersion"] == "cert-manager.io/v1"]


def test_cert_manager_issues_one_short_lived_certificate_per_kind_from_the_charts_ca():
    objs = objects(VALUE_SETS["cert-manager"])
    certs = {c["metadata"]["name"]: c["spec"] for c in of_kind(objs, "Certificate")}
    issuers = {i["metadata"]["name"]: i["spec"] for i in of_kind(objs, "Issuer")}
    assert issuers == {f"{FULL}-selfsigned": {"selfSigned": {}},
                       f"{FULL}-ca": {"ca": {"secretName": f"{FULL}-ca"}}}
    ca = certs.pop(f"{FULL}-ca")
    assert ca["isCA"] is True and ca["secretName"] == f"{FULL}-ca"
    assert ca["issuerRef"]["name"] == f"{FULL}-selfsigned"
    assert ca["privateKey"] == {"algorithm": "ECDSA", "size": 256, "rotationPolicy": "Never"}
    assert set(certs) == {f"{FULL}-{k}" for k in KINDS}
    for kind in KINDS:
        spec = certs[f"{FULL}-{kind}"]
        assert spec["secretName"] == f"{FULL}-{kind}-tls"
        assert spec["uris"] == [f"spiffe://pdserve/{kind}/{kind}"]
        assert spec["dnsNames"] == [f"{kind}.pdserve.internal", "pdserve.internal"]
        assert spec["privateKey"]["algorithm"] == "ECDSA" and spec["privateKey"]["size"] == 256
        assert spec["privateKey"]["rotationPolicy"] == "Always"
        assert {"server auth", "client auth"} <= set(spec["usages"])
        assert (spec["duration"], spec["renewBefore"]) == ("24h", "8h")
        assert spec["issuerRef"] == {"name": f"{FULL}-ca", "kind": "Issuer",
                                     "group": "cert-manager.io"}
    # No pod mounts the CA's Secret.
    for w in workloads(objs):
        assert all(v["secret"]["secretName"] != f"{FULL}-ca" for v in secret_volumes(w))


def test_cert_manager_with_an_existing_issuer_makes_no_ca():
    objs = objects(VALUE_SETS["everything"])
    assert not of_kind(objs, "Issuer")
    certs = of_kind(objs, "Certificate")
    assert len(certs) == len(KINDS)
    for c in certs:
        assert c["spec"]["issuerRef"] == {"name": "corp-ca", "kind": "ClusterIssuer",
                                          "group": "cert-manager.io"}


# ---- keys and secrets -------------------------------------------------------------------------


def test_no_key_material_or_key_reaches_values_args_or_env():
    values = VALUE_SETS["everything"]
    text = "\n".join(render(values).values())
    assert "BEGIN" not in text and "PRIVATE KEY" not in text
    objs = objects(values)
    assert not of_kind(objs, "Secret") and not of_kind(objs, "ConfigMap")
    for w in workloads(objs):
        for c in containers(w):
            assert "envFrom" not in c, "keys arrive as files, never as variables"
            for e in c.get("env", []):
                assert "secretKeyRef" not in e.get("valueFrom", {}), (c["name"], e["name"])
        for v in secret_volumes(w):  # every Secret is projected item by item, read-only
            assert v["secret"]["items"] and v["secret"]["defaultMode"] == 0o440
            for c in containers(w):
                for m in c.get("volumeMounts", []):
                    if m["name"] == v["name"]:
                        assert m["readOnly"] is True
    router = named(objs, "Deployment", f"{FULL}-router")
    controller = named(objs, "Deployment", f"{FULL}-controller")
    admin = "/etc/pdserve/admin-keys/admin-keys"
    for w, name in ((router, "router"), (controller, "controller")):
        c = container(w, name)
        assert flag(c, "--admin-keys-file") == admin
        assert mount_of(c, admin)["name"] == "admin-keys"
        assert volume(w, "admin-keys")["secret"] == {
            "secretName": "admins", "defaultMode": 0o440,
            "items": [{"key": "admin-keys", "path": "admin-keys"}]}
    assert mount_of(container(controller, "label-sync"), admin) is None
    for w in workloads(objs):  # admin keys in the router and the controller only
        if w not in (router, controller):
            assert volume(w, "admin-keys") is None and volume(w, "api-keys") is None
    api = container(router, "router")
    assert mount_of(api, flag(api, "--api-keys-file"))["name"] == "api-keys"


@pytest.mark.parametrize("values", [
    {"adminKeys": "k" * 16},
    {"router": {"apiKeys": "k" * 16}},
    {"tls": {"caKey": "x"}},
    {"tls": {"certManager": {"enabled": True, "issuerRef": {"kind": "ClusterIssuer"}}}},
    {"networkPolicy": {"routerClientsFrom": [{"pods": {}}]}},
])
def test_schema_refuses_keys_as_values_and_bad_security_settings(values):
    with pytest.raises(helm.HelmError):
        render(values)


def test_ports_of_one_pod_must_differ():
    with pytest.raises(helm.HelmError) as e:
        render({"router": {"healthPort": 50051}})
    assert "router: its ports must differ" in str(e.value)


# ---- ports: public, control, health -------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_public_service_has_only_client_ports_and_the_cluster_meets_at_the_master(name):
    objs = objects(VALUE_SETS[name])
    router = named(objs, "Deployment", f"{FULL}-router")
    c = container(router, "router")
    public = named(objs, "Service", f"{FULL}-router")
    assert [(p["name"], container_port(router, p["targetPort"]))
            for p in public["spec"]["ports"]] == [("grpc", 50051), ("http", 8000)]
    assert flag(c, "--address") == "0.0.0.0:50051" and flag(c, "--http-port") == "8000"
    control = named(objs, "Service", f"{FULL}-router-control")
    assert control["spec"]["publishNotReadyAddresses"] is True
    assert [(p["port"], container_port(router, p["targetPort"]))
            for p in control["spec"]["ports"]] == [(50053, 50053)]
    assert flag(c, "--control-address") == "0.0.0.0:50053"
    # Each router lists its own pod's control port in the master's membership table; workers
    # join that table (no router registration); the controller finds every router there, and
    # its label sync asks any one router through the control Service.
    assert flag(c, "--advertise-control-address") == "$(POD_IP):50053"
    control_address = f"{FULL}-router-control.{DNS}:50053"
    masters = named(objs, "StatefulSet", f"{FULL}-master")["spec"]["replicas"]
    master_addresses = ",".join(f"{FULL}-master-{i}.{FULL}-master.{DNS}:50070"
                                for i in range(masters))
    assert flag(c, "--store-address") == master_addresses
    for w in workloads(objs):
        if component(w) == "worker":
            worker = container(w, "worker")
            assert "--register-with" not in argv(worker)
            assert flag(worker, "--store-address") == master_addresses
        if component(w) == "controller":
            assert flag(container(w, "controller"), "--store") == master_addresses
            assert "--router" not in argv(container(w, "controller"))
            assert flag(container(w, "label-sync"), "--router") == control_address


@pytest.mark.parametrize("name", ["default", "ha", "static"])
def test_every_process_serves_health_in_plaintext_where_its_probes_look(name):
    objs = objects(VALUE_SETS[name])
    for w in pdserve_workloads(objs):
        c = containers(w)[0]
        health = next(p["containerPort"] for p in c["ports"] if p["name"] == "health")
        assert flag(c, "--health-address") == f"0.0.0.0:{health}"
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[kind]["grpc"]["port"] == health, (c["name"], kind)
        services = [s for s in of_kind(objs, "Service")
                    if matches(s["spec"]["selector"], w["spec"]["template"]["metadata"]["labels"])]
        for s in services:  # health is for the kubelet, not a Service's clients
            assert all(p["targetPort"] != "health" for p in s["spec"]["ports"])
    node = container(named(objs, "StatefulSet", f"{FULL}-node"), "node")
    assert "tcpSocket" not in node["readinessProbe"]
    router = container(named(objs, "Deployment", f"{FULL}-router"), "router")
    assert "service" not in router["readinessProbe"]["grpc"], "ready: the overall status"


def test_public_tls_comes_from_a_tls_secret_and_the_router_is_scraped_over_https():
    objs = objects(VALUE_SETS["everything"])
    router = named(objs, "Deployment", f"{FULL}-router")
    c = container(router, "router")
    paths = {f: flag(c, f) for f in ("--tls-cert", "--tls-key", "--tls-client-ca")}
    items = {i["path"]: i["key"] for i in volume(router, "public-tls")["secret"]["items"]}
    assert volume(router, "public-tls")["secret"]["secretName"] == "public-tls"
    for f, key in (("--tls-cert", "tls.crt"), ("--tls-key", "tls.key"),
                   ("--tls-client-ca", "ca.crt")):
        assert mount_of(c, paths[f])["name"] == "public-tls"
        assert items[os.path.basename(paths[f])] == key
    (sm,) = of_kind(objs, "ServiceMonitor")
    http = next(e for e in sm["spec"]["endpoints"] if e["port"] == "http")
    assert http["scheme"] == "https" and http["tlsConfig"]["ca"]["secret"]["name"] == "public-ca"
    plain = container(named(objects(), "Deployment", f"{FULL}-router"), "router")
    assert "--tls-cert" not in argv(plain) and "--tls-client-ca" not in argv(plain)


# ---- pod security -------------------------------------------------------------------------------


def test_every_container_runs_restricted_with_a_read_only_root(rendered):
    name, values, objs = rendered
    for w in workloads(objs):
        spec = pod_spec(w)
        assert not any(spec.get(k) for k in ("hostNetwork", "hostPID", "hostIPC"))
        for c in containers(w):
            sec = effective_security(w, c)
            where = f"{name}: {w['metadata']['name']}/{c['name']}"
            assert sec.get("runAsNonRoot") is True, where
            assert sec.get("allowPrivilegeEscalation") is False, where
            assert sec.get("readOnlyRootFilesystem") is True, where
            assert sec.get("capabilities") == {"drop": ["ALL"]}, where
            assert sec.get("seccompProfile") == {"type": "RuntimeDefault"}, where
            assert not sec.get("privileged"), where
            for v in spec.get("volumes", []):
                assert "hostPath" not in v, where


def test_every_place_a_process_writes_is_a_writable_empty_dir(rendered):
    name, values, objs = rendered
    for w in workloads(objs):
        empties = {v["name"] for v in pod_spec(w).get("volumes", []) if "emptyDir" in v}
        for c in containers(w):
            env = {e["name"]: e.get("value") for e in c.get("env", [])}
            writes = [f"{d}/x" for d in ("/tmp", env.get("HOME"), env.get("TMPDIR")) if d] \
                if component(w) in KIND_OF else []
            for f, path in (("--journal-dir", flag(c, "--journal-dir")),
                            ("--shm-dir", flag(c, "--shm-dir")),
                            ("--audit-log", flag(c, "--audit-log")),
                            ("--dir", flag(c, "--dir"))):
                if path:
                    writes.append(path if path.endswith("/x") else f"{path}/x")
            if component(w) in KIND_OF:
                assert env.get("HOME") == "/home/pdserve", f"{name}: {c['name']} HOME"
            for path in writes:
                m = mount_of(c, path)
                where = f"{name}: {w['metadata']['name']}/{c['name']} writes {path}"
                assert m is not None and m["name"] in empties, where
                assert not m.get("readOnly"), where
        if component(w) == "redis":
            assert mount_of(container(w, "redis"), "/data/x")["name"] in empties


def test_security_settings_can_still_be_overridden():
    objs = objects({"securityContext": {"readOnlyRootFilesystem": False},
                    "podSecurityContext": {"runAsUser": None, "runAsGroup": None,
                                           "fsGroup": None}})
    w = named(objs, "StatefulSet", f"{FULL}-worker")
    assert container(w, "worker")["securityContext"]["readOnlyRootFilesystem"] is False
    assert container(w, "worker")["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    pod = pod_spec(w)["securityContext"]
    assert pod["runAsNonRoot"] is True and not {"runAsUser", "runAsGroup", "fsGroup"} & set(pod)


# ---- network policies -------------------------------------------------------------------------


# A port its pods declare that nobody in the cluster calls: no rule admits it.
CLOSED = "closed"


def expected_peers(values: dict, objs: list[dict]) -> dict[str, dict[int, object]]:
    """Who must reach each component's ports, and only they (CLOSED: nobody)."""
    controller = {"controller"} if selected_templates(
        objs, {"app.kubernetes.io/component": "controller"}) else set()
    np = values.get("networkPolicy", {})

    def peers(key):
        given = np.get(key, [])
        return {repr(sorted(p.items())) for p in given} if given else ANYONE

    out = {
        "router": {50051: peers("routerClientsFrom"), 8000: peers("routerClientsFrom"),
                   50053: controller or CLOSED, 50054: ANYONE},
        "worker": {50061: {"router"} | controller, 50062: ANYONE, 9090: peers("metricsFrom")},
        "store-master": {50070: {"worker", "store-node", "router"} | controller,
                         50071: ANYONE},
        "store-node": {50090: {"worker", "store-master"}, 50091: ANYONE},
    }
    if controller:
        out["controller"] = {50052: {"release"}, 50057: ANYONE, 9091: peers("metricsFrom")}
    if selected_templates(objs, {"app.kubernetes.io/component": "redis"}):
        out["redis"] = {6379: {"store-master"}}
    return out


@pytest.mark.parametrize("name", [n for n in sorted(VALUE_SETS) if n != "no-network-policy"])
def test_network_policies_deny_by_default_and_admit_exactly_the_callers(name):
    values, objs = VALUE_SETS[name], objects(VALUE_SETS[name])
    policies = of_kind(objs, "NetworkPolicy")
    release = {"app.kubernetes.io/name": "pdserve", "app.kubernetes.io/instance": RELEASE}
    deny = named(objs, "NetworkPolicy", f"{FULL}-default-deny")
    assert deny["spec"] == {"podSelector": {"matchLabels": release}, "policyTypes": ["Ingress"]}
    for p in policies:  # ingress only: egress stays open
        assert p["spec"]["policyTypes"] == ["Ingress"], p["metadata"]["name"]
    want = expected_peers(values, objs)
    assert len(policies) == len(want) + 1
    for comp, ports in want.items():
        policy = policy_for(objs, comp)
        assert policy["spec"]["podSelector"]["matchLabels"] == {
            **release, "app.kubernetes.io/component": comp}
        got = admitted(policy, objs)
        assert got == {p: who for p, who in ports.items() if who is not CLOSED}, \
            f"{name}: {comp}: {got}"
        for rule in policy["spec"]["ingress"]:  # "release": exactly this release's pods
            for peer in rule.get("from", []):
                labels = peer.get("podSelector", {}).get("matchLabels", {})
                if labels and "app.kubernetes.io/component" not in labels:
                    assert labels == release
        # Every port a pod of the component declares is one the policy speaks of.
        for w in selected_templates(objs, policy["spec"]["podSelector"]["matchLabels"]):
            declared = {p["containerPort"] for c in containers(w) for p in c.get("ports", [])}
            assert declared == set(ports), f"{name}: {w['metadata']['name']}"


def test_network_policies_off_render_none():
    assert not of_kind(objects(VALUE_SETS["no-network-policy"]), "NetworkPolicy")


def test_values_yaml_keeps_the_cluster_closed_by_default():
    from tests.deploy.chart import CHART

    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["tls"]["enabled"] is True and values["networkPolicy"]["enabled"] is True
    assert values["securityContext"]["readOnlyRootFilesystem"] is True
