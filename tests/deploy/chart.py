"""The pdserve Helm chart rendered by the real Helm engine (helm-python-sdk, no helm binary and
no cluster), and the rendered objects indexed the way Kubernetes relates them.

Owns rendering a value set, reading the ci/ value files, and the relations the checks need:
which pod templates a selector matches, which container ports a Service reaches. Must not
start processes (pods.py does).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml

from tests.helpers import REPO_ROOT

CHART = REPO_ROOT / "deploy" / "helm" / "pdserve"
RELEASE = "pdserve"
NAMESPACE = "pdserve-test"
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "DaemonSet")

try:  # the SDK is a ctypes binding over a shared library built for some platforms only
    import helm_python as helm
    HELM_PROBLEM = ""
except (ImportError, OSError) as e:  # pragma: no cover - depends on the platform
    helm = None
    HELM_PROBLEM = f"the Helm SDK (helm-python-sdk) cannot load here: {e}"

needs_helm = pytest.mark.skipif(helm is None, reason=HELM_PROBLEM or "helm SDK loads")


def ci_values(name: str) -> dict:
    """The value set ci/<name>-values.yaml."""
    return yaml.safe_load((CHART / "ci" / f"{name}-values.yaml").read_text()) or {}


def merged(*value_sets: dict) -> dict:
    """Value sets merged left to right (maps merged key by key, anything else replaced)."""
    out: dict = {}
    for values in value_sets:
        out = _merge(out, values)
    return out


def _merge(a: dict, b: dict) -> dict:
    out = copy.deepcopy(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) \
            else copy.deepcopy(v)
    return out


# The value sets every check renders: the ci/ examples, and each security mode.
VALUE_SETS = {
    "default": {},
    "gpu": ci_values("gpu"),
    "ha": ci_values("ha"),
    "static": ci_values("static"),
    "cert-manager": {"tls": {"certManager": {"enabled": True}}},
    "insecure": {"tls": {"enabled": False}},
    "no-network-policy": {"networkPolicy": {"enabled": False}},
    # Several routers, scaled by a HorizontalPodAutoscaler (requests in flight and CPU).
    "autoscaled-routers": {"router": {"replicas": 3, "autoscaling": {
        "enabled": True, "targetCPUUtilizationPercentage": 80}}},
    "everything": merged(ci_values("ha"), {
        "metrics": {"serviceMonitor": {"enabled": True, "routerTlsConfig": {
            "ca": {"secret": {"name": "public-ca", "key": "ca.crt"}}}}},
        "router": {"apiKeysSecret": "keys", "maxPredictedTtftSeconds": 5,
                   "publicTls": {"secretName": "public-tls", "clientCaKey": "ca.crt"}},
        "adminKeysSecret": "admins",
        "tls": {"certManager": {"enabled": True, "issuerRef": {
            "name": "corp-ca", "kind": "ClusterIssuer"}}},
        "networkPolicy": {
            "routerClientsFrom": [{"namespaceSelector": {"matchLabels": {"team": "apps"}}}],
            "metricsFrom": [{"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}]},
        "model": {"path": "/models/m.gguf", "volume": {"persistentVolumeClaim":
                                                         {"claimName": "models"}}}}),
}


def render(values: dict | None = None) -> dict[str, str]:
    """Template path -> rendered text, as `helm template` would write it (schema checked)."""
    with helm.Chart.load(str(CHART)) as chart:
        return chart.render(values=values or {}, name=RELEASE, namespace=NAMESPACE,
                            is_install=True)


def objects(values: dict | None = None) -> list[dict]:
    """Every rendered Kubernetes object (NOTES.txt and empty documents left out)."""
    out = []
    for path, text in sorted(render(values).items()):
        if path.endswith("NOTES.txt"):
            continue
        out += [d for d in yaml.safe_load_all(text) if d]
    return out


def of_kind(objs: list[dict], kind: str) -> list[dict]:
    return [o for o in objs if o["kind"] == kind]


def named(objs: list[dict], kind: str, name: str) -> dict:
    found = [o for o in of_kind(objs, kind) if o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def workloads(objs: list[dict]) -> list[dict]:
    return [o for o in objs if o["kind"] in WORKLOAD_KINDS]


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def selected_templates(objs: list[dict], selector: dict[str, str]) -> list[dict]:
    """The workloads whose pod template carries every label of `selector`."""
    return [w for w in workloads(objs)
            if matches(selector, w["spec"]["template"]["metadata"].get("labels", {}))]


def containers(workload: dict) -> list[dict]:
    return workload["spec"]["template"]["spec"]["containers"]


def container(workload: dict, name: str) -> dict:
    found = [c for c in containers(workload) if c["name"] == name]
    assert found, f"{workload['metadata']['name']} has no container {name}"
    return found[0]


def container_port(workload: dict, target: Any) -> int | None:
    """The containerPort a Service's targetPort (a name or a number) reaches in `workload`'s
    pods, or None when no container declares it."""
    for c in containers(workload):
        for p in c.get("ports", []):
            if target in (p.get("name"), p["containerPort"]):
                return p["containerPort"]
    return None


def argv(c: dict) -> list[str]:
    """A container's command line as Kubernetes builds it: command, then args."""
    return [str(a) for a in c.get("command", []) + c.get("args", [])]


