"""Which transport reaches a replica from here: a pure choice from host ids and the tier.

Owns the rule: for DRAM, shared memory on the same host, UCX across hosts where it is available,
TCP otherwise; for SSD always TCP (the node reads and writes its own files). Must not construct
transports or do I/O beyond asking (once, cached) whether UCX is available.
"""

from __future__ import annotations

from typing import Literal

from pdserve.kvstore.transport.ucx import ucx_available

TransportKind = Literal["shm", "ucx", "tcp"]


def pick_transport(extent_host_id: str, my_host_id: str, *, tier: str = "dram",
                   ucx: bool | None = None) -> TransportKind:
    """The transport kind for an extent on host `extent_host_id`, seen from `my_host_id`.

    `ucx` overrides the UCX availability check (None: `ucx_available()`).
    """
    if tier == "ssd":
        return "tcp"
    if extent_host_id == my_host_id:
        return "shm"
    if ucx if ucx is not None else ucx_available():
        return "ucx"
    return "tcp"
