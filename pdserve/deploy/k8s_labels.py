"""The `pdserve.io/role` label of worker pods on Kubernetes: which role each pod serves now.

Owns the rule (`plan_labels`: the pods' labels and the router's members in, the label changes
out; pure, no I/O) and a thin loop that runs it (`python -m pdserve.deploy.k8s_labels`, a second
container of the controller pod in the Helm chart): it reads the router's membership
(`RouterControl.ListWorkers`) and the pods (the Kubernetes API, with the pod's service
account), and patches the labels that differ. A worker pod's first role comes from its
StatefulSet ordinal (below the chart's `workers.initialRoles.prefill`: prefill), the same rule
the chart's start script applies; afterwards the role the router sees it serve wins, so a
label follows the controller's flips. Must not decide or change roles (the controller and
the workers do): it only records them where selectors, PodDisruptionBudgets and kubectl see
them.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import ssl
import sys
import threading
import urllib.parse
import urllib.request
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from pdserve.core.roles import DECODE, PREFILL, ROLES
from pdserve.lifecycle import StopSignals

ROLE_LABEL = "pdserve.io/role"
_SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"

log = logging.getLogger(__name__)


# ---- the pure rule ------------------------------------------------------------------------

def ordinal(pod_name: str) -> int | None:
    """The StatefulSet ordinal ending `pod_name` (`pdserve-worker-3` -> 3); None if none."""
    tail = pod_name.rpartition("-")[2]
    return int(tail) if tail.isdigit() else None


def initial_role(pod_name: str, initial_prefill: int) -> str | None:
    """The role a pod starts in: prefill below `initial_prefill`, else decode (None: no
    ordinal)."""
    i = ordinal(pod_name)
    if i is None:
        return None
    return PREFILL if i < initial_prefill else DECODE


def pod_of(address: str, worker_service: str) -> str | None:
    """The pod a worker address names: `<pod>.<worker_service>[.<namespace>...]:<port>` (what
    the chart's workers advertise); None for any other address."""
    host = address.rpartition(":")[0]
    parts = host.split(".")
    if len(parts) >= 2 and parts[0] and parts[1] == worker_service:
        return parts[0]
    return None


def roles_by_pod(members: Iterable[tuple[str, str]], worker_service: str) -> dict[str, str]:
    """(address, role) of the router's members -> pod name -> role, for the members that are
    this release's worker pods and report a role."""
    out: dict[str, str] = {}
    for address, role in members:
        pod = pod_of(address, worker_service)
        if pod is not None and role in ROLES:
            out[pod] = role
    return out


@dataclass(frozen=True)
class LabelChange:
    pod: str
    role: str
    reason: str  # for the log: why this value


def plan_labels(pods: Mapping[str, str], served: Mapping[str, str], initial_prefill: int
                ) -> list[LabelChange]:
    """The label changes that make every pod's role label true.

    `pods`: pod name -> its role label now ("" when it has none); `served`: pod name -> the
    role the router sees it serve. A served role wins; a pod the router does not know keeps a
    label it has (it starts in that role after a restart) or gets its initial role.
    """
    changes = []
    for pod in sorted(pods):
        current = pods[pod]
        if pod in served:
            want, why = served[pod], "the role the router sees it serve"
        elif current in ROLES:
            continue
        else:
            want, why = initial_role(pod, initial_prefill), "its initial role (by ordinal)"
            if want is None:
                continue
        if want != current:
            changes.append(LabelChange(pod, want, why))
    return changes


# ---- I/O: the Kubernetes API and the router -----------------------------------------------

class KubePods:
    """The pods of one namespace through the Kubernetes REST API (list, patch a label)."""

    def __init__(self, api_url: str, namespace: str, token_file: str | None,
                 ca_file: str | None, timeout_s: float = 10.0) -> None:
        self.api_url = api_url.rstrip("/")
        self.namespace = namespace
        self.token_file = token_file
        self.timeout_s = timeout_s
        self._ssl = (ssl.create_default_context(cafile=ca_file)
                     if api_url.startswith("https") else None)

    def _call(self, method: str, path: str, body: dict | None = None,
              content_type: str = "application/json") -> dict:
        headers = {"Accept": "application/json"}
        if self.token_file:
            with open(self.token_file) as f:  # read each time: projected tokens rotate
                headers["Authorization"] = f"Bearer {f.read().strip()}"
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = content_type
        req = urllib.request.Request(self.api_url + path, data=data, method=method,
                                     headers=headers)
        with urllib.request.urlopen(req, timeout=self.timeout_s, context=self._ssl) as resp:
            return json.loads(resp.read() or b"{}")

    def role_labels(self, selector: str) -> dict[str, str]:
        """Pod name -> its role label ("" when none), for the pods `selector` matches."""
        query = urllib.parse.urlencode({"labelSelector": selector})
        doc = self._call("GET", f"/api/v1/namespaces/{self.namespace}/pods?{query}")
        return {p["metadata"]["name"]: (p["metadata"].get("labels") or {}).get(ROLE_LABEL, "")
                for p in doc.get("items", [])}

    def set_role(self, pod: str, role: str) -> None:
        self._call("PATCH", f"/api/v1/namespaces/{self.namespace}/pods/{pod}",
                   {"metadata": {"labels": {ROLE_LABEL: role}}},
                   content_type="application/merge-patch+json")


def router_members(router: str, timeout_s: float = 5.0) -> list[tuple[str, str]]:
    """(address, "prefill" | "decode" | "") of every worker the router knows."""
    from pdserve import rpc
    from pdserve.core.identity import ROUTER
    from pdserve.proto import router_pb2, router_pb2_grpc, worker_pb2

    names = {worker_pb2.ROLE_PREFILL: PREFILL, worker_pb2.ROLE_DECODE: DECODE}
    with rpc.make_channel(router, ROUTER) as channel:
        resp = router_pb2_grpc.RouterControlStub(channel).ListWorkers(
            router_pb2.ListWorkersRequest(), timeout=timeout_s)
    return [(w.address, names.get(w.role, "")) for w in resp.workers]


def sync_once(kube: KubePods, selector: str, router: str, worker_service: str,
              initial_prefill: int) -> list[LabelChange]:
    """One round: read, plan, patch; the changes made. A router that does not answer leaves
    labels as they are (unlabelled pods still get their initial role)."""
    import grpc

    pods = kube.role_labels(selector)
    try:
        served = roles_by_pod(router_members(router), worker_service)
    except grpc.RpcError as e:
        log.warning("router %s did not list its workers (%s); keeping the labels", router,
                    e.code().name)
        served = {}
    changes = plan_labels(pods, served, initial_prefill)
    for c in changes:
        kube.set_role(c.pod, c.role)
        log.info("labelled %s %s=%s: %s", c.pod, ROLE_LABEL, c.role, c.reason)
    return changes


def _in_cluster_api() -> str:
    host = os.environ.get("KUBERNETES_SERVICE_HOST", "")
    port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    if not host:
        return ""
    return f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve.deploy.k8s_labels",
                                description=__doc__.splitlines()[0])
    p.add_argument("--router", required=True, help="the router's control address (host:port)")
    p.add_argument("--selector", required=True, help="label selector of the worker pods")
    p.add_argument("--worker-service", required=True,
                   help="the workers' headless Service (their addresses are <pod>.<service>...)")
    p.add_argument("--initial-prefill", type=int, required=True,
                   help="ordinals below this start as prefill workers")
    p.add_argument("--namespace", default=None, help="default: the service account's")
    p.add_argument("--interval-s", type=float, default=5.0)
    p.add_argument("--api-url", default=None, help="default: the in-cluster API server")
    p.add_argument("--token-file", default=os.path.join(_SA_DIR, "token"))
    p.add_argument("--ca-file", default=os.path.join(_SA_DIR, "ca.crt"))
    p.add_argument("--once", action="store_true", help="one round, then exit")
    from pdserve.core.identity import CONTROLLER
    from pdserve.security import cli as security_cli

    security_cli.add_flags(p, health=False)
    a = p.parse_args(argv)
    # It runs beside the controller, with the controller's certificate.
    security_cli.configure(a, CONTROLLER, p)
    if a.initial_prefill < 0 or a.interval_s <= 0:
        p.error("--initial-prefill must be >= 0 and --interval-s > 0")
    api_url = a.api_url or _in_cluster_api()
    if not api_url:
        p.error("--api-url: not given and KUBERNETES_SERVICE_HOST is not set (not in a pod)")
    namespace = a.namespace
    if not namespace:
        try:
            with open(os.path.join(_SA_DIR, "namespace")) as f:
                namespace = f.read().strip()
        except OSError:
            p.error("--namespace: not given and no service account namespace file")
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    kube = KubePods(api_url, namespace, a.token_file if os.path.exists(a.token_file) else None,
                    a.ca_file if os.path.exists(a.ca_file) else None)
    stop = threading.Event()
    StopSignals(stop)
    print(f"pdserve.deploy.k8s_labels ready: pods {a.selector!r} in {namespace}, router "
          f"{a.router}", flush=True)
    last_error = ""
    while True:
        try:
            sync_once(kube, a.selector, a.router, a.worker_service, a.initial_prefill)
            last_error = ""
        except OSError as e:  # the API server: unreachable, or refused (HTTPError is an OSError)
            if str(e) != last_error:  # once per distinct failure, not once per round
                log.warning("Kubernetes API %s: %s", api_url, e)
            last_error = str(e)
        if a.once:
            return 1 if last_error else 0
        if stop.wait(a.interval_s):
            return 0


if __name__ == "__main__":
    sys.exit(main())
