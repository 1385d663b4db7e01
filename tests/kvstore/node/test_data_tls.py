"""The data plane under mutual TLS, in process on loopback: who gets in, who is refused and
counted, and that the server keeps serving; bytes exact through TLS (DRAM and SSD).

Every setting is built explicitly (`tls.MutualTls(tls.TlsFolder(dir), kind)`), never read from
the environment, so these tests mean the same whatever `PDSERVE_*` variables are set.
"""

from __future__ import annotations

import os
import socket
import ssl
import threading
import time

import numpy as np
import pytest

from pdserve.core.identity import KINDS, NODE, server_name
from pdserve.kvstore.node.data_server import TLS_HANDSHAKE, DataServer
from pdserve.kvstore.node.protocol import REPLY, Op, Status, encode_request, recv_exact, send_all
from pdserve.kvstore.node.segment import ShmSegment
from pdserve.kvstore.node.ssd import SsdTier
from pdserve.kvstore.transport.base import Extent, RemoteBusy, RemoteError, TransportError
from pdserve.kvstore.transport.tcp import TcpTransport
from pdserve.security import access, failures, pki, tls

from .conftest import MiB, wait_until

SEGMENT_BYTES = 16 * MiB


@pytest.fixture(scope="module")
def cluster_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tls"))
    pki.init_folder(path, "test")
    return path


@pytest.fixture(scope="module")
def other_dir(tmp_path_factory) -> str:
    """Another cluster: its own CA, the same kinds."""
    path = str(tmp_path_factory.mktemp("other-tls"))
    pki.init_folder(path, "other")
    return path


def as_kind(folder: str, kind: str) -> tls.MutualTls:
    return tls.MutualTls(tls.TlsFolder(folder), kind)


@pytest.fixture
def node(shm_dir, tmp_path, cluster_dir):
    """(server, segment) under mutual TLS: one 16 MiB segment "s0", a 8 MiB SSD tier."""
    segment = ShmSegment.create(os.path.join(shm_dir, "s0"), SEGMENT_BYTES)
    ssd = SsdTier(str(tmp_path / "ssd"), 8 * MiB)
    server = DataServer({"s0": segment}, ssd, "127.0.0.1:0", max_connections=2,
                        frame_timeout_s=0.5, security=as_kind(cluster_dir, NODE))
    server.start()
    yield server, segment
    server.stop()
    segment.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("kv-data")]


def where(server: DataServer, segment: ShmSegment, offset: int = 0, size: int = SEGMENT_BYTES,
          tier: str = "dram") -> Extent:
    segment_id = "s0" if tier == "dram" else "n0.ssd"
    return Extent("n0", "host-a", server.address, segment_id, segment.path, offset, size, tier)


def count(reason: str) -> int:
    return failures.snapshot().get((access.DATA_PLANE, reason), 0)


def counted(reason: str, before: int) -> bool:
    return wait_until(lambda: count(reason) > before, timeout_s=5)


def assert_serves_workers(server: DataServer, segment: ShmSegment, cluster_dir: str) -> None:
    data = np.random.default_rng(7).integers(0, 256, 100_000, dtype=np.uint8)
    out = np.zeros_like(data)
    with TcpTransport(security=as_kind(cluster_dir, "worker")) as tcp:
        tcp.write(where(server, segment, 4096, data.size), data)
        tcp.read_into(where(server, segment, 4096, data.size), out)
    assert np.array_equal(out, data)


@pytest.mark.parametrize("size", (1, 4096, 65536 + 7, MiB + 3, 8 * MiB))
def test_a_worker_puts_then_gets_its_bytes_back(node, cluster_dir, size):
    server, segment = node
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    out = np.zeros(size, dtype=np.uint8)
    at = where(server, segment, offset=SEGMENT_BYTES - size, size=size)
    with TcpTransport(security=as_kind(cluster_dir, "worker")) as tcp:
        tcp.write(at, data)
        tcp.read_into(at, out)
    assert np.array_equal(out, data)
    # The bytes landed in the node's memory itself, not in some copy of them.
    assert segment.view(SEGMENT_BYTES - size, size).tobytes() == data.tobytes()


# The kinds the data plane admits, as the one table says (workers; the master, which moves
# demoted bytes from DRAM to SSD; operators' tools), and the others.
ADMITTED = sorted(access.allowed_kinds(access.DATA_PLANE, "*"))
REFUSED = sorted(set(KINDS) - set(ADMITTED))


def test_the_table_admits_workers_and_refuses_routers():
    assert "worker" in ADMITTED and {"router", "controller", "node"} <= set(REFUSED)


@pytest.mark.parametrize("kind", ADMITTED)
def test_every_admitted_kind_gets_in(node, cluster_dir, kind):
    server, segment = node
    with TcpTransport(security=as_kind(cluster_dir, kind)) as tcp:
        tcp.write(where(server, segment, 0, 2), kind[:2].encode())
    assert segment.view(0, 2).tobytes() == kind[:2].encode()


def test_ssd_objects_larger_than_a_chunk_move_exactly_through_tls(node, cluster_dir):
    server, segment = node
    data = np.random.default_rng(3).integers(0, 256, 5 * MiB + 11, dtype=np.uint8)
    at = where(server, segment, offset=0, size=data.size, tier="ssd")
    out = np.zeros_like(data)
    with TcpTransport(security=as_kind(cluster_dir, "worker")) as tcp:
        tcp.write(at, data)
        tcp.read_into(at, out)
        assert np.array_equal(out, data)
        tail = bytearray(1000)
        tcp.read_into(at.sub(0, 1000), tail)
        assert tail == data[:1000].tobytes()