def flag(c: dict, name: str) -> str | None:
    """The value after `name` in a container's command line (None when absent)."""
    words = argv(c)
    return words[words.index(name) + 1] if name in words else None


# ---- security: what each pod mounts, how it runs, who may reach it ------------------------------

# The certificate kind each component's pods present (pdserve.core.identity's kinds).
KIND_OF = {"router": "router", "worker": "worker", "store-node": "node",
           "store-master": "master", "controller": "controller"}
TLS_DIR = "/etc/pdserve/tls"  # where every pod mounts its kind's files (--tls-dir)


def component(workload: dict) -> str:
    return workload["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def volume(workload: dict, name: str) -> dict | None:
    return next((v for v in pod_spec(workload).get("volumes", []) if v["name"] == name), None)


def mount_of(c: dict, path: str) -> dict | None:
    """The volume mount of container `c` that holds `path` (the longest mount path above it)."""
    found = [m for m in c.get("volumeMounts", [])
             if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")]
    return max(found, key=lambda m: len(m["mountPath"])) if found else None


def effective_security(workload: dict, c: dict) -> dict:
    """A container's security settings as the kubelet applies them: the container's
    securityContext over the pod's (for the fields both may set)."""
    pod = pod_spec(workload).get("securityContext", {})
    own = c.get("securityContext", {})
    shared = ("runAsNonRoot", "runAsUser", "runAsGroup", "seccompProfile", "seLinuxOptions")
    return {**{k: pod[k] for k in shared if k in pod}, **own}


def secret_volumes(workload: dict) -> list[dict]:
    return [v for v in pod_spec(workload).get("volumes", []) if "secret" in v]


def policy_for(objs: list[dict], comp: str) -> dict:
    """The NetworkPolicy that selects exactly `comp`'s pods (by the component label)."""
    found = [p for p in of_kind(objs, "NetworkPolicy")
             if p["spec"]["podSelector"].get("matchLabels", {})
             .get("app.kubernetes.io/component") == comp]
    assert len(found) == 1, f"expected one NetworkPolicy for {comp}, found {len(found)}"
    return found[0]


ANYONE = "anyone"


def admitted(policy: dict, objs: list[dict]) -> dict[int, object]:
    """Port -> who a policy admits there: ANYONE (a rule with no `from`), or the set of peers,
    each a component of this release (by its pods' component label), "release" (every pod
    of the release), or the peer itself as a frozen repr (a namespace or IP block)."""
    out: dict[int, object] = {}
    for rule in policy["spec"].get("ingress", []):
        peers = rule.get("from")
        for port in rule["ports"]:
            assert port.get("protocol", "TCP") == "TCP"
            if not peers:
                out[port["port"]] = ANYONE
                continue
            have = out.setdefault(port["port"], set())
            assert have is not ANYONE, f"port {port['port']} is already open to anyone"
            for peer in peers:
                labels = peer.get("podSelector", {}).get("matchLabels")
                if set(peer) == {"podSelector"} and labels is not None:
                    if "app.kubernetes.io/component" in labels:
                        assert selected_templates(objs, labels), f"no pods match {labels}"
                        have.add(labels["app.kubernetes.io/component"])
                    else:
                        have.add("release")
                else:
                    have.add(repr(sorted(peer.items())))
    return out
