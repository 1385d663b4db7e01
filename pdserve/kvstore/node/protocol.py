"""The storage node's data protocol: frame layouts and the socket loops that move them.

Owns the byte format shared by `data_server` (node side) and `transport.tcp` (client side), and
the copy-free socket helpers both use (receive into, send from, send a file range), on a plain
socket or a TLS one (`ssl.SSLSocket`: the data plane under mutual TLS). Must not know segments,
SSD files, connection pools or who may connect (`data_server` admits a TLS peer before any
frame is read).

A request is a 24-byte header, then the name, then (WRITE and SSD_WRITE only) the payload:

    offset  size  field
    0       2     magic b"KV"
    2       1     version (1)
    3       1     op: 1 PING, 2 WRITE, 3 READ, 4 SSD_WRITE, 5 SSD_READ, 6 SSD_REMOVE
    4       2     name_len: bytes of the UTF-8 name that follows (segment id or SSD object id)
    6       2     zero
    8       8     offset (bytes into the segment or object)
    16      8     length (bytes to write or read)
    24      name_len   name
    ...     length     payload (WRITE, SSD_WRITE)

A reply is a 16-byte header, then `length` bytes: the data of a READ/SSD_READ when status is OK,
else a UTF-8 error message (status != OK):

    0       1     status: 0 OK, 1 BAD_REQUEST, 2 NOT_FOUND, 3 OUT_OF_RANGE, 4 NO_SPACE, 5 BUSY,
                  6 INTERNAL, 7 DENIED
    1       7     zero
    8       8     length

All integers are little-endian. One request is answered before the next is read; a connection is
reused for any number of requests. Frames the server cannot resynchronise after (bad magic or
version, unknown op, a name too long) get a BAD_REQUEST reply and the connection is closed; other
errors (unknown segment, out of range, SSD full) keep it open, after the server has drained a
WRITE's payload.

Under mutual TLS the same frames travel inside the TLS stream. A peer whose certificate is of a
kind the data plane does not admit gets one DENIED reply, unasked, right after the handshake
(the message says which kind and what is admitted), and the connection is closed; one whose
handshake fails gets nothing.
"""

from __future__ import annotations

import enum
import os
import socket
import ssl
import struct

MAGIC = b"KV"
VERSION = 1
REQUEST = struct.Struct("<2sBBHxxQQ")
REPLY = struct.Struct("<BxxxxxxxQ")
MAX_NAME_BYTES = 1024
MAX_ERROR_BYTES = 4096
# Under TLS, buffers up to this many bytes in all are joined and sent as one record (a header
# and a small payload: one write, one TCP segment); a bigger payload goes out from its own
# memory after the header, never copied.
TLS_JOIN_BYTES = 64 << 10


class Op(enum.IntEnum):
    PING = 1
    WRITE = 2
    READ = 3
    SSD_WRITE = 4
    SSD_READ = 5
    SSD_REMOVE = 6


# Ops whose request carries `length` bytes of payload after the name.
PAYLOAD_OPS = frozenset({Op.WRITE, Op.SSD_WRITE})


class Status(enum.IntEnum):
    OK = 0
    BAD_REQUEST = 1
    NOT_FOUND = 2
    OUT_OF_RANGE = 3
    NO_SPACE = 4
    BUSY = 5
    INTERNAL = 6
    DENIED = 7  # mutual TLS: the peer's kind may not use the data plane


class ProtocolError(Exception):
    """A frame does not follow the protocol; the connection it came on cannot be trusted."""


class ConnectionClosed(ConnectionError):
    """The peer closed the connection; `received` bytes of the expected frame part had come."""

    def __init__(self, message: str, received: int):
        super().__init__(message)
        self.received = received


def encode_request(op: int, name: str, offset: int = 0, length: int = 0) -> bytes:
    """Header plus name of one request (the payload, if any, is sent after it)."""
    raw = name.encode()
    if len(raw) > MAX_NAME_BYTES:
        raise ProtocolError(f"name of {len(raw)} bytes exceeds {MAX_NAME_BYTES}")
    return REQUEST.pack(MAGIC, VERSION, op, len(raw), offset, length) + raw


def decode_request(header: bytes | bytearray | memoryview) -> tuple[int, int, int, int]:
    """(op, name_len, offset, length) of a request header; ProtocolError on bad magic/version."""
    magic, version, op, name_len, offset, length = REQUEST.unpack(header)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {bytes(magic)!r}")
    if version != VERSION:
        raise ProtocolError(f"unsupported protocol version {version}")
    return op, name_len, offset, length


def encode_reply(status: int, length: int = 0) -> bytes:
    return REPLY.pack(status, length)


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fills `view` from `sock` (recv_into, no intermediate bytes: TLS decrypts into `view`
    itself); ConnectionClosed on EOF."""
    # An SSLSocket takes no flags; it returns at most one TLS record (16 KiB) per call.
    flags = 0 if isinstance(sock, ssl.SSLSocket) else socket.MSG_WAITALL
    got, want = 0, len(view)
    while got < want:
        n = sock.recv_into(view[got:], want - got, flags)
        if n == 0:
            raise ConnectionClosed(f"peer closed after {got} of {want} bytes", got)
        got += n


def send_all(sock: socket.socket, *buffers: bytes | memoryview) -> None:
    """Sends every buffer in order: scatter-gather `sendmsg` on a plain socket (no joining
    copy); on a TLS socket, which has no `sendmsg`, `sendall` per buffer (TLS encrypts from
    the buffer itself), small ones joined first."""
    views = [memoryview(b).cast("B") for b in buffers if len(b)]
    if isinstance(sock, ssl.SSLSocket):
        _send_all_tls(sock, views)
        return
    while views:
        sent = sock.sendmsg(views)
        # Drop what went out; a short send leaves the tail of one buffer.
        while views and sent >= len(views[0]):
            sent -= len(views[0])
            views.pop(0)
        if sent:
            views[0] = views[0][sent:]


def send_file(sock: socket.socket, f, offset: int, length: int,
              scratch: memoryview | None = None) -> None:
    """Sends `length` bytes of file `f` from `offset`: `sendfile` on a plain socket (a kernel
    copy, page cache to socket); on a TLS socket, which must see the bytes to encrypt them,
    read into `scratch` piece by piece and sent from it (SSLSocket.sendfile would go 8 KiB at
    a time)."""
    if not isinstance(sock, ssl.SSLSocket):
        sock.sendfile(f, offset, length)
        return
    assert scratch is not None, "a TLS socket needs a scratch buffer"
    end = offset + length
    while offset < end:
        n = os.preadv(f.fileno(), [scratch[:min(len(scratch), end - offset)]], offset)
        if n <= 0:
            raise OSError(f"the file ended at {offset} of {end} bytes while sent")
        send_all(sock, scratch[:n])
        offset += n


def _send_all_tls(sock: ssl.SSLSocket, views: list[memoryview]) -> None:
    if sum(len(v) for v in views) <= TLS_JOIN_BYTES:
        views = [memoryview(b"".join(views))] if len(views) > 1 else views
    elif len(views) > 2:  # header and name joined; the payload (last) sent in place
        views = [memoryview(b"".join(views[:-1])), views[-1]]
    for view in views:
        sock.sendall(view)