def raw_ping(server: DataServer, context: ssl.SSLContext | None) -> tuple[int, bytes]:
    """One PING from a hand-built client (`context` None: plaintext): (status, body) of the
    reply; OSError (an SSL error, a reset) or ConnectionError if refused."""
    host, port = server.address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=5)
    try:
        if context is not None:
            sock = context.wrap_socket(sock, server_hostname=server_name(NODE))
        send_all(sock, encode_request(Op.PING, ""))
        head = bytearray(REPLY.size)
        recv_exact(sock, memoryview(head))
        status, length = REPLY.unpack(head)
        body = bytearray(length)
        recv_exact(sock, memoryview(body))
        return status, bytes(body)
    finally:
        sock.close()


def client_context(ca_dir: str, cert_dir: str | None) -> ssl.SSLContext:
    """Trusts `ca_dir`'s CA; presents `cert_dir`'s worker certificate (None: no certificate)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(os.path.join(ca_dir, pki.CA_CERT))
    if cert_dir is not None:
        ctx.load_cert_chain(os.path.join(cert_dir, pki.cert_file("worker")),
                            os.path.join(cert_dir, pki.key_file("worker")))
    return ctx


@pytest.mark.parametrize("client", ["no certificate", "another CA's certificate", "plaintext"])
def test_clients_without_a_cluster_certificate_are_refused_and_counted(node, cluster_dir,
                                                                       other_dir, client):
    server, segment = node
    context = {"no certificate": lambda: client_context(cluster_dir, None),
               "another CA's certificate": lambda: client_context(cluster_dir, other_dir),
               "plaintext": lambda: None}[client]()
    before = count(TLS_HANDSHAKE)
    with pytest.raises((OSError, ConnectionError)):
        raw_ping(server, context)
    assert counted(TLS_HANDSHAKE, before)
    assert_serves_workers(server, segment, cluster_dir)


def test_the_pdserve_clients_of_another_cluster_or_in_plaintext_fail_clearly(node, cluster_dir,
                                                                            other_dir):
    server, segment = node
    before = count(TLS_HANDSHAKE)
    for security in (tls.Insecure(), as_kind(other_dir, "worker")):
        with TcpTransport(security=security) as tcp, pytest.raises(TransportError,
                                                                   match=server.address):
            tcp.ping(server.address)
    assert counted(TLS_HANDSHAKE, before)
    assert_serves_workers(server, segment, cluster_dir)


@pytest.mark.parametrize("kind", REFUSED)
def test_cluster_kinds_not_on_the_data_plane_are_denied_before_any_request(node, cluster_dir,
                                                                          kind):
    server, segment = node
    before = count(access.KIND_NOT_ALLOWED)
    segment.view(0, 4)[:] = b"safe"
    with TcpTransport(security=as_kind(cluster_dir, kind)) as tcp:
        with pytest.raises(RemoteError) as refused:
            tcp.write(where(server, segment, 0, 4), b"evil")
    assert refused.value.status == Status.DENIED
    assert f"a {kind} may not" in str(refused.value)
    assert counted(access.KIND_NOT_ALLOWED, before)
    assert segment.view(0, 4).tobytes() == b"safe"  # the request was never read
    assert_serves_workers(server, segment, cluster_dir)


def test_a_silent_client_is_dropped_after_the_frame_timeout(node, cluster_dir):
    server, segment = node
    before = count(TLS_HANDSHAKE)
    host, port = server.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        t0 = time.monotonic()
        assert sock.recv(1) == b""  # closed by the server, not by us
        assert time.monotonic() - t0 < 4
    assert counted(TLS_HANDSHAKE, before)
    assert_serves_workers(server, segment, cluster_dir)


def test_connections_beyond_the_limit_get_busy_through_tls(node, cluster_dir):
    server, segment = node
    held = [TcpTransport(security=as_kind(cluster_dir, "worker")) for _ in range(2)]
    try:
        for tcp in held:  # each keeps one pooled connection: the limit is 2
            tcp.ping(server.address)
        with TcpTransport(security=as_kind(cluster_dir, "worker")) as extra:
            with pytest.raises(RemoteBusy, match="too many"):
                extra.ping(server.address)
    finally:
        for tcp in held:
            tcp.close()
    assert wait_until(lambda: _pings(server, cluster_dir))


def _pings(server: DataServer, cluster_dir: str) -> bool:
    try:
        with TcpTransport(security=as_kind(cluster_dir, "worker")) as tcp:
            tcp.ping(server.address)
        return True
    except TransportError:
        return False


def test_stop_ends_connections_mid_handshake_and_idle(node, cluster_dir):
    server, _ = node
    host, port = server.address.rsplit(":", 1)
    silent = socket.create_connection((host, int(port)), timeout=5)  # never says hello
    idle = TcpTransport(security=as_kind(cluster_dir, "worker"))
    idle.ping(server.address)  # leaves an admitted connection waiting for its next request
    t0 = time.monotonic()
    server.stop()
    assert time.monotonic() - t0 < 2
    assert not [t for t in threading.enumerate() if t.name == "kv-data-conn"]
    silent.close()
    idle.close()
