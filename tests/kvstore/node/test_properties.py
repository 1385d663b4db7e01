"""Random write/read ranges through both transports match a bytearray model of the segment."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.kvstore.node.data_server import DataServer
from pdserve.kvstore.node.segment import ShmSegment
from pdserve.kvstore.transport.base import Extent
from pdserve.kvstore.transport.shm import ShmTransport
from pdserve.kvstore.transport.tcp import TcpTransport

SEGMENT_BYTES = 64 * 1024


@pytest.fixture(scope="module")
def served_segment():
    shm_dir = tempfile.mkdtemp(prefix="pdserve-test-", dir="/dev/shm")
    segment = ShmSegment.create(os.path.join(shm_dir, "p0"), SEGMENT_BYTES)
    server = DataServer({"p0": segment}, None, "127.0.0.1:0")
    server.start()
    transports = {"tcp": TcpTransport(), "shm": ShmTransport()}
    yield server, segment, transports
    for t in transports.values():
        t.close()
    server.stop()
    segment.close()
    shutil.rmtree(shm_dir, ignore_errors=True)


@st.composite
def operations(draw):
    ops = []
    for _ in range(draw(st.integers(1, 12))):
        offset = draw(st.integers(0, SEGMENT_BYTES))
        size = draw(st.integers(0, min(SEGMENT_BYTES - offset, 9000)))
        kind = draw(st.sampled_from(["write", "read"]))
        via = draw(st.sampled_from(["tcp", "shm"]))
        data = draw(st.binary(min_size=size, max_size=size)) if kind == "write" else b""
        ops.append((kind, via, offset, size, data))
    return ops


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(ops=operations())
def test_random_ranges_match_a_bytearray_model(served_segment, ops):
    server, segment, transports = served_segment
    model = bytearray(bytes(segment.view(0, SEGMENT_BYTES)))  # whatever earlier examples left
    for kind, via, offset, size, data in ops:
        where = Extent("n", "h", server.address, "p0", segment.path, offset, size)
        if kind == "write":
            transports[via].write(where, data)
            model[offset:offset + size] = data
        else:
            out = bytearray(size)
            transports[via].read_into(where, out)
            assert out == model[offset:offset + size]
    assert bytes(segment.view(0, SEGMENT_BYTES)) == model
