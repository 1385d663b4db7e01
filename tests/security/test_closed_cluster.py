"""A whole embedded cluster, closed: real processes on loopback with the cluster's mutual TLS.

A plaintext client opens no internal port (store master, workers, the router's control
listener, the controller, the storage node's data plane); a client with a certificate of
another CA, or with none, is refused by the store's data plane before it can read a block; a
worker's certificate is refused by the controller's admin API while an operator's and an admin
key are let in, each action audited with who did it; refusals are counted on /metrics; no key
or certificate key reaches a log. And the embedded default is closed by itself: `pdserve serve`
with no TLS setting makes its own CA and certificates and still answers, and `pdserve ctl`
finds it with no flags."""

from __future__ import annotations

import json
import os
import re
import socket
import ssl
import stat
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve import rpc
from pdserve.controller.audit import read_records
from pdserve.launcher.local import LocalCluster
from pdserve.kvstore.node.protocol import REPLY, Status
from pdserve.core.identity import CONTROLLER, ROUTER, WORKER, server_name
from pdserve.proto import api_pb2, api_pb2_grpc, common_pb2
from pdserve.proto import controller_pb2 as cpb
from pdserve.proto import controller_pb2_grpc as cpb_grpc
from pdserve.security import pki, tls
from tests.e2e.conftest import cluster_spec
from tests.helpers import REPO_ROOT

ADMIN_KEY = "admin-key-cluster-1"
TENANT_KEY = "tenant-key-cluster-1"


@pytest.fixture(scope="module")
def closed(tiny_llama_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("keys")
    (d / "admin").write_text(f"{ADMIN_KEY} alice\n")
    (d / "api").write_text(f"{TENANT_KEY} acme\n")
    spec = cluster_spec(tiny_llama_dir, controller=True, controller_mode="advisory",
                        api_keys_file=str(d / "api"),
                        controller_settings={"admin_keys_file": str(d / "admin"),
                                             "api_keys_file": str(d / "api")})
    with LocalCluster(spec) as cluster:
        yield cluster


def _node_data_address(cluster: LocalCluster) -> str:
    node = next(c for c in cluster.children if c.kind == "node")
    with open(node.log_path) as f:
        for line in f:
            if line.startswith("{") and '"event": "ready"' in line:
                return json.loads(line)["data_address"]
    raise AssertionError("the storage node printed no ready line")


def _internal(cluster: LocalCluster) -> list[tuple[str, str]]:
    out = [(cluster.store_address, "master"), (cluster.router_control_address, ROUTER),
           (cluster.controller_address, CONTROLLER)]
    out += [(a, WORKER) for a in cluster.worker_addresses("prefill")
            + cluster.worker_addresses("decode")]
    return out


def test_the_cluster_runs_with_mutual_tls(closed):
    assert not closed.security.insecure
    for c in closed.children:
        assert c.proc.args[-2:] == ["--tls-dir", closed.security.folder.path], c.name


def test_a_plaintext_client_opens_no_internal_port(closed):
    for address, kind in _internal(closed):
        with grpc.insecure_channel(address) as ch:
            with pytest.raises(grpc.RpcError) as e:
                health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE, (kind, address)
        # ... while the cluster's own certificate gets an answer there.
        rpc.wait_healthy(address, timeout_s=10, peer=kind)
    host, port = _node_data_address(closed).rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"\x00" * 64)  # a plaintext request header: never read as one
        s.settimeout(10)
        try:
            reply = s.recv(4096)
        except ConnectionResetError:
            reply = b""
    assert not reply.startswith(b"\x00"), "the data plane answered a plaintext client"


def _tls_client(ca_pem: bytes, cert_dir: str | None, kind: str | None):
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(cadata=ca_pem.decode())
    if cert_dir:
        ctx.load_cert_chain(os.path.join(cert_dir, f"{kind}.crt"),
                            os.path.join(cert_dir, f"{kind}.key"))
    return ctx


def _handshake_and_read(address: str, ctx: ssl.SSLContext) -> bytes:
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as raw:
        with ctx.wrap_socket(raw, server_hostname=server_name("node")) as s:
            s.settimeout(10)
            s.sendall(b"\x00" * 64)
            return s.recv(4096)


def test_the_data_plane_serves_no_block_without_a_cluster_certificate(closed, tmp_path):
    address = _node_data_address(closed)
    ca = pki.read(os.path.join(closed.security.folder.path, pki.CA_CERT))
    other = str(tmp_path / "other")
    pki.init_folder(other, "other")
    for cert_dir in (None, other):  # no certificate; a worker certificate of another CA
        with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
            got = _handshake_and_read(address, _tls_client(ca, cert_dir, "worker"))
            assert not got, "the data plane answered"
            raise ConnectionError("closed without an answer")
    # A router's certificate is the cluster's, but a router reads no KV: told DENIED, before
    # its request is read.
    got = _handshake_and_read(address, _tls_client(ca, closed.security.folder.path, "router"))
    status, n = REPLY.unpack_from(got)
    assert Status(status) == Status.DENIED
    assert b"a router may not" in got[REPLY.size:REPLY.size + n]


