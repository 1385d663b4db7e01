"""The storage node's data plane: byte ranges of its segments and SSD objects over raw TCP.

Owns the listening socket, one thread per connection (at most `max_connections`; one more gets
a BUSY reply and is closed), admitting each connection (under mutual TLS: the handshake, in the
connection's thread within the frame timeout, then `access.decide` on the peer certificate's
kind, before any request is read; a refusal is counted in `failures` and closes that connection
only; with `--insecure-internal`: plaintext, anyone who reaches the port), and executing
requests of the `protocol`: payloads are received with `recv_into` straight into the segment's
memory and sent from it (`sendmsg`; under TLS decrypted into it and encrypted from it), so a
byte is copied only by the kernel or the cipher. Every header is validated; a bad request gets
an error status and the server keeps serving, a malformed or truncated frame closes that
connection only.
Must not know keys, allocation or leases: the master decides which range is whose, so two
writers never share a range and no locking is needed here. A WRITE cut off mid-payload leaves
its range partly written; the master never commits such a put, so nobody reads it. Must not
decide who may connect (`security.access` does).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Callable

from pdserve.core.identity import NODE
from pdserve.kvstore.node.protocol import (
    MAX_ERROR_BYTES, MAX_NAME_BYTES, PAYLOAD_OPS, REQUEST, Op, ProtocolError, Status,
    decode_request, encode_reply, recv_exact, send_all, send_file,
)
from pdserve.kvstore.node.segment import SegmentError, ShmSegment
from pdserve.kvstore.node.ssd import (
    InvalidObjectId, SsdError, SsdFullError, SsdObjectNotFound, SsdTier,
)
from pdserve.security import access, failures, pki, tls

log = logging.getLogger(__name__)

# SSD payloads pass through a per-connection scratch buffer of this size (the file is not mapped).
SSD_CHUNK_BYTES = 4 << 20
# A rejected WRITE's payload is read and dropped (keeping the connection) up to this size; a
# bigger one closes the connection instead, so a lying header cannot pin a thread for long.
MAX_DRAIN_BYTES = 1 << 30
_OPS = frozenset(int(op) for op in Op)
# Under TLS a BUSY reply needs a handshake: on at most this many extra threads (never on the
# accept loop, which a silent client would stall), each within BUSY_TIMEOUT_S; past them a
# connection beyond the limit is closed unanswered.
BUSY_HANDSHAKES, BUSY_TIMEOUT_S = 4, 1.0
TLS_HANDSHAKE = "tls_handshake"  # the failure counter's reason for a handshake that failed
REFUSAL_LOG_INTERVAL_S = 60.0  # one log line per reason per minute; the counter counts all


class _Reject(Exception):
    """A request is refused with `status`; `close` when the connection cannot continue."""

    def __init__(self, status: Status, message: str, close: bool = False,
                 payload_read: bool = False):
        super().__init__(message)
        self.status, self.close = status, close
        # True once the request's payload has been consumed: nothing left to drain.
        self.payload_read = payload_read


def parse_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"address must be 'host:port', got {address!r}")
    return host.strip("[]"), int(port)


class DataServer:
    """Serves `segments` (by segment id) and optionally an SSD tier on `address` ("host:port"),
    as `security` says (default: this process's setting, `tls.current()`): mutual TLS
    presenting the node certificate, or plaintext."""

    def __init__(self, segments: dict[str, ShmSegment], ssd: SsdTier | None, address: str,
                 max_connections: int = 64, frame_timeout_s: float = 30.0,
                 security: tls.Security | None = None):
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        if not frame_timeout_s > 0:
            raise ValueError(f"frame_timeout_s must be > 0, got {frame_timeout_s}")
        self._segments = dict(segments)
        self._ssd = ssd
        self._address = parse_address(address)
        self._frame_timeout_s = frame_timeout_s
        self.security = security if security is not None else tls.current()
        self._tls: tls.MutualTls | None = None if self.security.insecure else self.security
        self._slots = threading.BoundedSemaphore(max_connections)
        self._busy = threading.BoundedSemaphore(BUSY_HANDSHAKES)
        self._logged: dict[str, float] = {}  # refusal reason -> when last logged
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        self._listener: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self.address = ""

    def start(self) -> str:
        """Binds and starts accepting; returns the bound "host:port" (port 0 picks a free one)."""
        host, port = self._address
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        # A restarted node rebinds its port at once, despite old connections in TIME_WAIT.
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((host, port))
            listener.listen(128)
        except OSError:
            listener.close()
            raise
        self._listener = listener
        bound_port = listener.getsockname()[1]
        shown_host = f"[{host}]" if family == socket.AF_INET6 else host
        self.address = f"{shown_host}:{bound_port}"
        self._accept_thread = threading.Thread(
            target=self._accept_loop, name=f"kv-data-accept-{bound_port}", daemon=True)
        self._accept_thread.start()
        return self.address

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stops accepting, closes every connection and waits for their threads. Idempotent."""
        self._stopping.set()
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
            except OSError:
                pass
            self._listener.close()
        if self._accept_thread is not None:
            self._accept_thread.join(timeout_s)  # first: no connection is added after this
        with self._lock:
            conns, threads = list(self._conns), list(self._threads)
        for conn in conns:
            try:
                # Wakes a thread blocked in recv or a handshake. socket's own shutdown: an
                # SSLSocket's would drop its TLS state under the thread still using it.
                socket.socket.shutdown(conn, socket.SHUT_RDWR)
            except OSError:
                pass
        for t in threads:
            t.join(timeout_s)

    def __enter__(self) -> DataServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- connections ------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stopping.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # listener shut down by stop()
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._slots.acquire(blocking=False):
                self._spawn(self._serve_connection, conn, self._slots, self._frame_timeout_s)
            elif self._tls is None:
                self._refuse(conn)  # plaintext: answered at once
                conn.close()
            elif self._busy.acquire(blocking=False):
                self._spawn(self._refuse, conn, self._busy, BUSY_TIMEOUT_S)
            else:
                conn.close()

    def _spawn(self, body: Callable[[socket.socket], None], conn: socket.socket,
               slots: threading.BoundedSemaphore, handshake_s: float) -> None:
        """Runs `body(conn)` on a thread of its own once the peer is admitted; `slots` is
        released when it ends. Under TLS `conn` is wrapped here (no I/O: the handshake is the
        thread's), so `stop()` sees the object the thread uses from the start."""
        if self._tls is not None:
            try:
                conn = self._tls.server_context(NODE).wrap_socket(
                    conn, server_side=True, do_handshake_on_connect=False)
            except (OSError, pki.PkiError) as e:  # unreadable certificates: refuse, keep going
                log.error("data plane: cannot serve TLS: %s", e)
                conn.close()
                slots.release()
                return
        t = threading.Thread(target=self._run, args=(body, conn, slots, handshake_s),
                             name="kv-data-conn", daemon=True)
        with self._lock:
            self._conns.add(conn)
            self._threads.add(t)
        t.start()

    def _run(self, body: Callable[[socket.socket], None], conn: socket.socket,
             slots: threading.BoundedSemaphore, handshake_s: float) -> None:
        try:
            if self._admit(conn, handshake_s):
                body(conn)
        except (OSError, ProtocolError):
            pass  # truncated frame, timeout or reset: this connection only
        finally:
            conn.close()
            with self._lock:
                self._conns.discard(conn)
                self._threads.discard(threading.current_thread())
            slots.release()

    def _admit(self, conn: socket.socket, handshake_s: float) -> bool:
        """Plaintext: yes. TLS: the handshake within `handshake_s` (the client's certificate
        checked against the cluster CA), then the peer's kind against the data plane's rule; a
        refusal is counted, and a certificate of the wrong kind answered DENIED. Nothing is
        read before."""
        if self._tls is None:
            return True
        conn.settimeout(handshake_s)  # a silent client cannot pin this thread
        try:
            conn.do_handshake()  # type: ignore[attr-defined]
        except OSError as e:  # ssl.SSLError, a timeout, a reset
            if not self._stopping.is_set():
                why = getattr(e, "reason", None) or e
                self._refused(conn, TLS_HANDSHAKE, f"TLS handshake failed: {why}")
            return False
        verdict = access.decide(access.DATA_PLANE, "*",
                                access.Caller(identity=tls.peer_identity(conn)))
        if verdict.allowed:
            return True
        self._refused(conn, verdict.reason, verdict.message)
        self._refuse(conn, Status.DENIED, verdict.message.encode()[:MAX_ERROR_BYTES])
        return False

    def _refused(self, conn: socket.socket, reason: str, why: str) -> None:
        failures.record(access.DATA_PLANE, reason)
        now = time.monotonic()
        with self._lock:
            if now - self._logged.get(reason, -1e9) < REFUSAL_LOG_INTERVAL_S:
                return
            self._logged[reason] = now
        try:
            peer = "%s:%s" % conn.getpeername()[:2]
        except OSError:
            peer = "a peer"
        log.warning("data plane: refused %s (%s): %s (the next %.0fs of these are counted, "
                    "not logged)", peer, reason, why, REFUSAL_LOG_INTERVAL_S)

    @staticmethod
    def _refuse(conn: socket.socket, status: Status = Status.BUSY,
                message: bytes = b"too many connections") -> None:
        """Answers `status` unasked, best effort (the caller closes the connection)."""
        try:
            conn.settimeout(BUSY_TIMEOUT_S)
            send_all(conn, encode_reply(status, len(message)), message)
        except OSError:
            pass  # the peer went already: it is refused either way

    def _serve_connection(self, conn: socket.socket) -> None:
        header = bytearray(REQUEST.size)
        scratch: list[bytearray] = []  # SSD chunk buffer, made on first use
        while not self._stopping.is_set():
            conn.settimeout(None)  # idle between requests: a pooled connection may wait long
            first = conn.recv_into(header, REQUEST.size)
            if first == 0:
                return  # clean close between frames
            conn.settimeout(self._frame_timeout_s)  # a started frame must finish in time
            recv_exact(conn, memoryview(header)[first:])
            try:
                self._handle(conn, header, scratch)
            except _Reject as r:
                message = str(r).encode()[:MAX_ERROR_BYTES]
                send_all(conn, encode_reply(r.status, len(message)), message)
                if r.close:
                    return

    # ---- one request ------------------------------------------------------------------------

    def _handle(self, conn: socket.socket, header: bytearray, scratch: list[bytearray]) -> None:
        try:
            op, name_len, offset, length = decode_request(header)
        except ProtocolError as e:
            raise _Reject(Status.BAD_REQUEST, str(e), close=True) from None
        if op not in _OPS:
            raise _Reject(Status.BAD_REQUEST, f"unknown op {op}", close=True)
        if name_len > MAX_NAME_BYTES:
            raise _Reject(Status.BAD_REQUEST, f"name of {name_len} bytes > {MAX_NAME_BYTES}",
                          close=True)
        name_raw = bytearray(name_len)
        recv_exact(conn, memoryview(name_raw))
        try:
            self._dispatch(conn, Op(op), name_raw, offset, length, scratch)
        except _Reject as r:
            if Op(op) in PAYLOAD_OPS and not r.close and not r.payload_read:
                if length > MAX_DRAIN_BYTES:
                    r.close = True
                else:
                    self._drain(conn, length, scratch)
            raise

    def _dispatch(self, conn: socket.socket, op: Op, name_raw: bytearray, offset: int,
                  length: int, scratch: list[bytearray]) -> None:
        try:
            name = name_raw.decode()
        except UnicodeDecodeError:
            raise _Reject(Status.BAD_REQUEST, "name is not UTF-8") from None
        if op is Op.PING:
            send_all(conn, encode_reply(Status.OK))
        elif op is Op.WRITE:
            recv_exact(conn, self._segment_view(name, offset, length))
            send_all(conn, encode_reply(Status.OK))
        elif op is Op.READ:
            view = self._segment_view(name, offset, length)
            send_all(conn, encode_reply(Status.OK, length), view)
        elif op is Op.SSD_WRITE:
            self._ssd_write(conn, name, offset, length, scratch)
        elif op is Op.SSD_READ:
            self._ssd_read(conn, name, offset, length, scratch)
        else:
            assert op is Op.SSD_REMOVE
            self._ssd_call(lambda ssd: ssd.remove(name))
            send_all(conn, encode_reply(Status.OK))

    def _segment_view(self, segment_id: str, offset: int, length: int) -> memoryview:
        segment = self._segments.get(segment_id)
        if segment is None:
            raise _Reject(Status.NOT_FOUND, f"no segment {segment_id!r} on this node")
        if offset + length > segment.size_bytes:
            raise _Reject(Status.OUT_OF_RANGE,
                          f"range [{offset}, {offset + length}) outside segment {segment_id!r} "
                          f"of {segment.size_bytes} bytes")
        try:
            return segment.view(offset, length)
        except SegmentError as e:  # closed under us: the node is stopping
            raise _Reject(Status.INTERNAL, str(e)) from None

    def _ssd_call(self, fn: Callable[[SsdTier], object]):
        if self._ssd is None:
            raise _Reject(Status.NOT_FOUND, "this node has no SSD tier")
        try:
            return fn(self._ssd)
        except SsdObjectNotFound as e:
            raise _Reject(Status.NOT_FOUND, str(e)) from None
        except SsdFullError as e:
            raise _Reject(Status.NO_SPACE, str(e)) from None
        except InvalidObjectId as e:
            raise _Reject(Status.BAD_REQUEST, str(e)) from None
        except (SsdError, OSError) as e:
            raise _Reject(Status.INTERNAL, f"SSD tier: {e}") from None

    def _ssd_write(self, conn: socket.socket, obj_id: str, offset: int, length: int,
                   scratch: list[bytearray]) -> None:
        if offset != 0:
            raise _Reject(Status.BAD_REQUEST, "SSD_WRITE stores a whole object: offset must be 0")
        writer = self._ssd_call(lambda ssd: ssd.begin_write(obj_id, length))
        chunk = self._scratch(scratch)
        received = 0
        try:
            while received < length:
                n = min(len(chunk), length - received)
                recv_exact(conn, chunk[:n])  # socket errors propagate: the connection is lost
                received += n
                try:
                    writer.write_at(received - n, chunk[:n])
                except (SsdError, OSError) as e:
                    self._drain(conn, length - received, scratch)
                    raise _Reject(Status.INTERNAL, f"SSD write of {obj_id!r} failed: {e}",
                                  payload_read=True) from None
            try:
                writer.commit()
            except (SsdError, OSError) as e:
                raise _Reject(Status.INTERNAL, f"SSD write of {obj_id!r} failed: {e}",
                              payload_read=True) from None
        finally:
            writer.abort()  # a no-op after commit
        send_all(conn, encode_reply(Status.OK))

    def _ssd_read(self, conn: socket.socket, obj_id: str, offset: int, length: int,
                  scratch: list[bytearray]) -> None:
        f = self._ssd_call(lambda ssd: ssd.open(obj_id))
        with f:
            size = os.fstat(f.fileno()).st_size  # of the version opened, even if replaced since
            if offset + length > size:
                raise _Reject(Status.OUT_OF_RANGE, f"range [{offset}, {offset + length}) "
                                                   f"outside SSD object {obj_id!r} of {size} bytes")
            send_all(conn, encode_reply(Status.OK, length))
            if length:  # TLS must see the bytes: they pass through the scratch buffer
                send_file(conn, f, offset, length, self._scratch(scratch) if self._tls else None)

    @staticmethod
    def _scratch(scratch: list[bytearray]) -> memoryview:
        if not scratch:
            scratch.append(bytearray(SSD_CHUNK_BYTES))
        return memoryview(scratch[0])

    def _drain(self, conn: socket.socket, length: int, scratch: list[bytearray]) -> None:
        chunk = self._scratch(scratch)
        while length > 0:
            n = min(len(chunk), length)
            recv_exact(conn, chunk[:n])
            length -= n
