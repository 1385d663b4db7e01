"""API keys and tenants: which tenant a request belongs to, from its bearer key.

Owns loading keys (a file of `KEY TENANT` lines, `#` comments; or `PDSERVE_API_KEYS` as
`KEY:TENANT,KEY:TENANT`) and resolving a request's credentials to a tenant. With no keys
configured (the embedded default) every request is allowed and belongs to the default tenant
"", unless it names a `cache_salt` of its own (as vLLM's API allows). The tenant is the salt of
the request's block hashes (invariant 6): one tenant's prompt never hits another's cached
blocks. The router authenticates requests with it; the controller tells tenants' keys from
admin keys with it. Must not know gRPC or HTTP beyond the `authorization` header's `Bearer` form.
"""

from __future__ import annotations

import hmac
import os
import re
from dataclasses import dataclass

from pdserve.security.access import NO_CREDENTIAL, UNKNOWN_KEY
from pdserve.security.keys import KeyFileError

__all__ = ["ApiKeys", "AuthError", "KeyFileError"]

_TENANT = re.compile(r"[A-Za-z0-9._-]{1,64}")


class AuthError(Exception):
    """Missing or unknown API key (gRPC UNAUTHENTICATED, HTTP 401); `reason` is the failure
    counter's label (`pdserve.security.access`)."""

    def __init__(self, message: str, reason: str = UNKNOWN_KEY) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class ApiKeys:
    keys: dict[str, str]  # key -> tenant

    @property
    def required(self) -> bool:
        return bool(self.keys)

    @classmethod
    def load(cls, path: str | None = None, env: str | None = None) -> ApiKeys:
        """Keys from `path` and the `PDSERVE_API_KEYS` value `env` (default: the environment)."""
        keys: dict[str, str] = {}
        if path:
            with open(path, encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    line = line.split("#", 1)[0].strip()
                    if line:
                        parts = line.split()
                        if len(parts) != 2:
                            raise KeyFileError(f"{path}:{n}: expected 'KEY TENANT'")
                        cls._add(keys, parts[0], parts[1], f"{path}:{n}")
        env = os.environ.get("PDSERVE_API_KEYS", "") if env is None else env
        for i, item in enumerate(filter(None, (s.strip() for s in env.split(",")))):
            key, sep, tenant = item.partition(":")
            if not sep:
                raise KeyFileError(f"PDSERVE_API_KEYS item {i}: expected KEY:TENANT")
            cls._add(keys, key, tenant, f"PDSERVE_API_KEYS item {i}")
        return cls(keys)

    @staticmethod
    def _add(keys: dict[str, str], key: str, tenant: str, where: str) -> None:
        if len(key) < 8:
            raise KeyFileError(f"{where}: keys must be at least 8 characters")
        if not _TENANT.fullmatch(tenant):
            raise KeyFileError(f"{where}: tenant must match [A-Za-z0-9._-]{{1,64}}")
        keys[key] = tenant

    def holds(self, key: str) -> bool:
        """Whether `key` is one of the tenants' keys (constant-time compare)."""
        found = False
        for known in self.keys:
            found |= hmac.compare_digest(known.encode(), key.encode())
        return found

    def tenant_of(self, authorization: str | None, cache_salt: str = "") -> str:
        """The tenant for a request with this `authorization` header value; AuthError."""
        if not self.keys:
            return f"salt:{cache_salt}" if cache_salt else ""
        if not authorization:
            raise AuthError("missing API key: send 'authorization: Bearer <key>'", NO_CREDENTIAL)
        scheme, _, key = authorization.partition(" ")
        if scheme.lower() != "bearer" or not key:
            raise AuthError("authorization must be 'Bearer <key>'")
        for known, tenant in self.keys.items():
            if hmac.compare_digest(known.encode(), key.strip().encode()):
                # A tenant may still split its own cache with a salt; never reach another's.
                return f"{tenant}:{cache_salt}" if cache_salt else tenant
        raise AuthError("unknown API key")