def test_a_worker_identity_cannot_steer_the_controller(closed):
    as_worker = tls.MutualTls(tls.TlsFolder(closed.security.folder.path), WORKER)
    with rpc.make_channel(closed.controller_address, CONTROLLER, security_=as_worker) as ch:
        with pytest.raises(grpc.RpcError) as e:
            cpb_grpc.ControllerStub(ch).SetMode(cpb.SetModeRequest(
                mode=cpb.CONTROLLER_MODE_OFF), timeout=10)
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    tenant = (("authorization", f"Bearer {TENANT_KEY}"),)
    ca = pki.read(os.path.join(closed.security.folder.path, pki.CA_CERT))
    keyed = grpc.secure_channel(closed.controller_address, grpc.ssl_channel_credentials(ca),
                                options=[("grpc.ssl_target_name_override",
                                          server_name(CONTROLLER))])
    with keyed:
        stub = cpb_grpc.ControllerStub(keyed)
        with pytest.raises(grpc.RpcError) as e:
            stub.Status(cpb.ControllerStatusRequest(), timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as e:
            stub.Status(cpb.ControllerStatusRequest(), timeout=10, metadata=tenant)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        stub.SetMode(cpb.SetModeRequest(mode=cpb.CONTROLLER_MODE_OFF), timeout=10,
                     metadata=(("authorization", f"Bearer {ADMIN_KEY}"),))
    with rpc.make_channel(closed.controller_address, CONTROLLER) as ch:  # the operator's
        cpb_grpc.ControllerStub(ch).SetMode(cpb.SetModeRequest(
            mode=cpb.CONTROLLER_MODE_ADVISORY), timeout=10)
    modes = [r for r in read_records(closed.audit_log) if r.get("event") == "mode"]
    assert [(r["to"], r["by"]) for r in modes[-2:]] == [("off", "key:alice"),
                                                        ("advisory", "cert:operator/operator")]
    with urllib.request.urlopen(closed.controller_metrics, timeout=10) as r:
        text = r.read().decode()
    assert re.search(r'pdserve:auth_failures_total\{reason="kind_not_allowed",'
                     r'service="pdserve.v1.Controller"\} [1-9]', text), text[-2000:]


def test_requests_are_served_and_no_secret_reaches_a_log(closed):
    req = api_pb2.GenerateRequest(prompt="hello there", sampling=common_pb2.SamplingParams(
        max_tokens=4, temperature=0))
    with rpc.make_channel(closed.router_address, rpc.PUBLIC) as ch:
        stub = api_pb2_grpc.GenerationStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(req, timeout=60))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        out = list(stub.Generate(req, timeout=120,
                                 metadata=(("authorization", f"Bearer {TENANT_KEY}"),)))
    assert sum(len(r.token_ids) for r in out) == 4
    keys = [pki.read(os.path.join(closed.security.folder.path, f)).decode()
            for f in os.listdir(closed.security.folder.path) if f.endswith(".key")]
    for name in os.listdir(closed.log_dir):
        path = os.path.join(closed.log_dir, name)
        if not os.path.isfile(path):
            continue
        with open(path, errors="replace") as f:
            text = f.read()
        for secret in (ADMIN_KEY, TENANT_KEY, "PRIVATE KEY", *(k.splitlines()[1] for k in keys)):
            assert secret not in text, f"{secret[:12]}... in {name}"


def test_the_embedded_default_is_closed_and_still_one_command(tiny_llama_dir, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in (tls.TLS_DIR_ENV, tls.INSECURE_ENV)}
    env["PDSERVE_STATE_DIR"] = str(tmp_path / "state")
    env["PYTHONPATH"] = str(REPO_ROOT)
    from tests.helpers import free_port

    port, http = free_port(), free_port()
    p = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "serve", "--model", tiny_llama_dir,
                          "--port", str(port), "--http-port", str(http), "--num-blocks", "128",
                          "--log-dir", str(tmp_path / "logs")], cwd=REPO_ROOT, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        deadline = time.monotonic() + 240
        ready = ""
        while time.monotonic() < deadline and p.poll() is None:
            line = p.stdout.readline()
            if line.startswith("pdserve ready on"):
                ready = line
                break
        assert ready, "pdserve serve did not get ready"
        folder = str(tmp_path / "logs" / "tls")
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
        assert all(stat.S_IMODE(os.stat(os.path.join(folder, f)).st_mode) == 0o600
                   for f in os.listdir(folder) if f.endswith(".key"))
        body = json.dumps({"prompt": "hi", "max_tokens": 3, "temperature": 0}).encode()
        with urllib.request.urlopen(urllib.request.Request(
                f"http://127.0.0.1:{http}/v1/completions", body,
                {"content-type": "application/json"}), timeout=120) as r:
            assert json.load(r)["usage"]["completion_tokens"] == 3
        out = subprocess.run([sys.executable, "-m", "pdserve.cli", "ctl", "--json", "status"],
                             cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert len(json.loads(out.stdout)["workers"]) == 2
        # Without the cluster's credentials the controller answers nobody.
        controller = re.search(r" controller=(\S+)", ready).group(1)
        out = subprocess.run([sys.executable, "-m", "pdserve.cli", "ctl", "--json", "--ca-cert",
                              os.path.join(folder, pki.CA_CERT), "--address", controller,
                              "status"], cwd=REPO_ROOT,
                             env={**env, "PDSERVE_STATE_DIR": str(tmp_path / "elsewhere")},
                             capture_output=True, text=True, timeout=60)
        assert out.returncode != 0
        assert json.loads(out.stdout)["error"]["code"] == "UNAUTHENTICATED"
    finally:
        p.terminate()
        p.wait(timeout=120)
    assert not os.path.exists(os.path.join(str(tmp_path / "state"), "current.json"))
