"""The check every internal gRPC call passes before its handler runs.

Owns reading what a call proves (the verified certificate's identity on a mutual-TLS listener;
on a control listener, the identity proof and the bearer key in its metadata) into an
`access.Caller`, asking `access.decide`, and counting a refusal (`failures`). Two planes:
INTERNAL listeners require a cluster certificate in the TLS handshake; CONTROL listeners (the
router's control API, the controller) take TLS without one, so an operator with only an admin
key gets in, and authenticate each call. With `--insecure-internal` nothing is proven: every
call is let in, except that the controller still requires an admin key when it has some (as
it did before internal TLS). Must not run handlers or know a servicer.
"""

from __future__ import annotations

from collections.abc import Callable

from pdserve.core.identity import parse_uri
from pdserve.security import access, failures
from pdserve.security.assertion import CERT_METADATA, PROOF_METADATA, ProofError
from pdserve.security.keys import AdminKeys, bearer
from pdserve.security.tls import MutualTls, Security, current

INTERNAL = "internal"
CONTROL = "control"


class Guard:
    """Decides each call of one listener: `check(method, context) -> access.Verdict`."""

    def __init__(self, kind: str, plane: str = INTERNAL, admin_keys: AdminKeys | None = None,
                 is_tenant_key: Callable[[str], bool] | None = None,
                 security: Security | None = None) -> None:
        if plane not in (INTERNAL, CONTROL):
            raise ValueError(f"plane must be {INTERNAL!r} or {CONTROL!r}, got {plane!r}")
        self.kind = kind  # the kind this listener serves as
        self.plane = plane
        self.admin_keys = admin_keys or AdminKeys()
        self.is_tenant_key = is_tenant_key or (lambda key: False)
        self.security = security or current()

    def caller(self, service: str, context) -> access.Caller:
        sec = self.security
        metadata = dict(context.invocation_metadata() or ()) if self.plane == CONTROL else {}
        key = bearer(metadata.get("authorization")) if self.plane == CONTROL else None
        admin = self.admin_keys.name_of(key) if key else None
        tenant = bool(key) and admin is None and self.is_tenant_key(key)
        identity, bad = None, ""
        if isinstance(sec, MutualTls):
            if self.plane == INTERNAL:
                ids = (context.auth_context() or {}).get("peer_spiffe_id") or ()
                identity = parse_uri(ids[0]) if len(ids) == 1 else None
            else:
                cert, proof = metadata.get(CERT_METADATA), metadata.get(PROOF_METADATA)
                if cert is not None and proof is not None:
                    try:
                        identity = sec.verifier(self.kind).verify(cert, proof, service)
                    except ProofError as e:
                        bad = str(e)
        return access.Caller(identity, admin, bad, bool(key), tenant)

    def check(self, method: str, context) -> access.Verdict:
        service, name = access.split_method(method)
        if self.security.insecure:
            verdict = self._insecure(service, context)
        else:
            verdict = access.decide(service, name, self.caller(service, context))
        if verdict.refused:
            failures.record(service, verdict.reason)
        return verdict

    def _insecure(self, service: str, context) -> access.Verdict:
        if service != access.CONTROLLER_SERVICE or not self.admin_keys:
            return access.Verdict(True)
        key = bearer(dict(context.invocation_metadata() or ()).get("authorization"))
        name = self.admin_keys.name_of(key)
        if name is not None:
            return access.Verdict(True, who=f"key:{name}")
        caller = access.Caller(bearer=bool(key), tenant_key=bool(key) and self.is_tenant_key(key))
        return access.decide(service, "*", caller)
