"""Transport odds and ends: the pick rule, the UCX stub, extents, buffer checks, measurement."""

from __future__ import annotations

import os

import numpy as np
import pytest

from pdserve.kvstore.node.data_server import DataServer
from pdserve.kvstore.node.segment import ShmSegment
from pdserve.kvstore.transport.base import (
    Extent,
    Transport,
    TransportError,
    TransportUnavailable,
    byte_view,
)
from pdserve.kvstore.transport.measure import measure_bandwidth
from pdserve.kvstore.transport.select import pick_transport
from pdserve.kvstore.transport.shm import ShmTransport
from pdserve.kvstore.transport.tcp import TcpTransport
from pdserve.kvstore.transport.ucx import UcxTransport, ucx_allowed, ucx_available

from .conftest import MiB


def test_pick_transport():
    assert pick_transport("h1", "h1") == "shm"
    assert pick_transport("h1", "h2", ucx=False) == "tcp"
    assert pick_transport("h1", "h2", ucx=True, insecure=True) == "ucx"
    # UCX carries KV in plaintext: never while internal TLS is on.
    assert pick_transport("h1", "h2", ucx=True, insecure=False) == "tcp"
    assert pick_transport("h1", "h1", tier="ssd", ucx=True, insecure=True) == "tcp"
    assert pick_transport("h1", "h2") == ("ucx" if ucx_allowed() else "tcp")


def test_pick_transport_needs_a_node_that_serves_ucx():
    assert pick_transport("h1", "h2", ucx=True, node_serves_ucx=False, insecure=True) == "tcp"


def test_ucx_transport_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("PDSERVE_UCX", "0")
    assert ucx_available() is False
    with pytest.raises(TransportUnavailable, match="UcxTransport unavailable"):
        UcxTransport()


def test_transports_satisfy_the_protocol():
    with ShmTransport() as shm, TcpTransport() as tcp:
        assert isinstance(shm, Transport) and isinstance(tcp, Transport)


def test_extent_validation_and_sub_ranges():
    e = Extent("n", "h", "127.0.0.1:1", "seg", "/dev/shm/x", 4096, 8192)
    assert e.sub(100, 50).offset == 4196 and e.sub(100, 50).size == 50
    assert e.ssd_object_id == "seg.4096"
    with pytest.raises(ValueError):
        e.sub(8000, 200)
    with pytest.raises(ValueError, match="tier"):
        Extent("n", "h", "a:1", "s", "", 0, 1, "tape")
    with pytest.raises(ValueError, match="offset"):
        Extent("n", "h", "a:1", "s", "", -1, 1)


def test_byte_view_checks():
    e = Extent("n", "h", "a:1", "s", "", 0, 16)
    assert len(byte_view(np.zeros(4, np.float32), e, writable=True)) == 16
    with pytest.raises(TransportError, match="read-only"):
        byte_view(b"1234", e, writable=True)
    with pytest.raises(TransportError, match="do not fit"):
        byte_view(bytes(17), e, writable=False)
    with pytest.raises(TransportError, match="buffer"):
        byte_view(object(), e, writable=False)


def test_shm_transport_refuses_ssd_extents_and_missing_files(shm_dir):
    with ShmTransport() as shm:
        with pytest.raises(TransportUnavailable, match="no shared-memory"):
            shm.write(Extent("n", "h", "a:1", "s", "", 0, 4, "ssd"), b"1234")
        with pytest.raises(TransportUnavailable, match="cannot open"):
            shm.write(Extent("n", "h", "a:1", "s", os.path.join(shm_dir, "gone"), 0, 4), b"1234")


def test_measure_bandwidth_reports_put_get_and_memcpy(shm_dir):
    with ShmSegment.create(os.path.join(shm_dir, "m"), MiB) as segment, \
            DataServer({"m": segment}, None, "127.0.0.1:0") as server:
        where = Extent("n", "h", server.address, "m", segment.path, 0, MiB)
        for transport in (TcpTransport(), ShmTransport()):
            with transport:
                report = measure_bandwidth(transport, where, sizes=(4096, MiB), repeats=1)
            assert report["transport"] == transport.kind and len(report["results"]) == 2
            for row in report["results"]:
                assert row["put_gbps"] > 0 and row["get_gbps"] > 0 and row["memcpy_gbps"] > 0
        with pytest.raises(ValueError, match="exceed"):
            measure_bandwidth(ShmTransport(), where, sizes=(2 * MiB,))
