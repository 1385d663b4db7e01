"""The router's control API, attacked from outside with a real router process on loopback.

The public port serves generation and health only: RouterControl is not there. On the
control listener every method is refused without a credential (UNAUTHENTICATED) and with a
tenant's API key (PERMISSION_DENIED), and accepted with an admin key and with a router's or
controller's certificate; a worker's certificate may join but not steer, a certificate from
another CA cannot join, and a worker registered by nobody is never dialled. Refusals are
counted on /metrics and the keys appear in no log line."""

from __future__ import annotations

import os
import socket
import sys
import threading
import urllib.request

import grpc
import pytest

from pdserve import rpc
from pdserve.core.identity import ROUTER, server_name
from pdserve.proto import router_pb2 as rpb
from pdserve.proto import router_pb2_grpc as rpb_grpc
from pdserve.proto import worker_pb2 as wpb
from pdserve.security import pki, tls
from pdserve.security.assertion import Prover
from tests.helpers import free_port, process_output, start_process, stop_process

TENANT_KEY = "tenant-key-0001"
ADMIN_KEY = "admin-key-0001"


def _calls(attacker: str):
    """Each RouterControl method with a request that passes validation."""
    return {
        "ListWorkers": lambda s, md: s.ListWorkers(rpb.ListWorkersRequest(), metadata=md,
                                                   timeout=10),
        "GetSignals": lambda s, md: s.GetSignals(rpb.GetSignalsRequest(), metadata=md,
                                                 timeout=10),
        "RegisterWorker": lambda s, md: s.RegisterWorker(rpb.RegisterWorkerRequest(
            address=attacker, role=wpb.ROLE_DECODE), metadata=md, timeout=10),
        "SetWorkerState": lambda s, md: s.SetWorkerState(rpb.SetWorkerStateRequest(
            address=attacker, state=rpb.MEMBER_STATE_DRAINING, reason="test"), metadata=md,
            timeout=10),
        "SetOffloadBudgets": lambda s, md: s.SetOffloadBudgets(
            rpb.SetOffloadBudgetsRequest(), metadata=md, timeout=10),
    }


