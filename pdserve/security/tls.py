"""Internal TLS of one process: its certificates, re-read when they change, as gRPC credentials
and `ssl` contexts; or, only when asked for, no TLS at all.

Owns `TlsFolder` (a folder of `pki` files; each kind's CA, certificate and key loaded together,
checked to match, and re-read when a file changes, looked at most once a second, so a
certificate rotated on disk is used by the next connection without a restart: gRPC servers
through dynamic credentials, clients through channels rebuilt when their material changes, the
data plane through fresh contexts), `MutualTls` (this process's identity: which certificate it
presents as a client, which it presents for each kind it serves, and how a server checks a
caller), `Insecure` (`--insecure-internal`: plaintext, no identities; an explicit opt-in that
says so in the log), and the process-wide setting every channel and listener reads
(`configure`, `current`). Must not decide who may call what: `access.py` does.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
import time
from dataclasses import dataclass

import grpc

from pdserve.core.identity import ANY_SERVER_NAME, CONTROLLER, OPERATOR, ROUTER, Identity, \
    server_name
from pdserve.security import pki
from pdserve.security.assertion import Prover, Verifier

log = logging.getLogger(__name__)

CHECK_INTERVAL_S = 1.0
# Servers whose listeners do not ask for a client certificate (an admin key alone must get
# in): a component calling them proves its certificate per call (`assertion.py`).
PROOF_PEERS = frozenset({ROUTER, CONTROLLER})
ANY = "any"  # a channel's peer when any cluster server will do (a health probe)
TLS_DIR_ENV = "PDSERVE_TLS_DIR"
INSECURE_ENV = "PDSERVE_INSECURE_INTERNAL"


class NotConfigured(RuntimeError):
    """No internal TLS setting: neither a TLS folder nor `--insecure-internal`."""


@dataclass(frozen=True)
class Material:
    """One kind's files as read together: the CA bundle, a certificate and its key (PEM)."""

    ca_pem: bytes
    cert_pem: bytes
    key_pem: bytes
    generation: int


def file_stamp(path: str) -> tuple[int, int, int]:
    st = os.stat(path)  # follows links: a Kubernetes Secret swaps a link on update
    return (st.st_mtime_ns, st.st_size, st.st_ino)


def _matches(cert_pem: bytes, key_pem: bytes) -> bool:
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    cert = x509.load_pem_x509_certificate(cert_pem)
    key = serialization.load_pem_private_key(key_pem, password=None)
    fmt = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return cert.public_key().public_bytes(*fmt) == key.public_key().public_bytes(*fmt)


class TlsFolder:
    """A TLS folder (`pki` layout) read per kind and re-read when its files change."""

    def __init__(self, path: str, check_interval_s: float = CHECK_INTERVAL_S,
                 clock=time.monotonic) -> None:
        self.path = os.path.abspath(path)
        self._interval = check_interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._loaded: dict[str, tuple[tuple, Material]] = {}  # kind -> (stamps, material)
        self._checked: dict[str, float] = {}
        self._generation = 0

    def files(self, kind: str) -> tuple[str, str, str]:
        return (os.path.join(self.path, pki.CA_CERT), os.path.join(self.path, pki.cert_file(kind)),
                os.path.join(self.path, pki.key_file(kind)))

    def has(self, kind: str) -> bool:
        return all(os.path.exists(p) for p in self.files(kind))

    def material(self, kind: str) -> Material:
        """`kind`'s current files. The first read raises PkiError naming a missing or
        mismatched file; later, a file caught half-rotated keeps the last good material."""
        now = self._clock()
        with self._lock:
            held = self._loaded.get(kind)
            if held is not None and now - self._checked.get(kind, -1e18) < self._interval:
                return held[1]
            self._checked[kind] = now
            paths = self.files(kind)
            try:
                stamps = tuple(file_stamp(p) for p in paths)
            except OSError as e:
                if held is not None:
                    return held[1]
                raise pki.PkiError(f"TLS folder {self.path}: cannot read "
                                   f"{e.filename or paths}: {e.strerror}") from None
            if held is not None and held[0] == stamps:
                return held[1]
            try:
                ca, cert, key = (pki.read(p) for p in paths)
                if not _matches(cert, key):
                    raise pki.PkiError(f"{paths[2]} is not the key of {paths[1]}")
            except (pki.PkiError, ValueError) as e:
                if held is not None:  # mid-rotation: try again at the next look
                    self._checked[kind] = now - self._interval
                    return held[1]
                raise pki.PkiError(str(e)) from None
            self._generation += 1
            material = Material(ca, cert, key, self._generation)
            self._loaded[kind] = (stamps, material)
            if held is not None:
                log.info("TLS: re-read the %s certificate from %s", kind, self.path)
            return material


