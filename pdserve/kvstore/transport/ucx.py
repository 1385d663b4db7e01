"""Cross-host transport over UCX (RDMA, NVLink or shared memory where present, TCP otherwise).

Owns the answer to "can this process use UCX?" and the client side of the node's UCX protocol
(`kvstore.node.ucx_protocol`): one endpoint per node, created on first use from the node's
`ucx_address` (its listener), requests on it one at a time (a lock per endpoint, since UCX
matches tag messages in posting order), payloads sent from and received into the caller's
buffer with no copy in Python. `ucxx` (PyPI `ucxx-cu12`) is optional: it is imported lazily,
only here and in the node's UCX server; `PDSERVE_UCX=0` turns the transport off.
UCX here has no TLS: its bytes and requests travel in plaintext, unauthenticated, so a
`UcxTransport` is made only where internal TLS is off (`--insecure-internal`); `ucx_allowed`
says whether that is so. Must not carry bytes of a cluster that runs mutual TLS.

Facts measured on the CPU-only build machines (no RDMA): a listener connection carries its bytes
over TCP, about 1 GB/s between two Python processes, so the plain TCP transport is faster there;
UCX earns its place on hosts with RDMA or NVLink, which the same code uses unchanged.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import os
import threading

from pdserve.kvstore.node.protocol import Status
from pdserve.kvstore.node.ucx_protocol import (
    MESSAGE_BYTES,
    UcxOp,
    decode_reply,
    encode_request,
)
from pdserve.kvstore.transport import ucx_loop
from pdserve.kvstore.transport.base import (
    Extent,
    TransportError,
    TransportUnavailable,
    byte_view,
    remote_error,
)
from pdserve.security import tls


@functools.lru_cache(maxsize=1)
def ucxx_importable() -> bool:
    """Whether the `ucxx` package is installed here (found without importing it)."""
    return importlib.util.find_spec("ucxx") is not None


def ucx_available() -> bool:
    """Whether this process may use the UCX transport: `ucxx` installed and not turned off."""
    return os.environ.get("PDSERVE_UCX", "1") != "0" and ucxx_importable()


PLAINTEXT_ONLY = ("UCX carries KV bytes in plaintext and unauthenticated, and internal TLS is "
                  "on: UCX runs only with --insecure-internal")


def ucx_allowed(security: tls.Security | None = None) -> bool:
    """Whether UCX may carry this process's bytes: internal TLS off (`security`, default this
    process's setting) and UCX available."""
    security = security if security is not None else tls.current()
    return security.insecure and ucx_available()


def _split(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise TransportError(f"ucx address must be 'host:port', got {address!r}")
    return host.strip("[]"), int(port)


class _Peer:
    def __init__(self, ep) -> None:
        self.ep = ep
        self.lock = asyncio.Lock()  # used on the UCX loop only


class UcxTransport:
    """Writes and reads DRAM extents of nodes that serve UCX (`Extent.ucx_address`)."""

    kind = "ucx"

    def __init__(self, connect_timeout_s: float = 5.0, request_timeout_s: float = 60.0,
                 security: tls.Security | None = None) -> None:
        if not (security if security is not None else tls.current()).insecure:
            raise TransportUnavailable(f"UcxTransport unavailable: {PLAINTEXT_ONLY}")
        if not ucx_available():
            raise TransportUnavailable("UcxTransport unavailable: ucxx is not installed "
                                       "(pip install ucxx-cu12) or PDSERVE_UCX=0")
        self._ucxx = ucx_loop.import_ucxx()
        self.connect_timeout_s = connect_timeout_s
        self.request_timeout_s = request_timeout_s
        self._peers: dict[str, _Peer] = {}
        self._lock = threading.Lock()
        self._closed = False

    # ---- endpoints (on the UCX loop) ---------------------------------------------------------
    async def _peer(self, address: str) -> _Peer:
        peer = self._peers.get(address)
        if peer is not None and not peer.ep.closed:
            return peer
        host, port = _split(address)
        ep = await self._ucxx.create_endpoint(host, port,
                                              connect_timeout=self.connect_timeout_s)
        peer = _Peer(ep)
        self._peers[address] = peer
        return peer

    async def _exchange(self, address: str, op: UcxOp, extent: Extent, view: memoryview):
        peer = await self._peer(address)
        async with peer.lock:
            try:
                await peer.ep.send(encode_request(op, extent.segment_id, extent.offset,
                                                  len(view)))
                reply = bytearray(MESSAGE_BYTES)
                await peer.ep.recv(reply)
                status, message = decode_reply(reply)
                if status != Status.OK:
                    raise remote_error(status, message)
                if op == UcxOp.READ:
                    await peer.ep.recv(view)
                else:
                    await peer.ep.send(view)
                    await peer.ep.recv(reply)
                    status, message = decode_reply(reply)
                    if status != Status.OK:
                        raise remote_error(status, message)
            except TransportError:
                raise
            except Exception as e:  # a UCX error: the endpoint is unusable, drop it
                self._peers.pop(address, None)
                if not peer.ep.closed:
                    peer.ep.abort()
                raise TransportError(f"ucx {address}: {type(e).__name__}: {e}") from None

    def _call(self, op: UcxOp, extent: Extent, view: memoryview) -> None:
        if self._closed:
            raise TransportError("UcxTransport is closed")
        if extent.tier != "dram" or not extent.ucx_address:
            raise TransportUnavailable(f"extent {extent.segment_id}@{extent.offset} "
                                       f"({extent.tier}) is not served over UCX")
        try:
            ucx_loop.run(self._exchange(extent.ucx_address, op, extent, view),
                         timeout_s=self.request_timeout_s)
        except TimeoutError:
            raise TransportError(f"ucx {extent.ucx_address}: no answer within "
                                 f"{self.request_timeout_s}s") from None

    # ---- Transport ---------------------------------------------------------------------------
    def write(self, extent: Extent, src: object) -> None:
        self._call(UcxOp.WRITE, extent, byte_view(src, extent, writable=False))

    def read_into(self, extent: Extent, dst: object) -> None:
        self._call(UcxOp.READ, extent, byte_view(dst, extent, writable=True))

    def ping(self, ucx_address: str) -> None:
        async def ping():
            peer = await self._peer(ucx_address)
            async with peer.lock:
                await peer.ep.send(encode_request(UcxOp.PING))
                reply = bytearray(MESSAGE_BYTES)
                await peer.ep.recv(reply)
                return decode_reply(reply)

        status, message = ucx_loop.run(ping(), timeout_s=self.request_timeout_s)
        if status != Status.OK:
            raise remote_error(status, message)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True

        async def close_all():
            for peer in list(self._peers.values()):
                if not peer.ep.closed:
                    peer.ep.abort()
            self._peers.clear()

        try:
            ucx_loop.run(close_all(), timeout_s=5)
        except Exception:  # noqa: BLE001 - closing is best effort
            pass
