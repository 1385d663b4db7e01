"""`pdserve ctl` as an operator runs it: a subprocess against a live controller and cluster.

Status, a dry-run plan, a rebalance carried out, a pin the controller honours, a tenant key
refused, and one clear line (never a traceback) for an unknown worker or an unreachable
controller.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pdserve.proto import worker_pb2 as wpb
from pdserve.security import pki, tls
from tests.e2e.test_controller import restore_two_two, roles, start_controller
from tests.helpers import REPO_ROOT, free_port, stop_process

ADMIN, TENANT = "admin-key-0123456789", "tenant-key-0123456789"


def key_only() -> tuple[dict[str, str], list[str]]:
    """The environment and flags of `pdserve ctl` run by an operator with no certificate of
    their own, so that only a key (or none) speaks for them: it trusts the cluster CA (or
    speaks plaintext where the suite runs without internal TLS)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PDSERVE_ADMIN_KEY", tls.TLS_DIR_ENV)}
    folder = os.environ.get(tls.TLS_DIR_ENV)
    return env, (["--ca-cert", os.path.join(folder, pki.CA_CERT)] if folder
                 else ["--insecure-internal"])


def ctl(address: str, *args: str, key: str | None = ADMIN, as_json: bool = True):
    """`pdserve ctl` as an operator with an admin key (`key`, or none) and no certificate."""
    env, flags = key_only()
    if key:
        env["PDSERVE_ADMIN_KEY"] = key
    cmd = [sys.executable, "-m", "pdserve.cli", "ctl", "--address", address, *flags,
           *(["--json"] if as_json else []), *args]
    p = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert "Traceback" not in p.stdout + p.stderr, p.stdout + p.stderr
    return p.returncode, p.stdout, p.stderr


@pytest.fixture
def controller(tiny_2p2d_cluster, tmp_path):
    (tmp_path / "admin").write_text(f"{ADMIN} ops\n")
    (tmp_path / "tenants").write_text(f"{TENANT} acme\n")
    proc, address, audit = start_controller(
        tiny_2p2d_cluster, tmp_path, "--mode", "advisory", "--admin-keys-file",
        str(tmp_path / "admin"), "--api-keys-file", str(tmp_path / "tenants"))
    start = {r: tiny_2p2d_cluster.worker_addresses(r) for r in ("prefill", "decode")}
    yield address
    assert stop_process(proc, timeout_s=15) == 0
    restore_two_two(tiny_2p2d_cluster, start)


def test_ctl_status_plan_rebalance_pin_and_keys(tiny_2p2d_cluster, controller):
    cluster = tiny_2p2d_cluster
    prefill, decode = cluster.worker_addresses("prefill"), cluster.worker_addresses("decode")
    rc, out, _ = ctl(controller, "status")
    assert rc == 0
    status = json.loads(out)
    assert status["mode"] == "CONTROLLER_MODE_ADVISORY"
    assert sorted(w["address"] for w in status["workers"]) == sorted(prefill + decode)
    assert {w["state"] for w in status["workers"]} == {"serving"}
    assert "prefill_pressure" in status and status["has_target"] is False
    # The table a person reads names every worker and the pressures.
    rc, out, _ = ctl(controller, "status", as_json=False)
    assert rc == 0 and all(a in out for a in prefill + decode) and "pressure" in out

    # Keys: a tenant's key is refused with PERMISSION_DENIED, no key with UNAUTHENTICATED.
    rc, out, _ = ctl(controller, "status", key=TENANT)
    assert rc == 1 and json.loads(out)["error"]["code"] == "PERMISSION_DENIED"
    rc, out, _ = ctl(controller, "status", key=None)
    assert rc == 1 and json.loads(out)["error"]["code"] == "UNAUTHENTICATED"

    # A dry run plans one decode -> prefill flip and changes nothing.
    rc, out, _ = ctl(controller, "rebalance", "--prefill", "3", "--decode", "1", "--dry-run")
    assert rc == 0
    plan = json.loads(out)["plan"]
    assert len(plan) == 1 and plan[0]["from_role"] == "ROLE_DECODE"
    assert plan[0]["address"] in decode
    assert sorted(roles(cluster).values()).count(wpb.ROLE_PREFILL) == 2

    # A pinned worker is never in a plan; a split that needs it is refused, naming it.
    pinned = plan[0]["address"]
    assert ctl(controller, "pin", pinned)[0] == 0
    rc, out, _ = ctl(controller, "rebalance", "--prefill", "3", "--decode", "1", "--dry-run")
    assert rc == 0
    plan = json.loads(out)["plan"]
    assert len(plan) == 1 and plan[0]["address"] != pinned and plan[0]["address"] in decode
    rc, out, _ = ctl(controller, "rebalance", "--prefill", "4", "--decode", "0", "--dry-run")
    assert rc == 1 and pinned in json.loads(out)["error"]["message"]

    # The rebalance itself: the unpinned decode worker becomes a prefill worker.
    rc, out, _ = ctl(controller, "rebalance", "--prefill", "3", "--decode", "1")
    assert rc == 0, out
    results = json.loads(out)["results"]
    assert len(results) == 1 and results[0]["ok"] and results[0]["address"] != pinned
    assert roles(cluster)[results[0]["address"]] == wpb.ROLE_PREFILL
    status = json.loads(ctl(controller, "status")[1])
    assert status["has_target"] and status["target_prefill"] == 3
    assert [w["pinned"] for w in status["workers"] if w["address"] == pinned] == [True]

    # An unknown worker is one clear line, not a traceback.
    rc, out, err = ctl(controller, "set-role", "127.0.0.1:1", "decode", as_json=False)
    assert rc == 1 and "unknown worker" in err and "127.0.0.1:1" in err
    rc, out, _ = ctl(controller, "mode", "off")
    assert rc == 0 and json.loads(out)["mode"] == "CONTROLLER_MODE_OFF"
    rc, out, _ = ctl(controller, "release")
    assert rc == 0 and json.loads(out)["had_target"] is True


def test_ctl_says_clearly_when_no_controller_answers():
    address = f"127.0.0.1:{free_port()}"
    rc, out, err = ctl(address, "status", as_json=False)
    assert rc == 2 and "cannot reach the controller" in err and address in err
