"""The cluster's certificates and identity proofs, on real keys and certificates: what a folder
holds and with which modes, who a certificate names, renewal, and proofs that verify only for
their own CA, audience, time and signature."""

from __future__ import annotations

import datetime as dt
import os
import stat

import pytest

from pdserve.core.identity import KINDS, Identity, parse_uri, server_name
from pdserve.security import pki, tls
from pdserve.security.assertion import Prover, ProofError, Verifier


@pytest.fixture
def folder(tmp_path):
    path = str(tmp_path / "tls")
    pki.init_folder(path, "c1")
    return path


def test_a_folder_holds_a_ca_and_one_certificate_per_kind_with_private_modes(folder):
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    for kind in KINDS:
        cert = pki.read(os.path.join(folder, pki.cert_file(kind)))
        assert pki.info(cert).identity == Identity(kind, kind)
        assert stat.S_IMODE(os.stat(os.path.join(folder, pki.key_file(kind))).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.join(folder, pki.CA_KEY)).st_mode) == 0o600


def test_a_certificate_names_its_kind_for_servers_and_its_identity_for_callers(folder):
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(pki.read(os.path.join(folder, "worker.crt")))
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert server_name("worker") in san.get_values_for_type(x509.DNSName)
    assert server_name("master") not in san.get_values_for_type(x509.DNSName)
    assert [parse_uri(u) for u in san.get_values_for_type(x509.UniformResourceIdentifier)] == \
        [Identity("worker", "worker")]
    life = cert.not_valid_after_utc - cert.not_valid_before_utc
    assert life <= dt.timedelta(seconds=pki.LEAF_LIFETIME_S) + dt.timedelta(minutes=6)


def test_identities_refuse_unknown_kinds_and_bad_names():
    with pytest.raises(ValueError, match="kind"):
        Identity("admin", "x")
    with pytest.raises(ValueError, match="name"):
        Identity("worker", "a/b")
    assert parse_uri("spiffe://other/worker/w") is None
    assert parse_uri("spiffe://pdserve/worker/w") == Identity("worker", "w")


def test_renewal_reissues_only_what_is_due_and_keeps_the_identity(folder):
    pki.issue_into(folder, Identity("operator", "alice"))
    before = {k: pki.info(pki.read(os.path.join(folder, pki.cert_file(k)))).serial for k in KINDS}
    assert pki.renew_folder(folder) == []  # fresh: nothing due
    later = dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=17)  # past 2/3 of a day
    assert sorted(pki.renew_folder(folder, now=later)) == sorted(KINDS)
    for kind in KINDS:
        i = pki.info(pki.read(os.path.join(folder, pki.cert_file(kind))))
        assert i.serial != before[kind]
        assert i.identity == Identity(kind, "alice" if kind == "operator" else kind)


def test_a_folder_mid_rotation_keeps_the_last_good_pair(folder, tmp_path):
    f = tls.TlsFolder(folder, check_interval_s=0.0)
    first = f.material("worker")
    other = str(tmp_path / "other")
    pki.init_folder(other, "c2")
    # Only the certificate replaced: it does not match the key on disk.
    pki.write_atomic(os.path.join(folder, "worker.crt"), pki.read(os.path.join(other,
                                                                               "worker.crt")), 0o644)
    assert f.material("worker") == first
    pki.write_atomic(os.path.join(folder, "worker.key"), pki.read(os.path.join(other,
                                                                               "worker.key")), 0o600)
    pki.write_atomic(os.path.join(folder, "ca.crt"), pki.read(os.path.join(other, "ca.crt")),
                     0o644)
    now = f.material("worker")
    assert now.generation > first.generation and now.cert_pem != first.cert_pem


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(pki.PkiError, match="worker.crt|ca.crt"):
        tls.MutualTls(tls.TlsFolder(str(tmp_path)), "worker")


def _proof(folder: str, kind: str, audience: str, clock=None):
    m = tls.TlsFolder(folder).material(kind)
    prover = Prover(m.cert_pem, m.key_pem, **({"clock": clock} if clock else {}))
    md = dict(prover.metadata(audience))
    return md["pdserve-identity-cert-bin"], md["pdserve-identity-proof-bin"]


def test_a_proof_verifies_for_its_ca_audience_and_time_only(folder, tmp_path):
    ca = pki.read(os.path.join(folder, pki.CA_CERT))
    der, proof = _proof(folder, "worker", "pdserve.v1.RouterControl")
    assert Verifier(ca).verify(der, proof, "pdserve.v1.RouterControl") == \
        Identity("worker", "worker")
    with pytest.raises(ProofError, match="not 'pdserve.v1.Controller'"):
        Verifier(ca).verify(der, proof, "pdserve.v1.Controller")
    other = str(tmp_path / "other")
    pki.init_folder(other, "c2")
    with pytest.raises(ProofError, match="not issued by this cluster's CA"):
        Verifier(pki.read(os.path.join(other, pki.CA_CERT))).verify(
            der, proof, "pdserve.v1.RouterControl")
    tampered = proof[:-1] + bytes([proof[-1] ^ 1])
    with pytest.raises(ProofError):
        Verifier(ca).verify(der, tampered, "pdserve.v1.RouterControl")
    # Another certificate's proof, sent with this certificate: the signature does not match.
    _, other_proof = _proof(folder, "controller", "pdserve.v1.RouterControl")
    with pytest.raises(ProofError, match="signature"):
        Verifier(ca).verify(der, other_proof, "pdserve.v1.RouterControl")
    import time
    old_der, old = _proof(folder, "worker", "pdserve.v1.RouterControl",
                          clock=lambda: time.time() - 3600)
    with pytest.raises(ProofError, match="expired"):
        Verifier(ca).verify(old_der, old, "pdserve.v1.RouterControl")


def test_the_launchers_renewal_reissues_certificates_past_two_thirds_of_their_life(tmp_path):
    from pdserve.launcher.cluster_tls import Renewal

    folder = str(tmp_path / "tls")
    pki.init_folder(folder, "c")
    renewal = Renewal(folder)
    assert renewal.renew() == []  # a day's certificates, just made
    for kind in ("worker", "router"):  # these two about to lapse
        pki.issue_into(folder, Identity(kind, kind), lifetime_s=1.0)
    assert sorted(renewal.renew()) == ["router", "worker"]
    for kind in ("worker", "router"):
        left = pki.info(pki.read(os.path.join(folder, pki.cert_file(kind)))).not_after - \
            dt.datetime.now(dt.timezone.utc)
        assert left > dt.timedelta(hours=23)
