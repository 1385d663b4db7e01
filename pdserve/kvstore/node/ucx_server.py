"""The storage node's UCX data plane: byte ranges of its DRAM segments over a `ucxx` listener.

Owns the listener and one coroutine per connected endpoint, serving the `ucx_protocol`: payloads
are sent from and received into the segment's memory (UCX picks RDMA, shared memory or TCP for
the bytes; with no RDMA hardware, a listener connection moves them over TCP). Only the DRAM tier
is served here: SSD objects are files the TCP data server reads and writes. Like the TCP server,
it must not know keys, allocation or leases, and a bad request gets an error status while the
node keeps serving; a malformed control message closes that endpoint only.
UCX here has no TLS: anyone who reaches the listener reads and writes the segment in plaintext.
So it serves only where internal TLS is off (`--insecure-internal`); under mutual TLS it
refuses to start. Must not run in a cluster that encrypts.
"""

from __future__ import annotations

import asyncio
import logging

from pdserve.kvstore.node.protocol import Status
from pdserve.kvstore.node.segment import SegmentError, ShmSegment
from pdserve.kvstore.node.ucx_protocol import (
    MESSAGE_BYTES,
    UcxOp,
    UcxProtocolError,
    decode_request,
    encode_reply,
)
from pdserve.kvstore.transport import ucx_loop
from pdserve.kvstore.transport.ucx import PLAINTEXT_ONLY
from pdserve.security import tls

log = logging.getLogger(__name__)


class UcxDataServer:
    """Serves `segments` (by segment id) to UCX endpoints on `port` (0: any free port), only
    where `security` (default: this process's setting) is `--insecure-internal`; else
    PermissionError."""

    def __init__(self, segments: dict[str, ShmSegment], host: str, port: int = 0,
                 max_connections: int = 64, security: tls.Security | None = None) -> None:
        if not (security if security is not None else tls.current()).insecure:
            raise PermissionError(f"ucx_port: {PLAINTEXT_ONLY}")
        self._segments = dict(segments)
        self._host = host
        self._port = port
        self._slots = max_connections
        self._listener = None
        self._endpoints: set = set()
        self.address = ""

    def start(self) -> str:
        """Starts listening; returns "host:port" for clients (the listener binds every address)."""
        ucxx = ucx_loop.import_ucxx()

        async def listen():
            return ucxx.create_listener(self._serve, self._port or None)

        self._listener = ucx_loop.run(listen(), timeout_s=30)
        shown = f"[{self._host}]" if ":" in self._host else self._host
        self.address = f"{shown}:{self._listener.port}"
        return self.address

    def stop(self) -> None:
        """Closes the listener and every endpoint. Idempotent."""
        if self._listener is None:
            return

        async def close():
            self._listener.close()
            for ep in list(self._endpoints):
                ep.abort()

        try:
            ucx_loop.run(close(), timeout_s=5)
        except Exception as e:  # noqa: BLE001 - stopping must not fail the node's shutdown
            log.warning("closing the UCX listener: %s", e)
        self._listener = None

    async def _serve(self, ep) -> None:
        if len(self._endpoints) >= self._slots:
            await ep.send(encode_reply(Status.BUSY, "node at its UCX connection limit"))
            await ep.close()
            return
        self._endpoints.add(ep)
        msg = bytearray(MESSAGE_BYTES)
        try:
            while True:
                await ep.recv(msg)
                op, sid, offset, size = decode_request(msg)
                if op == UcxOp.PING:
                    await ep.send(encode_reply(Status.OK))
                    continue
                segment = self._segments.get(sid)
                if segment is None:
                    await ep.send(encode_reply(Status.NOT_FOUND, f"unknown segment {sid!r}"))
                    continue
                try:
                    view = segment.view(offset, size)
                except SegmentError as e:
                    await ep.send(encode_reply(Status.OUT_OF_RANGE, str(e)))
                    continue
                with view:
                    await ep.send(encode_reply(Status.OK))
                    if op == UcxOp.READ:
                        await ep.send(view)
                    else:
                        await ep.recv(view)
                        await ep.send(encode_reply(Status.OK))
        except UcxProtocolError as e:
            log.warning("UCX endpoint sent a malformed message, closing it: %s", e)
        except (asyncio.CancelledError, Exception) as e:  # noqa: BLE001 - a peer went away
            log.debug("UCX endpoint closed: %s", type(e).__name__)
        finally:
            self._endpoints.discard(ep)
            if not ep.closed:
                ep.abort()
