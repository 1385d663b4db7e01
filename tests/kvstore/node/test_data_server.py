"""The data server in process: TCP and shm transports byte-exact, SSD ops, bad frames, limits."""

from __future__ import annotations

import dataclasses
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from pdserve.kvstore.node.data_server import DataServer
from pdserve.kvstore.node.protocol import (
    REPLY,
    REQUEST,
    Op,
    Status,
    encode_request,
)
from pdserve.kvstore.node.segment import ShmSegment
from pdserve.kvstore.node.ssd import SsdTier
from pdserve.kvstore.transport.base import (
    Extent,
    RemoteBusy,
    RemoteNoSpace,
    RemoteNotFound,
    RemoteOutOfRange,
    TransportError,
)
from pdserve.kvstore.transport.shm import ShmTransport
from pdserve.kvstore.transport.tcp import TcpTransport
from pdserve.security import tls

from .conftest import MiB, wait_until

SEGMENT_BYTES = 16 * MiB
SIZES = (4096, 65536 + 7, MiB, 8 * MiB)


@pytest.fixture(autouse=True)
def plaintext():
    """These tests speak the data plane's raw frames: internal TLS off for them (the suite's
    conftest puts the setting back). Its TLS side: test_data_tls.py and test_node_tls.py."""
    tls.configure(tls.Insecure())


@pytest.fixture
def node(shm_dir, tmp_path):
    """(server, segment, ssd) on loopback: one 16 MiB segment "s0" and a 1 MiB SSD tier."""
    segment = ShmSegment.create(os.path.join(shm_dir, "s0"), SEGMENT_BYTES)
    ssd = SsdTier(str(tmp_path / "ssd"), MiB)
    server = DataServer({"s0": segment}, ssd, "127.0.0.1:0", max_connections=4,
                        frame_timeout_s=0.5)
    server.start()
    yield server, segment, ssd
    server.stop()
    segment.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("kv-data")]


def extent(server: DataServer, segment: ShmSegment, offset: int = 0, size: int = SEGMENT_BYTES,
           tier: str = "dram", segment_id: str = "s0") -> Extent:
    return Extent("n0", "host-a", server.address, segment_id,
                  segment.path if tier == "dram" else "", offset, size, tier)


def random_bytes(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def raw_connection(server: DataServer) -> socket.socket:
    host, port = server.address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=5)


def read_reply(sock: socket.socket) -> tuple[int, bytes]:
    head = sock.recv(REPLY.size, socket.MSG_WAITALL)
    status, length = REPLY.unpack(head)
    body = sock.recv(length, socket.MSG_WAITALL) if length else b""
    return status, body


@pytest.mark.parametrize("size", SIZES)
def test_tcp_write_then_read_back_is_byte_exact(node, size):
    server, segment, _ = node
    data = random_bytes(size, seed=size)
    where = extent(server, segment, offset=12288, size=size)
    with TcpTransport() as tcp:
        tcp.write(where, memoryview(data))
        assert bytes(segment.view(12288, size)) == data.tobytes()  # landed in the segment
        out = np.zeros(size, dtype=np.uint8)
        tcp.read_into(where, memoryview(out))
    assert np.array_equal(out, data)


def test_shm_and_tcp_see_the_same_bytes(node):
    server, segment, _ = node
    data = random_bytes(MiB, seed=3)
    where = extent(server, segment, offset=4096, size=MiB)
    with ShmTransport() as shm, TcpTransport() as tcp:
        shm.write(where, data)
        out = bytearray(MiB)
        tcp.read_into(where, out)
        assert out == data.tobytes()
        tcp.write(where, data[::-1].copy())
        shm.read_into(where, out)
        assert out == data[::-1].tobytes()


