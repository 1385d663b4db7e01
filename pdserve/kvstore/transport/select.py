"""Which transport reaches a replica from here: a pure choice from host ids and the tier.

Owns the rule: for DRAM, shared memory on the same host, UCX across hosts where both this process
and the node have it and internal TLS is off (`--insecure-internal`: UCX carries its bytes in
plaintext, so it never runs in a cluster that encrypts), TCP otherwise; for SSD always TCP (the
node reads and writes its own files). Must not construct transports or do I/O beyond asking
(once, cached) whether UCX is available and reading this process's internal-TLS setting.
"""

from __future__ import annotations

from typing import Literal

from pdserve.kvstore.transport.ucx import ucx_available
from pdserve.security import tls

TransportKind = Literal["shm", "ucx", "tcp"]


def pick_transport(extent_host_id: str, my_host_id: str, *, tier: str = "dram",
                   ucx: bool | None = None, node_serves_ucx: bool = True,
                   insecure: bool | None = None) -> TransportKind:
    """The transport kind for an extent on host `extent_host_id`, seen from `my_host_id`.

    `ucx` overrides this process's UCX availability check (None: `ucx_available()`), but never
    the TLS rule; `node_serves_ucx` says whether the extent's node has a UCX listener;
    `insecure` whether internal TLS is off (None: this process's setting, `tls.current()`).
    """
    if tier == "ssd":
        return "tcp"
    if extent_host_id == my_host_id:
        return "shm"
    if (node_serves_ucx and (ucx if ucx is not None else ucx_available())
            and (insecure if insecure is not None else tls.current().insecure)):
        return "ucx"
    return "tcp"