class Security:
    """What every channel and listener of this process asks: the common interface."""

    insecure: bool = False
    identity: Identity | None = None


class Insecure(Security):
    """`--insecure-internal`: internal calls in plaintext, no identities, no checks."""

    insecure = True

    def describe(self) -> str:
        return "insecure (plaintext, unauthenticated internal calls)"


class MutualTls(Security):
    """This process is `kind` in the cluster whose TLS folder is `folder`."""

    def __init__(self, folder: TlsFolder, kind: str) -> None:
        self.folder = folder
        self.kind = kind
        material = folder.material(kind)  # fail at start, naming the file
        self.identity = pki.info(material.cert_pem).identity or Identity(kind, kind)
        if self.identity.kind != kind:
            raise pki.PkiError(f"{folder.files(kind)[1]} is a {self.identity.kind}'s "
                               f"certificate, not a {kind}'s")
        self._lock = threading.Lock()
        self._provers: dict[int, Prover] = {}
        self._verifiers: dict[int, Verifier] = {}
        self._contexts: dict[tuple, ssl.SSLContext] = {}

    def describe(self) -> str:
        return f"mutual TLS as {self.identity} ({self.folder.path})"

    # -- gRPC ---------------------------------------------------------------------------------
    def server_credentials(self, kind: str, require_client_cert: bool) -> grpc.ServerCredentials:
        """Credentials presenting `kind`'s certificate, re-read on each new connection when the
        files changed; `require_client_cert`: only a holder of a cluster certificate connects."""
        first = self.folder.material(kind)
        seen = [first.generation]

        def config(m: Material):
            return grpc.ssl_server_certificate_configuration([(m.key_pem, m.cert_pem)],
                                                             root_certificates=m.ca_pem)

        def fetch():
            m = self.folder.material(kind)
            if m.generation == seen[0]:
                return None
            seen[0] = m.generation
            return config(m)

        return grpc.dynamic_ssl_server_credentials(
            config(first), fetch, require_client_authentication=require_client_cert)

    def channel_credentials(self, peer: str) -> tuple[grpc.ChannelCredentials, list, int]:
        """(credentials, options, generation) for a channel to a server of kind `peer` (or
        ANY): the client certificate, the cluster CA, the server name checked, and a per-call
        identity proof for servers that do not ask for a certificate."""
        m = self.folder.material(self.kind)
        creds = grpc.ssl_channel_credentials(root_certificates=m.ca_pem, private_key=m.key_pem,
                                             certificate_chain=m.cert_pem)
        if peer in PROOF_PEERS:
            creds = grpc.composite_channel_credentials(
                creds, grpc.metadata_call_credentials(_ProofPlugin(self), name="pdserve-proof"))
        name = ANY_SERVER_NAME if peer == ANY else server_name(peer)
        return creds, [("grpc.ssl_target_name_override", name)], m.generation

    def generation(self) -> int:
        return self.folder.material(self.kind).generation

    def prover(self) -> Prover:
        m = self.folder.material(self.kind)
        with self._lock:
            p = self._provers.get(m.generation)
            if p is None:
                self._provers = {m.generation: (p := Prover(m.cert_pem, m.key_pem))}
            return p

    def verifier(self, kind: str) -> Verifier:
        """Checks identity proofs against the CA bundle `kind`'s files hold now."""
        m = self.folder.material(kind)
        with self._lock:
            v = self._verifiers.get(m.generation)
            if v is None:
                self._verifiers = {m.generation: (v := Verifier(m.ca_pem))}
            return v

    # -- the store's data plane (Python's ssl) ------------------------------------------------
    def _context(self, side: str, kind: str) -> ssl.SSLContext:
        m = self.folder.material(kind)
        key = (side, kind, m.generation)
        with self._lock:
            ctx = self._contexts.get(key)
        if ctx is not None:
            return ctx
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if side == "server"
                             else ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(cadata=m.ca_pem.decode("ascii"))
        _, cert_path, key_path = self.folder.files(kind)
        ctx.load_cert_chain(cert_path, key_path)
        with self._lock:
            self._contexts = {k: v for k, v in self._contexts.items() if k[:2] != key[:2]}
            self._contexts[key] = ctx
        return ctx

    def server_context(self, kind: str) -> ssl.SSLContext:
        """A server context presenting `kind`'s certificate and requiring a cluster one."""
        return self._context("server", kind)

    def client_context(self) -> ssl.SSLContext:
        """A client context presenting this process's certificate; check the server with
        `server_hostname=server_name(kind)`."""
        return self._context("client", self.kind)


