"""Cross-host transport over the node data protocol on TCP (works everywhere), in mutual TLS.

Owns a small pool of persistent connections per node address (at most
`max_connections_per_node` in use at once; callers beyond that wait up to `io_timeout_s`), each
opened as this process's internal TLS says (mutual TLS: this process's certificate presented,
the node's checked to be a node's of the cluster whatever the address, the handshake within
`connect_timeout_s`; with `--insecure-internal`, plaintext), the request/reply exchange
(header and payload sent straight from the caller's buffer, received straight into it; TLS
encrypts from and decrypts into it) and the retry rule: a broken connection is replaced once,
then the call raises TransportError. Must not map memory or know keys; error replies from the
node (DENIED included: this process's kind may not use the data plane) are raised as typed
`RemoteError`s and never retried (they would recur).
"""

from __future__ import annotations

import socket
import threading

from pdserve.core.identity import NODE, server_name
from pdserve.kvstore.node.protocol import (
    MAX_ERROR_BYTES,
    REPLY,
    Op,
    ProtocolError,
    Status,
    encode_request,
    recv_exact,
    send_all,
)
from pdserve.kvstore.transport.base import (
    Extent,
    RemoteError,
    TransportError,
    byte_view,
    remote_error,
)
from pdserve.security import tls

# After these replies the node has closed (or will close) the connection.
_CLOSING_STATUSES = frozenset({Status.BAD_REQUEST, Status.BUSY, Status.DENIED})


class _Pool:
    """Idle connections to one node address, and the permits that bound connections in use."""

    def __init__(self, max_connections: int):
        self.permits = threading.BoundedSemaphore(max_connections)
        self.idle: list[socket.socket] = []
        self.lock = threading.Lock()


class TcpTransport:
    """Writes and reads extents on any node through its data server; thread-safe. `security`:
    how to connect (default: this process's setting, `tls.current()`, read once here)."""

    kind = "tcp"

    def __init__(self, max_connections_per_node: int = 4, connect_timeout_s: float = 5.0,
                 io_timeout_s: float = 30.0, security: tls.Security | None = None):
        if max_connections_per_node < 1:
            raise ValueError(
                f"max_connections_per_node must be >= 1, got {max_connections_per_node}")
        if not connect_timeout_s > 0 or not io_timeout_s > 0:
            raise ValueError(f"timeouts must be > 0, got connect_timeout_s={connect_timeout_s}, "
                             f"io_timeout_s={io_timeout_s}")
        self._max_connections = max_connections_per_node
        self._connect_timeout_s = connect_timeout_s
        self._io_timeout_s = io_timeout_s
        self.security = security if security is not None else tls.current()
        self._pools: dict[str, _Pool] = {}
        self._lock = threading.Lock()
        self._closed = False

    # ---- the Transport protocol -------------------------------------------------------------

    def write(self, extent: Extent, src: object) -> None:
        view = byte_view(src, extent, writable=False)
        if extent.tier == "ssd":
            header = encode_request(Op.SSD_WRITE, extent.ssd_object_id, 0, len(view))
        else:
            header = encode_request(Op.WRITE, extent.segment_id, extent.offset, len(view))
        self._call(extent.data_address, header, payload=view, dst=None)

    def read_into(self, extent: Extent, dst: object) -> None:
        view = byte_view(dst, extent, writable=True)
        if extent.tier == "ssd":
            header = encode_request(Op.SSD_READ, extent.ssd_object_id, 0, len(view))
        else:
            header = encode_request(Op.READ, extent.segment_id, extent.offset, len(view))
        self._call(extent.data_address, header, payload=None, dst=view)

    def remove_ssd(self, extent: Extent) -> None:
        """Deletes the SSD file of an SSD-tier extent on its node (RemoteNotFound if none)."""
        self._call(extent.data_address, encode_request(Op.SSD_REMOVE, extent.ssd_object_id),
                   payload=None, dst=None)

    def ping(self, data_address: str) -> None:
        """One round trip to a node's data server; TransportError if it does not answer."""
        self._call(data_address, encode_request(Op.PING, ""), payload=None, dst=None)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            with pool.lock:
                idle, pool.idle = pool.idle, []
            for sock in idle:
                sock.close()

    def __enter__(self) -> TcpTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- connections ------------------------------------------------------------------------

    def _pool(self, address: str) -> _Pool:
        with self._lock:
            if self._closed:
                raise TransportError("TcpTransport is closed")
            pool = self._pools.get(address)
            if pool is None:
                pool = self._pools[address] = _Pool(self._max_connections)
            return pool

    def _connect(self, address: str) -> socket.socket:
        host, sep, port = address.rpartition(":")
        if not sep or not port.isdigit():
            raise TransportError(f"data address must be 'host:port', got {address!r}")
        # The context first: a fresh one after the certificates rotate on disk.
        context = None if self.security.insecure else self.security.client_context()
        sock = socket.create_connection((host.strip("[]"), int(port)),
                                        timeout=self._connect_timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if context is not None:  # the handshake, within the connect timeout; closed if it fails
            sock = context.wrap_socket(sock, server_hostname=server_name(NODE))
        sock.settimeout(self._io_timeout_s)
        return sock

    def _call(self, address: str, header: bytes, payload: memoryview | None,
              dst: memoryview | None) -> None:
        pool = self._pool(address)
        if not pool.permits.acquire(timeout=self._io_timeout_s):
            raise TransportError(f"all {self._max_connections} connections to {address} stayed "
                                 f"busy for {self._io_timeout_s}s")
        try:
            problem: Exception | None = None
            for _attempt in range(2):  # a broken connection is replaced once
                with pool.lock:
                    sock = pool.idle.pop() if pool.idle else None
                try:
                    if sock is None:
                        sock = self._connect(address)
                    self._exchange(sock, header, payload, dst)
                except RemoteError as e:
                    if e.status in _CLOSING_STATUSES:
                        sock.close()
                    else:
                        self._keep(pool, sock)
                    raise
                except (OSError, ProtocolError) as e:
                    if sock is not None:
                        sock.close()
                    problem = e
                    continue
                self._keep(pool, sock)
                return
            raise TransportError(f"data server {address}: {problem!r}") from problem
        finally:
            pool.permits.release()

    def _keep(self, pool: _Pool, sock: socket.socket) -> None:
        with pool.lock:
            if self._closed:
                sock.close()
            else:
                pool.idle.append(sock)

    @staticmethod
    def _exchange(sock: socket.socket, header: bytes, payload: memoryview | None,
                  dst: memoryview | None) -> None:
        if payload is not None:
            send_all(sock, header, payload)
        else:
            send_all(sock, header)
        reply = bytearray(REPLY.size)
        recv_exact(sock, memoryview(reply))
        status, length = REPLY.unpack(reply)
        if status != Status.OK:
            if length > MAX_ERROR_BYTES:
                raise ProtocolError(f"error reply of {length} bytes > {MAX_ERROR_BYTES}")
            message = bytearray(length)
            recv_exact(sock, memoryview(message))
            raise remote_error(status, message.decode(errors="replace"))
        want = len(dst) if dst is not None else 0
        if length != want:
            raise ProtocolError(f"reply of {length} bytes, expected {want}")
        if dst is not None:
            recv_exact(sock, dst)