def test_float_arrays_are_moved_as_their_bytes(node):
    server, segment, _ = node
    values = np.arange(1000, dtype=np.float32).reshape(10, 100)
    where = extent(server, segment, size=values.nbytes)
    with TcpTransport() as tcp:
        tcp.write(where, values)
        out = np.empty_like(values)
        tcp.read_into(where, out)
    assert np.array_equal(out, values)
    with TcpTransport() as tcp, pytest.raises(TransportError, match="contiguous"):
        tcp.write(where, values[:, ::2])


def test_error_replies_are_typed_and_keep_the_connection(node):
    server, segment, _ = node
    with TcpTransport(max_connections_per_node=1) as tcp:
        with pytest.raises(RemoteOutOfRange):
            tcp.write(extent(server, segment, offset=SEGMENT_BYTES - 10, size=20), b"x" * 20)
        with pytest.raises(RemoteNotFound, match="no segment"):
            tcp.read_into(extent(server, segment, segment_id="nope", size=10), bytearray(10))
        with pytest.raises(TransportError, match="do not fit"):
            tcp.write(extent(server, segment, size=4), b"12345")
        tcp.write(extent(server, segment, size=5), b"12345")  # the same connection still works
        out = bytearray(5)
        tcp.read_into(extent(server, segment, size=5), out)
        assert out == b"12345"


def test_ssd_tier_over_tcp(node):
    server, segment, ssd = node
    data = random_bytes(300_000, seed=5)
    where = extent(server, segment, offset=8192, size=300_000, tier="ssd", segment_id="n0.ssd")
    with TcpTransport() as tcp:
        tcp.write(where, data)
        assert ssd.size_of(where.ssd_object_id) == 300_000
        out = np.zeros(300_000, dtype=np.uint8)
        tcp.read_into(where, out)
        assert np.array_equal(out, data)
        part = bytearray(1000)
        tcp.read_into(where.sub(0, 1000), part)
        assert part == data[:1000].tobytes()
        with pytest.raises(RemoteNoSpace):  # 300 KB + 800 KB > 1 MiB
            tcp.write(dataclasses.replace(where, offset=0, size=800_000), bytes(800_000))
        with pytest.raises(RemoteOutOfRange):
            tcp.read_into(extent(server, segment, offset=8192, size=300_001, tier="ssd",
                                 segment_id="n0.ssd"), bytearray(300_001))
        tcp.remove_ssd(where)
        assert ssd.used_bytes == 0
        with pytest.raises(RemoteNotFound):
            tcp.read_into(where, out)
        tcp.ping(server.address)


def test_node_without_ssd_answers_not_found(shm_dir):
    with ShmSegment.create(os.path.join(shm_dir, "s"), 4096) as segment, \
            DataServer({"s": segment}, None, "127.0.0.1:0") as server, TcpTransport() as tcp:
        with pytest.raises(RemoteNotFound, match="no SSD tier"):
            tcp.write(Extent("n", "h", server.address, "s", "", 0, 10, "ssd"), b"0123456789")


def _assert_still_serving(server: DataServer, segment: ShmSegment) -> None:
    with TcpTransport() as tcp:
        tcp.write(extent(server, segment, offset=100, size=3), b"ok!")
        out = bytearray(3)
        tcp.read_into(extent(server, segment, offset=100, size=3), out)
        assert out == b"ok!"


@pytest.mark.parametrize("frame,why", [
    (b"KV\x01\x63" + bytes(20), "unknown op"),
    (b"XX\x01\x02" + bytes(20), "bad magic"),
    (b"KV\x07\x02" + bytes(20), "unsupported protocol version"),
    (REQUEST.pack(b"KV", 1, Op.READ, 5000, 0, 0), "name of 5000 bytes"),
])
def test_malformed_frames_get_bad_request_and_close_that_connection(node, frame, why):
    server, segment, _ = node
    with raw_connection(server) as sock:
        sock.sendall(frame)
        status, body = read_reply(sock)
        assert status == Status.BAD_REQUEST and why in body.decode()
        assert sock.recv(1) == b""  # closed by the server
    _assert_still_serving(server, segment)


