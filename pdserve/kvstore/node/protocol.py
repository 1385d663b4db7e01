"""The storage node's data protocol: frame layouts and the socket loops that move them.

Owns the byte format shared by `data_server` (node side) and `transport.tcp` (client side), and
the two copy-free socket helpers both use. Must not know segments, SSD files or connection pools.

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
                  6 INTERNAL
    1       7     zero
    8       8     length

All integers are little-endian. One request is answered before the next is read; a connection is
reused for any number of requests. Frames the server cannot resynchronise after (bad magic or
version, unknown op, a name too long) get a BAD_REQUEST reply and the connection is closed; other
errors (unknown segment, out of range, SSD full) keep it open, after the server has drained a
WRITE's payload.
"""

from __future__ import annotations

import enum
import socket
import struct

MAGIC = b"KV"
VERSION = 1
REQUEST = struct.Struct("<2sBBHxxQQ")
REPLY = struct.Struct("<BxxxxxxxQ")
MAX_NAME_BYTES = 1024
MAX_ERROR_BYTES = 4096


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
    """Fills `view` from `sock` (recv_into, no intermediate bytes); ConnectionClosed on EOF."""
    got, want = 0, len(view)
    while got < want:
        n = sock.recv_into(view[got:], want - got, socket.MSG_WAITALL)
        if n == 0:
            raise ConnectionClosed(f"peer closed after {got} of {want} bytes", got)
        got += n


def send_all(sock: socket.socket, *buffers: bytes | memoryview) -> None:
    """Sends every buffer in order with scatter-gather `sendmsg` (no joining copy)."""
    views = [memoryview(b).cast("B") for b in buffers if len(b)]
    while views:
        sent = sock.sendmsg(views)
        # Drop what went out; a short send leaves the tail of one buffer.
        while views and sent >= len(views[0]):
            sent -= len(views[0])
            views.pop(0)
        if sent:
            views[0] = views[0][sent:]
