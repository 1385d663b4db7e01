"""The worker pods' role label: the pure rule, and the Kubernetes API calls against a stand-in
API server on loopback (no cluster here)."""

from __future__ import annotations

from pdserve.deploy import k8s_labels as kl
from tests.deploy.pods import FakeKubeApi
from tests.helpers import free_port

SVC = "pdserve-worker"


def addr(pod: str) -> str:
    return f"{pod}.{SVC}.ns.svc.cluster.local:50061"


def test_initial_role_is_prefill_below_the_count():
    assert [kl.initial_role(f"pdserve-worker-{i}", 2) for i in range(4)] == \
        ["prefill", "prefill", "decode", "decode"]
    assert kl.initial_role("pdserve-worker-0", 0) == "decode"
    assert kl.initial_role("no-ordinal-here", 1) is None


def test_pod_of_reads_only_this_services_addresses():
    assert kl.pod_of(addr("pdserve-worker-3"), SVC) == "pdserve-worker-3"
    assert kl.pod_of("pdserve-worker-3.other.ns.svc:50061", SVC) is None
    assert kl.pod_of("127.0.0.1:50061", SVC) is None
    assert kl.roles_by_pod([(addr("w-0"), "prefill"), (addr("w-1"), ""), ("10.0.0.1:1", "decode")],
                           SVC) == {"w-0": "prefill"}


def test_plan_labels_follows_the_served_role_then_the_label_then_the_ordinal():
    pods = {"w-0": "", "w-1": "", "w-2": "prefill", "w-3": "decode", "w-4": "bogus"}
    served = {"w-1": "prefill", "w-3": "decode"}
    changes = {c.pod: c.role for c in kl.plan_labels(pods, served, initial_prefill=1)}
    # w-0: no label, unknown to the router: its ordinal's role. w-1: the router sees it
    # prefill (a flip). w-2: a label kept while the router does not know it (restarting).
    # w-3: already right. w-4: a bad label is replaced by the ordinal's role.
    assert changes == {"w-0": "prefill", "w-1": "prefill", "w-4": "decode"}
    assert kl.plan_labels({"w-0": "prefill"}, {"w-0": "decode"}, 1)[0].role == "decode"
    assert kl.plan_labels({"w-0": "prefill"}, {"w-0": "prefill"}, 1) == []


def test_kube_pods_lists_by_selector_and_merge_patches_the_label():
    api = FakeKubeApi("ns", {
        "w-0": {"app.kubernetes.io/component": "worker", "app.kubernetes.io/instance": "r"},
        "w-1": {"app.kubernetes.io/component": "worker", "app.kubernetes.io/instance": "r",
                kl.ROLE_LABEL: "decode"},
        "router-x": {"app.kubernetes.io/component": "router", "app.kubernetes.io/instance": "r"},
    })
    try:
        kube = kl.KubePods(api.url, "ns", token_file=None, ca_file=None)
        selector = "app.kubernetes.io/instance=r,app.kubernetes.io/component=worker"
        assert kube.role_labels(selector) == {"w-0": "", "w-1": "decode"}
        # No router answers here: labels are kept, the unlabelled pod gets its ordinal's role.
        router = f"127.0.0.1:{free_port()}"
        changes = kl.sync_once(kube, selector, router, SVC, initial_prefill=1)
        assert [(c.pod, c.role) for c in changes] == [("w-0", "prefill")]
        assert api.pods["w-0"][kl.ROLE_LABEL] == "prefill"
        assert api.pods["w-0"]["app.kubernetes.io/component"] == "worker", "a merge, not a put"
        assert kl.sync_once(kube, selector, router, SVC, initial_prefill=1) == []
        assert len(api.patches) == 1
    finally:
        api.close()


def test_main_once_says_when_the_api_server_fails(capsys):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens
    code = kl.main(["--router", "127.0.0.1:1", "--selector", "a=b", "--worker-service", SVC,
                    "--initial-prefill", "1", "--namespace", "ns", "--api-url", url, "--once"])
    assert code == 1
