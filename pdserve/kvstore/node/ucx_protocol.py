"""The storage node's UCX data protocol: fixed-size request and reply messages, pure.

Owns the byte layout both sides of a UCX connection agree on, and nothing else (no `ucxx`
import, no I/O). UCX tag messages must be received into a buffer at least as large as what was
sent, so every control message has one fixed size, `MESSAGE_BYTES`; payloads travel as their own
messages, sent straight from and received straight into segment memory.

A READ: request -> reply(status) -> payload (only when OK).
A WRITE: request -> reply(status) -> payload (only when OK) -> reply(status of the write).
A PING: request -> reply(OK).
"""

from __future__ import annotations

import enum
import struct

from pdserve.kvstore.node.protocol import Status

MESSAGE_BYTES = 128
_REQUEST = struct.Struct("<BxHIQQ")  # op, segment id length, reserved, offset, size
_REPLY = struct.Struct("<II")  # status, message length
MAX_SEGMENT_ID_BYTES = MESSAGE_BYTES - _REQUEST.size
MAX_MESSAGE_BYTES = MESSAGE_BYTES - _REPLY.size


class UcxOp(enum.IntEnum):
    READ = 1
    WRITE = 2
    PING = 3


class UcxProtocolError(ValueError):
    """A control message does not follow the layout; the endpoint cannot be trusted."""


def encode_request(op: UcxOp, segment_id: str = "", offset: int = 0, size: int = 0) -> bytearray:
    sid = segment_id.encode()
    if len(sid) > MAX_SEGMENT_ID_BYTES:
        raise UcxProtocolError(f"segment id of {len(sid)} bytes exceeds {MAX_SEGMENT_ID_BYTES}")
    if offset < 0 or size < 0:
        raise UcxProtocolError(f"offset and size must be >= 0, got {offset}, {size}")
    out = bytearray(MESSAGE_BYTES)
    _REQUEST.pack_into(out, 0, int(op), len(sid), 0, offset, size)
    out[_REQUEST.size:_REQUEST.size + len(sid)] = sid
    return out


def decode_request(msg: bytes | bytearray | memoryview) -> tuple[UcxOp, str, int, int]:
    if len(msg) != MESSAGE_BYTES:
        raise UcxProtocolError(f"request of {len(msg)} bytes, expected {MESSAGE_BYTES}")
    op, sid_len, _, offset, size = _REQUEST.unpack_from(msg, 0)
    try:
        kind = UcxOp(op)
    except ValueError:
        raise UcxProtocolError(f"unknown op {op}") from None
    if sid_len > MAX_SEGMENT_ID_BYTES:
        raise UcxProtocolError(f"segment id length {sid_len} exceeds {MAX_SEGMENT_ID_BYTES}")
    try:
        sid = bytes(msg[_REQUEST.size:_REQUEST.size + sid_len]).decode()
    except UnicodeDecodeError:
        raise UcxProtocolError("segment id is not UTF-8") from None
    return kind, sid, offset, size


def encode_reply(status: Status, message: str = "") -> bytearray:
    text = message.encode()[:MAX_MESSAGE_BYTES]
    out = bytearray(MESSAGE_BYTES)
    _REPLY.pack_into(out, 0, int(status), len(text))
    out[_REPLY.size:_REPLY.size + len(text)] = text
    return out


def decode_reply(msg: bytes | bytearray | memoryview) -> tuple[int, str]:
    if len(msg) != MESSAGE_BYTES:
        raise UcxProtocolError(f"reply of {len(msg)} bytes, expected {MESSAGE_BYTES}")
    status, n = _REPLY.unpack_from(msg, 0)
    n = min(n, MAX_MESSAGE_BYTES)
    return status, bytes(msg[_REPLY.size:_REPLY.size + n]).decode(errors="replace")