class _ProofPlugin(grpc.AuthMetadataPlugin):
    def __init__(self, security: MutualTls) -> None:
        self._security = security

    def __call__(self, context, callback) -> None:
        try:
            audience = context.service_url.rstrip("/").rsplit("/", 1)[-1]
            callback(self._security.prover().metadata(audience), None)
        except Exception as e:  # noqa: BLE001 - the call fails UNAVAILABLE, naming why
            callback((), e)


def follow_files(ctx: ssl.SSLContext, build, paths: list[str],
                 check_interval_s: float = CHECK_INTERVAL_S) -> None:
    """Make the server context `ctx` hand each new connection a context rebuilt by `build()`
    once any of `paths` changed (looked at most every `check_interval_s`): certificate rotation
    for servers whose context is made once (uvicorn's). A rebuild that fails (files caught
    mid-rotation) keeps the last good context."""
    state = {"stamps": tuple(file_stamp(p) for p in paths), "ctx": ctx, "checked": 0.0}
    lock = threading.Lock()

    def pick(sslobj, server_name, _ctx):
        now = time.monotonic()
        with lock:
            if now - state["checked"] >= check_interval_s:
                state["checked"] = now
                try:
                    stamps = tuple(file_stamp(p) for p in paths)
                    if stamps != state["stamps"]:
                        fresh = build()
                        fresh.sni_callback = pick
                        state["stamps"], state["ctx"] = stamps, fresh
                        log.info("TLS: re-read the certificate files %s", ", ".join(paths))
                except (OSError, ssl.SSLError, ValueError):
                    pass
            current = state["ctx"]
        if current is not _ctx:
            sslobj.context = current
        return None

    ctx.sni_callback = pick


def peer_identity(sslsock: ssl.SSLSocket) -> Identity | None:
    """The identity in the certificate a data-plane peer presented (verified by the context)."""
    from pdserve.core.identity import parse_uri

    cert = sslsock.getpeercert() or {}
    uris = [v for t, v in cert.get("subjectAltName", ()) if t == "URI"]
    found = [i for i in map(parse_uri, uris) if i is not None]
    return found[0] if len(found) == 1 else None


# -- the process-wide setting -------------------------------------------------------------------
_current: Security | None = None
_current_lock = threading.Lock()


def configure(security: Security) -> Security:
    """Set this process's internal TLS (each process's `main` does, before serving)."""
    global _current
    with _current_lock:
        _current = security
    if security.insecure:
        log.warning("internal calls are NOT authenticated or encrypted (--insecure-internal)")
    return security


def from_settings(kind: str, tls_dir: str | None, insecure: bool) -> Security:
    """The setting of a process of `kind` from its flags (`--tls-dir`, `--insecure-internal`),
    else the environment (`PDSERVE_TLS_DIR`, `PDSERVE_INSECURE_INTERNAL=1`); NotConfigured
    when none says."""
    if tls_dir and insecure:
        raise NotConfigured("--tls-dir and --insecure-internal exclude each other")
    if not tls_dir and not insecure:  # a flag wins over the other setting's variable
        tls_dir = os.environ.get(TLS_DIR_ENV) or None
        insecure = os.environ.get(INSECURE_ENV, "").lower() in ("1", "true", "yes")
        if tls_dir and insecure:
            raise NotConfigured(f"{TLS_DIR_ENV} and {INSECURE_ENV} exclude each other")
    if insecure:
        return Insecure()
    if tls_dir:
        return MutualTls(TlsFolder(tls_dir), kind)
    raise NotConfigured(
        "internal calls are mutually authenticated with TLS: give --tls-dir DIR (a folder with "
        "ca.crt and this process's certificate; `pdserve certs init DIR` makes one) or "
        f"{TLS_DIR_ENV}, or --insecure-internal to run without (plaintext, anyone may call)")


def current() -> Security:
    """This process's setting; unset, the environment's as an operator (tools and tests)."""
    global _current
    with _current_lock:
        if _current is None:
            _current = from_settings(OPERATOR, None, False)
        return _current


def is_configured() -> bool:
    return configured() is not None


def configured() -> Security | None:
    """The setting made so far (None: none yet; `current()` would read the environment)."""
    with _current_lock:
        return _current


def restore(setting: Security | None) -> None:
    """Put back a setting `configured()` returned (tests that run a process's `main` here)."""
    global _current
    with _current_lock:
        _current = setting


def reset() -> None:
    """Forget the setting (tests that try several)."""
    global _current
    with _current_lock:
        _current = None
