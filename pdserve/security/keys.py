"""Admin keys: the bearer credential an operator steers the cluster with.

Owns loading them (`--admin-keys-file`: `KEY [NAME]` lines, `#` comments; the name, else
`admin-<line>`, is what audit lines record, never the key), matching an `authorization: Bearer`
value in constant time, and reading that header. Must not log or return a key.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass, field

_MIN_KEY_CHARS = 8


class KeyFileError(ValueError):
    """A key file is malformed; the message names the line, never the key."""


def bearer(authorization: str | None) -> str | None:
    """The key of an `authorization: Bearer KEY` value, else None."""
    if not authorization:
        return None
    scheme, _, key = authorization.partition(" ")
    key = key.strip()
    return key if scheme.lower() == "bearer" and key else None


@dataclass(frozen=True)
class AdminKeys:
    names: dict[str, str] = field(default_factory=dict)  # key -> name

    def __bool__(self) -> bool:
        return bool(self.names)

    @classmethod
    def load(cls, path: str | None) -> AdminKeys:
        if not path:
            return cls({})
        names: dict[str, str] = {}
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                parts = line.split("#", 1)[0].split()
                if not parts:
                    continue
                if len(parts) > 2:
                    raise KeyFileError(f"{path}:{n}: expected 'KEY [NAME]'")
                if len(parts[0]) < _MIN_KEY_CHARS:
                    raise KeyFileError(f"{path}:{n}: keys must be at least {_MIN_KEY_CHARS} "
                                       "characters")
                names[parts[0]] = parts[1] if len(parts) == 2 else f"admin-{n}"
        return cls(names)

    def name_of(self, key: str | None) -> str | None:
        """The name of admin key `key`, or None when it is not one (constant-time compare)."""
        if not key:
            return None
        found = None
        for known, name in self.names.items():
            if hmac.compare_digest(known.encode(), key.encode()):
                found = name
        return found
