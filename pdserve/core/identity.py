"""Who a process of the cluster is: its component kind and name, as its certificate says.

Owns the component kinds (router, worker, node, master, controller, and operator: a person or
a tool acting for one, such as `pdserve serve`'s launcher and `pdserve ctl`), the `Identity`
(kind and name) and its two spellings in a certificate: the SPIFFE-style URI
`spiffe://pdserve/<kind>/<name>` that names the holder, and the DNS name
`<kind>.pdserve.internal` a client checks the server's certificate against, whatever address
it dialled (so a worker's certificate cannot pose as the store master). Pure: no I/O, no
crypto. Must not import torch or any service.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

ROUTER, WORKER, NODE, MASTER, CONTROLLER, OPERATOR = (
    "router", "worker", "node", "master", "controller", "operator")
KINDS = (ROUTER, WORKER, NODE, MASTER, CONTROLLER, OPERATOR)
TRUST_DOMAIN = "pdserve"
# Every certificate also names this DNS name: a caller that does not know which kind serves an
# address (a health probe) checks the certificate is the cluster's, not which kind it is.
ANY_SERVER_NAME = "pdserve.internal"
_NAME = re.compile(r"[A-Za-z0-9._-]{1,63}")


@dataclass(frozen=True)
class Identity:
    kind: str
    name: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not _NAME.fullmatch(self.name):
            raise ValueError(f"name must be 1-63 of [A-Za-z0-9._-], got {self.name!r}")

    def __str__(self) -> str:
        return f"{self.kind}/{self.name}"

    @property
    def uri(self) -> str:
        return f"spiffe://{TRUST_DOMAIN}/{self.kind}/{self.name}"


def server_name(kind: str) -> str:
    """The DNS name a server of `kind` must carry in its certificate."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    return f"{kind}.{ANY_SERVER_NAME}"


def parse_uri(uri: str | bytes) -> Identity | None:
    """The identity a `spiffe://pdserve/<kind>/<name>` URI names, or None for any other."""
    if isinstance(uri, bytes):
        uri = uri.decode("ascii", "replace")
    prefix = f"spiffe://{TRUST_DOMAIN}/"
    if not uri.startswith(prefix):
        return None
    kind, sep, name = uri[len(prefix):].partition("/")
    if not sep:
        return None
    try:
        return Identity(kind, name)
    except ValueError:
        return None