def test_rejected_write_payload_is_drained_and_the_connection_kept(node):
    server, segment, _ = node
    with raw_connection(server) as sock:
        sock.sendall(encode_request(Op.WRITE, "s0", SEGMENT_BYTES - 2, 100) + b"p" * 100)
        status, body = read_reply(sock)
        assert status == Status.OUT_OF_RANGE and b"outside segment" in body
        sock.sendall(encode_request(Op.WRITE, "nope", 0, 10) + b"q" * 10)
        assert read_reply(sock)[0] == Status.NOT_FOUND
        sock.sendall(encode_request(Op.PING, ""))
        assert read_reply(sock) == (Status.OK, b"")


def test_truncated_payload_closes_only_that_connection(node):
    server, segment, _ = node
    with raw_connection(server) as sock:
        sock.sendall(encode_request(Op.WRITE, "s0", 0, 1000) + b"z" * 10)
        sock.shutdown(socket.SHUT_WR)  # the payload ends early
        assert sock.recv(1) == b""
    with raw_connection(server) as sock:  # a stalled frame is cut off by frame_timeout_s
        sock.sendall(encode_request(Op.WRITE, "s0", 0, 1000)[:10])
        t0 = time.monotonic()
        assert sock.recv(1) == b""
        assert time.monotonic() - t0 < 5
    _assert_still_serving(server, segment)


def test_connections_beyond_the_limit_are_answered_busy(node):
    server, segment, _ = node
    held = [raw_connection(server) for _ in range(4)]
    try:
        for sock in held:  # each is served by its own thread
            sock.sendall(encode_request(Op.PING, ""))
            assert read_reply(sock) == (Status.OK, b"")
        with raw_connection(server) as extra:
            status, body = read_reply(extra)
            assert status == Status.BUSY and b"too many" in body
        with TcpTransport() as tcp, pytest.raises(RemoteBusy):
            tcp.ping(server.address)
    finally:
        for sock in held:
            sock.close()
    assert wait_until(lambda: _pings(server))


def _pings(server: DataServer) -> bool:
    try:
        with TcpTransport() as tcp:
            tcp.ping(server.address)
        return True
    except TransportError:
        return False


def test_a_broken_connection_is_replaced_once_then_transport_error(shm_dir):
    segment = ShmSegment.create(os.path.join(shm_dir, "s"), 4096)
    server = DataServer({"s": segment}, None, "127.0.0.1:0")
    address = server.start()
    where = Extent("n", "h", address, "s", segment.path, 0, 4, "dram")
    with TcpTransport(connect_timeout_s=1) as tcp:
        tcp.write(where, b"abcd")  # leaves a pooled connection
        server.stop()  # the pooled connection dies with it
        server = DataServer({"s": segment}, None, address)
        server.start()
        out = bytearray(4)
        tcp.read_into(where, out)  # pooled connection broken: reconnected once
        assert out == b"abcd"
        server.stop()
        with pytest.raises(TransportError, match=address):
            tcp.read_into(where, out)
    segment.close()


def test_one_transport_shared_by_threads_keeps_ranges_apart(node):
    server, segment, _ = node
    chunk = 256 * 1024
    blobs = [random_bytes(chunk, seed=100 + i) for i in range(16)]

    def roundtrip(tcp: TcpTransport, i: int) -> bool:
        where = extent(server, segment, offset=i * chunk, size=chunk)
        tcp.write(where, blobs[i])
        out = np.zeros(chunk, dtype=np.uint8)
        tcp.read_into(where, out)
        return bool(np.array_equal(out, blobs[i]))

    with TcpTransport(max_connections_per_node=3) as tcp, ThreadPoolExecutor(8) as pool:
        assert all(pool.map(lambda i: roundtrip(tcp, i), range(16)))
    assert bytes(segment.view(0, 16 * chunk)) == b"".join(b.tobytes() for b in blobs)
