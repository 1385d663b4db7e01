"""TLS on the client ports, as a user asks for it (`--tls-cert/--tls-key`, optionally
`--tls-client-ca`), with a real router process: gRPC and HTTP both speak it, a plaintext client
gets nothing, and with a client CA only clients holding its certificates get in."""

from __future__ import annotations

import json
import ssl
import sys
import urllib.error
import urllib.request

import grpc
import pytest

from pdserve import rpc
from pdserve.core.identity import ROUTER, Identity
from pdserve.proto import api_pb2, api_pb2_grpc
from pdserve.security import pki
from tests.helpers import free_port, start_process, stop_process


def _server_files(tmp_path):
    """A CA of the operator's (not the cluster's) and a certificate for the router's name."""
    import datetime as dt

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    ca_key_pem, ca_pem = pki.make_ca("public test CA")
    ca_key = serialization.load_pem_private_key(ca_key_pem, None)
    ca = x509.load_pem_x509_certificate(ca_pem)
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
            .issuer_name(ca.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=1))
            .not_valid_after(now + dt.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), False)
            .sign(ca_key, hashes.SHA256()))
    files = {"ca.pem": ca_pem, "server.pem": cert.public_bytes(serialization.Encoding.PEM),
             "server.key": key.private_bytes(serialization.Encoding.PEM,
                                             serialization.PrivateFormat.PKCS8,
                                             serialization.NoEncryption())}
    # A client certificate from that CA (for --tls-client-ca).
    ckey, ccert = pki.issue(ca_key_pem, ca_pem, Identity("operator", "client"))
    files.update({"client.key": ckey, "client.pem": ccert})
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    return {k: str(tmp_path / k) for k in files}


def _start(model: str, f: dict, client_ca: bool):
    public, control, http = (f"127.0.0.1:{free_port()}" for _ in range(3))
    args = [sys.executable, "-m", "pdserve.router", "--model", model, "--address", public,
            "--control-address", control, "--http-port", http.rsplit(":", 1)[1],
            "--tls-cert", f["server.pem"], "--tls-key", f["server.key"]]
    if client_ca:
        args += ["--tls-client-ca", f["ca.pem"]]
    return start_process(args, control, timeout_s=60, peer=ROUTER), public, http


def _models(public: str, root: bytes | None, client: tuple[bytes, bytes] | None = None):
    if root is None:
        ch = grpc.insecure_channel(public)
    else:
        creds = grpc.ssl_channel_credentials(root, *(client or (None, None)))
        ch = grpc.secure_channel(public, creds, options=[
            ("grpc.ssl_target_name_override", "localhost")])
    with ch:
        return api_pb2_grpc.GenerationStub(ch).ListModels(api_pb2.ListModelsRequest(),
                                                          timeout=10)


def test_the_client_ports_speak_the_operators_tls(tiny_llama_dir, tmp_path):
    f = _server_files(tmp_path)
    p, public, http = _start(tiny_llama_dir, f, client_ca=False)
    try:
        ca = open(f["ca.pem"], "rb").read()
        assert _models(public, ca).models  # gRPC over TLS
        with pytest.raises(grpc.RpcError) as e:
            _models(public, None)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        ctx = ssl.create_default_context(cafile=f["ca.pem"])
        ctx.check_hostname = False  # the certificate names localhost; we dial 127.0.0.1
        with urllib.request.urlopen(f"https://{http}/v1/models", context=ctx, timeout=10) as r:
            assert json.load(r)["data"]
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            urllib.request.urlopen(f"http://{http}/v1/models", timeout=10)
    finally:
        stop_process(p)


def test_a_client_ca_requires_client_certificates(tiny_llama_dir, tmp_path):
    f = _server_files(tmp_path)
    p, public, http = _start(tiny_llama_dir, f, client_ca=True)
    try:
        ca = open(f["ca.pem"], "rb").read()
        client = (open(f["client.key"], "rb").read(), open(f["client.pem"], "rb").read())
        assert _models(public, ca, client).models
        with pytest.raises(grpc.RpcError):
            _models(public, ca)  # no client certificate
        ctx = ssl.create_default_context(cafile=f["ca.pem"])
        ctx.check_hostname = False
        with pytest.raises((urllib.error.URLError, ConnectionError, ssl.SSLError)):
            urllib.request.urlopen(f"https://{http}/v1/models", context=ctx, timeout=10)
        ctx.load_cert_chain(f["client.pem"], f["client.key"])
        with urllib.request.urlopen(f"https://{http}/v1/models", context=ctx, timeout=10) as r:
            assert json.load(r)["data"]
    finally:
        stop_process(p)


def test_a_missing_certificate_file_is_refused_naming_the_flag(tiny_llama_dir, tmp_path):
    import subprocess

    out = subprocess.run([sys.executable, "-m", "pdserve.router", "--model", tiny_llama_dir,
                          "--tls-cert", str(tmp_path / "nope.pem"),
                          "--tls-key", str(tmp_path / "nope.key")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "tls_cert" in out.stderr


def test_pdserve_generate_trusts_a_given_ca(tiny_llama_dir, tmp_path):
    f = _server_files(tmp_path)
    p, public, _ = _start(tiny_llama_dir, f, client_ca=False)
    try:
        ch = rpc.make_public_channel(public, open(f["ca.pem"], "rb").read(), "localhost")
        with ch:
            assert api_pb2_grpc.GenerationStub(ch).ListModels(api_pb2.ListModelsRequest(),
                                                              timeout=10).models
    finally:
        stop_process(p)