class Listener:
    """A TCP port that counts the connections made to it (an attacker's machine)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections = 0
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            conn.close()


@pytest.fixture(scope="module")
def router(tiny_llama_dir, tmp_path_factory, cluster_tls_dir):
    d = tmp_path_factory.mktemp("router-keys")
    (d / "api").write_text(f"{TENANT_KEY} acme\n")
    (d / "admin").write_text(f"{ADMIN_KEY} alice\n")
    public, control, http = (f"127.0.0.1:{free_port()}" for _ in range(3))
    p = start_process([sys.executable, "-m", "pdserve.router", "--model", tiny_llama_dir,
                       "--address", public, "--control-address", control,
                       "--http-port", http.rsplit(":", 1)[1], "--stats-interval-s", "0.2",
                       "--api-keys-file", str(d / "api"), "--admin-keys-file", str(d / "admin")],
                      control, timeout_s=60, peer=ROUTER)
    yield {"public": public, "control": control, "http": http, "proc": p}
    stop_process(p)


def _tls_only(address: str) -> grpc.Channel:
    """TLS that trusts the cluster CA, with no certificate of its own (an outsider)."""
    ca = pki.read(os.path.join(os.environ[tls.TLS_DIR_ENV], pki.CA_CERT))
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(ca), options=[
        ("grpc.ssl_target_name_override", server_name(ROUTER))])


def _as(kind: str, folder: str | None = None) -> tls.MutualTls:
    return tls.MutualTls(tls.TlsFolder(folder or os.environ[tls.TLS_DIR_ENV]), kind)


def _code(fn) -> grpc.StatusCode:
    try:
        fn()
        return grpc.StatusCode.OK
    except grpc.RpcError as e:
        return e.code()


def test_the_public_port_serves_no_control_api(router):
    with rpc.make_channel(router["public"], rpc.PUBLIC) as ch:
        stub = rpb_grpc.RouterControlStub(ch)
        for name, call in _calls("127.0.0.1:1").items():
            assert _code(lambda: call(stub, ())) == grpc.StatusCode.UNIMPLEMENTED, name
        from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

        req = reflection_pb2.ServerReflectionRequest(list_services="")
        (resp,) = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(iter([req]))
        names = {s.name for s in resp.list_services_response.service}
    assert "pdserve.v1.RouterControl" not in names and "pdserve.v1.Generation" in names


def test_every_control_method_needs_an_admin_key_or_a_cluster_identity(router):
    attacker = Listener()
    tenant = (("authorization", f"Bearer {TENANT_KEY}"),)
    admin = (("authorization", f"Bearer {ADMIN_KEY}"),)
    with _tls_only(router["control"]) as outsider:
        stub = rpb_grpc.RouterControlStub(outsider)
        for name, call in _calls(attacker.address).items():
            assert _code(lambda: call(stub, ())) == grpc.StatusCode.UNAUTHENTICATED, name
            assert _code(lambda: call(stub, tenant)) == grpc.StatusCode.PERMISSION_DENIED, name
    with grpc.insecure_channel(router["control"]) as plain:  # no TLS at all: no connection
        stub = rpb_grpc.RouterControlStub(plain)
        assert _code(lambda: stub.ListWorkers(rpb.ListWorkersRequest(), timeout=5)) == \
            grpc.StatusCode.UNAVAILABLE
    with rpc.make_channel(router["control"], ROUTER, security_=_as("worker")) as ch:
        stub = rpb_grpc.RouterControlStub(ch)
        for name in ("ListWorkers", "GetSignals", "SetWorkerState", "SetOffloadBudgets"):
            assert _code(lambda: _calls(attacker.address)[name](stub, ())) == \
                grpc.StatusCode.PERMISSION_DENIED, name
    # Nobody who was refused got the attacker's machine into a pool: never dialled.
    assert attacker.connections == 0
    for who, md in (("router", ()), ("controller", ()), ("operator", admin)):
        security = _as(who) if who != "operator" else None
        with (rpc.make_channel(router["control"], ROUTER, security_=security) if security
              else _tls_only(router["control"])) as ch:
            stub = rpb_grpc.RouterControlStub(ch)
            for name, call in _calls(f"127.0.0.1:{free_port()}").items():
                assert _code(lambda: call(stub, md)) == grpc.StatusCode.OK, (who, name)


def test_a_worker_of_another_cluster_cannot_join(router, tmp_path):
    other = str(tmp_path / "other")
    pki.init_folder(other, "other")
    m = tls.TlsFolder(other).material("worker")
    # It trusts this cluster's CA (it found the router) and proves its own certificate.
    proof = Prover(m.cert_pem, m.key_pem).metadata("pdserve.v1.RouterControl")
    with _tls_only(router["control"]) as ch:
        stub = rpb_grpc.RouterControlStub(ch)
        call = _calls(f"127.0.0.1:{free_port()}")["RegisterWorker"]
        with pytest.raises(grpc.RpcError) as e:
            call(stub, proof)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "not issued by this cluster's CA" in e.value.details()


def test_refusals_are_counted_and_no_key_reaches_the_log(router):
    with _tls_only(router["control"]) as ch:
        _code(lambda: rpb_grpc.RouterControlStub(ch).ListWorkers(
            rpb.ListWorkersRequest(), metadata=(("authorization", "Bearer wrong-key-0001"),),
            timeout=5))
    with urllib.request.urlopen(f"http://{router['http']}/metrics", timeout=10) as r:
        text = r.read().decode()
    lines = [x for x in text.splitlines() if x.startswith("pdserve:auth_failures_total{")]
    counted = {(x.split('service="')[1].split('"')[0], x.split('reason="')[1].split('"')[0]):
               float(x.rsplit(" ", 1)[1]) for x in lines}
    assert counted[("pdserve.v1.RouterControl", "unknown_key")] >= 1
    assert counted[("pdserve.v1.RouterControl", "no_credential")] >= 1
    assert counted[("pdserve.v1.RouterControl", "tenant_key")] >= 1
    out, err = process_output(router["proc"])
    for secret in (TENANT_KEY, ADMIN_KEY, "wrong-key-0001", "PRIVATE KEY"):
        assert secret not in out + err + text
    assert "by key:alice" in out + err  # the admin's state change, audited by key name
