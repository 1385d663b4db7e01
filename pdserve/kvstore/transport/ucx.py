"""Cross-host transport over UCX (RDMA, NVLink, shared memory) through `ucxx`: not built yet.

Owns the answer to "can this process use UCX?" and the place the UCX transport will live.
Must not fake a transport: the node's data server speaks only TCP today, so there is no UCX
endpoint to talk to even where `ucxx` imports, and `UcxTransport` raises TransportUnavailable.
`ucxx` is not a dependency of pdserve; it is imported lazily and only here.

To build it: give the node a ucxx listener that exposes each DRAM segment as registered memory
(an rkey per segment, published in the node's registration), then implement `write`/`read_into`
as one-sided put/get of `extent.offset .. + len` against that rkey, and flip
`UCX_TRANSPORT_IMPLEMENTED`.
"""

from __future__ import annotations

import functools
import importlib.util

from pdserve.kvstore.transport.base import Extent, TransportUnavailable

UCX_TRANSPORT_IMPLEMENTED = False


@functools.lru_cache(maxsize=1)
def ucxx_importable() -> bool:
    """Whether the `ucxx` package is installed here (found without importing it)."""
    return importlib.util.find_spec("ucxx") is not None


def ucx_available() -> bool:
    """Whether the UCX transport can be used: `ucxx` installed and the transport implemented."""
    return UCX_TRANSPORT_IMPLEMENTED and ucxx_importable()


class UcxTransport:
    """Placeholder with the Transport interface; constructing it raises TransportUnavailable."""

    kind = "ucx"

    def __init__(self) -> None:
        reason = ("the UCX transport is not implemented yet (nodes serve TCP only)"
                  if ucxx_importable() else "ucxx is not installed")
        raise TransportUnavailable(f"UcxTransport unavailable: {reason}; use TcpTransport")

    def write(self, extent: Extent, src: object) -> None:  # pragma: no cover - never constructed
        raise TransportUnavailable("UcxTransport unavailable")

    def read_into(self, extent: Extent, dst: object) -> None:  # pragma: no cover
        raise TransportUnavailable("UcxTransport unavailable")

    def close(self) -> None:  # pragma: no cover
        pass
