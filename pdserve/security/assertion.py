"""Identity proofs: how a component proves its cluster certificate on a listener that cannot
ask for one.

The router's control API and the controller take calls from operators holding only an admin
key, so their TLS does not ask for a client certificate (gRPC's Python API can only require one
or not ask). A component calling them proves its identity per call instead: it sends its
certificate and a statement (`aud`: the service called, `iat`, `exp`, at most
`MAX_LIFETIME_S` apart) signed with the certificate's private key, both in binary call metadata
inside the TLS connection. The server checks the certificate was issued by the cluster CA and
is valid now, the signature, the audience and the times; the result is cached (bounded), so a
proof is verified once and the client signs a new one every few minutes, not per call.

Owns making (`Prover`) and checking (`Verifier`) proofs, and reading an identity out of a
certificate. Signatures are ECDSA-SHA256 (or RSA-PSS for an RSA key) from `cryptography`.
Must not know gRPC beyond the metadata keys, or log a proof.
"""

from __future__ import annotations

import json
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa

from pdserve.core.identity import Identity, parse_uri

CERT_METADATA = "pdserve-identity-cert-bin"  # the caller's certificate, DER
PROOF_METADATA = "pdserve-identity-proof-bin"  # len(statement) u16, statement, signature
MAX_LIFETIME_S = 600.0
PROOF_LIFETIME_S = 300.0
_SKEW_S = 60.0  # clocks of two hosts may disagree this much
_CACHE = 1024  # verified proofs kept; certificates parsed kept


class ProofError(Exception):
    """A proof does not verify; the message says why (never the proof itself)."""


def identity_of(cert: x509.Certificate) -> Identity | None:
    """The identity a certificate's `spiffe://pdserve/...` URI names (None if it has none)."""
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return None
    found = [i for i in map(parse_uri, san.get_values_for_type(x509.UniformResourceIdentifier))
             if i is not None]
    return found[0] if len(found) == 1 else None


def _sign(key, data: bytes) -> bytes:
    if isinstance(key, ec.EllipticCurvePrivateKey):
        return key.sign(data, ec.ECDSA(hashes.SHA256()))
    if isinstance(key, rsa.RSAPrivateKey):
        return key.sign(data, padding.PSS(padding.MGF1(hashes.SHA256()),
                                          padding.PSS.MAX_LENGTH), hashes.SHA256())
    raise ProofError(f"unsupported key type {type(key).__name__}")


def _verify(public_key, signature: bytes, data: bytes) -> None:
    if isinstance(public_key, ec.EllipticCurvePublicKey):
        public_key.verify(signature, data, ec.ECDSA(hashes.SHA256()))
    elif isinstance(public_key, rsa.RSAPublicKey):
        public_key.verify(signature, data, padding.PSS(padding.MGF1(hashes.SHA256()),
                                                       padding.PSS.MAX_LENGTH), hashes.SHA256())
    else:
        raise ProofError(f"unsupported key type {type(public_key).__name__}")


class Prover:
    """Signs proofs for one certificate and key; a proof per audience, renewed before it ends."""

    def __init__(self, cert_pem: bytes, key_pem: bytes, clock=time.time) -> None:
        cert = x509.load_pem_x509_certificate(cert_pem)
        self.der = cert.public_bytes(serialization.Encoding.DER)
        self._key = serialization.load_pem_private_key(key_pem, password=None)
        self._clock = clock
        self._lock = threading.Lock()
        self._proofs: dict[str, tuple[float, bytes]] = {}  # audience -> (exp, proof); bounded
        # by the services this process calls

    def metadata(self, audience: str) -> tuple[tuple[str, bytes], ...]:
        now = self._clock()
        with self._lock:
            exp, proof = self._proofs.get(audience, (0.0, b""))
            if exp - now < PROOF_LIFETIME_S / 3:
                exp = now + PROOF_LIFETIME_S
                statement = json.dumps({"aud": audience, "iat": int(now), "exp": int(exp)},
                                       separators=(",", ":")).encode()
                proof = struct.pack(">H", len(statement)) + statement + _sign(self._key,
                                                                              statement)
                self._proofs[audience] = (exp, proof)
        return ((CERT_METADATA, self.der), (PROOF_METADATA, proof))


@dataclass(frozen=True)
class _Cert:
    identity: Identity
    not_before: float
    not_after: float
    public_key: object


class Verifier:
    """Checks proofs against the cluster CA certificates (PEM, one or more: several during a
    CA rotation). Thread-safe; caches bounded."""

    def __init__(self, ca_pem: bytes, clock=time.time) -> None:
        self._cas = x509.load_pem_x509_certificates(ca_pem)
        self._clock = clock
        self._lock = threading.Lock()
        self._certs: OrderedDict[bytes, _Cert | str] = OrderedDict()
        self._proofs: OrderedDict[tuple[bytes, bytes], tuple[Identity, float]] = OrderedDict()

    def _cert(self, der: bytes) -> _Cert:
        with self._lock:
            hit = self._certs.get(der)
        if hit is None:
            hit = self._parse(der)
            with self._lock:
                self._certs[der] = hit
                while len(self._certs) > _CACHE:
                    self._certs.popitem(last=False)
        if isinstance(hit, str):
            raise ProofError(hit)
        return hit

    def _parse(self, der: bytes) -> _Cert | str:
        try:
            cert = x509.load_der_x509_certificate(der)
        except ValueError:
            return "the certificate does not parse"
        for ca in self._cas:
            try:
                cert.verify_directly_issued_by(ca)
                break
            except (ValueError, TypeError, InvalidSignature):
                continue
        else:
            return "the certificate was not issued by this cluster's CA"
        ident = identity_of(cert)
        if ident is None:
            return "the certificate names no pdserve identity (spiffe://pdserve/KIND/NAME)"
        return _Cert(ident, cert.not_valid_before_utc.timestamp(),
                     cert.not_valid_after_utc.timestamp(), cert.public_key())

    def verify(self, der: bytes, proof: bytes, audience: str) -> Identity:
        """The identity `der` and `proof` prove for a call to `audience`; ProofError."""
        now = self._clock()
        key = (der, proof)
        with self._lock:
            hit = self._proofs.get(key)
        if hit is not None and hit[1] >= now:
            return hit[0]
        cert = self._cert(der)
        if not cert.not_before <= now <= cert.not_after:
            raise ProofError("the certificate is not valid now (expired or not yet valid)")
        if len(proof) < 2:
            raise ProofError("the proof is malformed")
        (n,) = struct.unpack(">H", proof[:2])
        statement, signature = proof[2:2 + n], proof[2 + n:]
        try:
            _verify(cert.public_key, signature, statement)
        except InvalidSignature:
            raise ProofError("the proof's signature does not match the certificate") from None
        try:
            claims = json.loads(statement)
            aud, iat, exp = claims["aud"], float(claims["iat"]), float(claims["exp"])
        except (ValueError, KeyError, TypeError):
            raise ProofError("the proof's statement is malformed") from None
        if aud != audience:
            raise ProofError(f"the proof is for {aud!r}, not {audience!r}")
        if not (iat - _SKEW_S <= now <= exp + _SKEW_S and 0 < exp - iat <= MAX_LIFETIME_S):
            raise ProofError("the proof has expired or is not yet valid")
        with self._lock:
            self._proofs[key] = (cert.identity, min(exp + _SKEW_S, cert.not_after))
            while len(self._proofs) > _CACHE:
                self._proofs.popitem(last=False)
        return cert.identity
