"""The cluster's certificates: a per-cluster CA and a short-lived certificate per component kind.

Owns the layout of a TLS folder (`ca.crt`, the CA's `ca.key` where certificates are issued, and
`<kind>.crt` / `<kind>.key` for each component kind; the folder 0700, keys 0600), making a CA,
issuing a certificate for an identity (ECDSA P-256, the SPIFFE-style URI naming its holder and
the DNS names `<kind>.pdserve.internal` and `pdserve.internal` a client checks; server and
client use), renewing a folder's certificates before they lapse, and writing every file
atomically (a reader never sees half a file; the key is written before its certificate, and
readers check the two match). Crypto is the `cryptography` package's, never our own.
Must not serve, connect or log a key.
"""

from __future__ import annotations

import datetime as dt
import os
import tempfile
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from pdserve.core.identity import ANY_SERVER_NAME, KINDS, Identity, server_name

CA_CERT = "ca.crt"
CA_KEY = "ca.key"
# Certificates the embedded cluster makes live a day and are renewed at two thirds of that
# (`renew_due`); the CA, whose key stays in the folder, a year.
LEAF_LIFETIME_S = 24 * 3600.0
CA_LIFETIME_S = 365 * 24 * 3600.0
RENEW_AT_FRACTION = 2 / 3
# Clocks of two hosts disagree a little: a certificate is valid from a few minutes back.
_BACKDATE = dt.timedelta(minutes=5)


class PkiError(ValueError):
    """A TLS folder or file is missing or unusable; the message names the file."""


def cert_file(kind: str) -> str:
    return f"{kind}.crt"


def key_file(kind: str) -> str:
    return f"{kind}.key"


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def make_ca(common_name: str, lifetime_s: float = CA_LIFETIME_S) -> tuple[bytes, bytes]:
    """A new CA: (key PEM, certificate PEM)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "pdserve"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name[:64])])
    now = _now()
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - _BACKDATE)
            .not_valid_after(now + dt.timedelta(seconds=lifetime_s))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True,
                                         crl_sign=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False,
                                         decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                           critical=False)
            .sign(key, hashes.SHA256()))
    return _key_pem(key), _cert_pem(cert)


def issue(ca_key_pem: bytes, ca_cert_pem: bytes, identity: Identity,
          lifetime_s: float = LEAF_LIFETIME_S) -> tuple[bytes, bytes]:
    """A certificate for `identity` signed by the CA: (key PEM, certificate PEM)."""
    ca_key = serialization.load_pem_private_key(ca_key_pem, password=None)
    ca_cert = x509.load_pem_x509_certificate(ca_cert_pem)
    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    not_after = min(now + dt.timedelta(seconds=lifetime_s), ca_cert.not_valid_after_utc)
    subject = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "pdserve"),
                         x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, identity.kind),
                         x509.NameAttribute(NameOID.COMMON_NAME, str(identity)[:64])])
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(ca_cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - _BACKDATE).not_valid_after(not_after)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=False,
                                         crl_sign=False, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=True, encipher_only=False,
                                         decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.SubjectAlternativeName([
                x509.UniformResourceIdentifier(identity.uri),
                x509.DNSName(server_name(identity.kind)), x509.DNSName(ANY_SERVER_NAME)]),
                critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                ca_cert.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    return _key_pem(key), _cert_pem(cert)


def write_atomic(path: str, data: bytes, mode: int) -> None:
    """Write `data` to `path` through a temporary file in the same folder and a rename."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _issue_into(folder: str, ca_key: bytes, ca_cert: bytes, kind: str, name: str,
                lifetime_s: float) -> None:
    key, cert = issue(ca_key, ca_cert, Identity(kind, name), lifetime_s)
    write_atomic(os.path.join(folder, key_file(kind)), key, 0o600)
    write_atomic(os.path.join(folder, cert_file(kind)), cert, 0o644)


def init_folder(folder: str, cluster_id: str, kinds: tuple[str, ...] = KINDS,
                lifetime_s: float = LEAF_LIFETIME_S) -> None:
    """A new CA for cluster `cluster_id` and one certificate per kind (named after its kind)
    in `folder` (made 0700 if missing)."""
    os.makedirs(folder, mode=0o700, exist_ok=True)
    os.chmod(folder, 0o700)
    ca_key, ca_cert = make_ca(f"pdserve cluster {cluster_id}")
    write_atomic(os.path.join(folder, CA_KEY), ca_key, 0o600)
    write_atomic(os.path.join(folder, CA_CERT), ca_cert, 0o644)
    for kind in kinds:
        _issue_into(folder, ca_key, ca_cert, kind, kind, lifetime_s)


def read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise PkiError(f"cannot read {path}: {e.strerror}") from None


def issue_into(folder: str, identity: Identity, lifetime_s: float = LEAF_LIFETIME_S,
               ca_folder: str | None = None) -> None:
    """Issue `identity` a certificate from the CA in `ca_folder` (default `folder`) and write
    it to `folder` as `<kind>.crt`/`<kind>.key`, with the CA's certificate as `ca.crt`."""
    src = ca_folder or folder
    ca_key = read(os.path.join(src, CA_KEY))
    ca_cert = read(os.path.join(src, CA_CERT))
    os.makedirs(folder, mode=0o700, exist_ok=True)
    if src != folder:
        write_atomic(os.path.join(folder, CA_CERT), ca_cert, 0o644)
    _issue_into(folder, ca_key, ca_cert, identity.kind, identity.name, lifetime_s)


@dataclass(frozen=True)
class CertInfo:
    """What a certificate says, without its key: for status lines and logs."""

    identity: Identity | None
    serial: int
    not_before: dt.datetime
    not_after: dt.datetime


def info(cert_pem: bytes) -> CertInfo:
    from pdserve.security.assertion import identity_of  # one reading of the URI, shared

    cert = x509.load_pem_x509_certificate(cert_pem)
    return CertInfo(identity_of(cert), cert.serial_number, cert.not_valid_before_utc,
                    cert.not_valid_after_utc)


def renew_due(cert_pem: bytes, now: dt.datetime | None = None,
              fraction: float = RENEW_AT_FRACTION) -> bool:
    """Whether `fraction` of the certificate's lifetime has passed."""
    i = info(cert_pem)
    now = now or _now()
    return now >= i.not_before + (i.not_after - i.not_before) * fraction


def renew_folder(folder: str, lifetime_s: float = LEAF_LIFETIME_S, force: bool = False,
                 now: dt.datetime | None = None) -> list[str]:
    """Re-issue, from the folder's CA, each kind's certificate that is due (all with `force`),
    keeping its identity; the kinds renewed. Running processes pick the new files up."""
    ca_key = read(os.path.join(folder, CA_KEY))
    ca_cert = read(os.path.join(folder, CA_CERT))
    renewed = []
    for kind in KINDS:
        path = os.path.join(folder, cert_file(kind))
        if not os.path.exists(path):
            continue
        cert = read(path)
        if force or renew_due(cert, now):
            ident = info(cert).identity or Identity(kind, kind)
            _issue_into(folder, ca_key, ca_cert, kind, ident.name, lifetime_s)
            renewed.append(kind)
    return renewed
