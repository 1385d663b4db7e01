"""The node as a real process: ready line, cross-process TCP and shared memory, clean SIGTERM."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile

import numpy as np
import pytest

from pdserve.kvstore.transport.base import Extent, RemoteNotFound
from pdserve.kvstore.transport.shm import ShmTransport
from pdserve.kvstore.transport.tcp import TcpTransport
from tests.helpers import REPO_ROOT, free_port

from .conftest import MiB, node_args, node_stderr, start_node, stop_node

DRAM_BYTES = 32 * MiB
SIZES = (4096, 100_000, MiB, 8 * MiB)


@pytest.fixture(scope="module")
def node_shm_dir():
    path = tempfile.mkdtemp(prefix="pdserve-test-", dir="/dev/shm")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def running_node(node_shm_dir, tmp_path_factory):
    """One node process for the module: (process, ready line as a dict)."""
    ssd_dir = str(tmp_path_factory.mktemp("ssd"))
    p, ready = start_node(node_args("node-a", f"127.0.0.1:{free_port()}", DRAM_BYTES,
                                    node_shm_dir, "--ssd-dir", ssd_dir, "--ssd-bytes", str(MiB)))
    yield p, ready
    assert stop_node(p) == 0, node_stderr(p)


def dram_extent(ready: dict, offset: int, size: int) -> Extent:
    seg = next(s for s in ready["segments"] if s["tier"] == "dram")
    return Extent(ready["node_id"], ready["host_id"], ready["data_address"], seg["segment_id"],
                  seg["shm_path"], offset, size, "dram")


def test_ready_line_describes_the_node(running_node, node_shm_dir):
    p, ready = running_node
    assert ready["event"] == "ready" and ready["node_id"] == "node-a" and ready["pid"] == p.pid
    assert ready["host_id"] == "test-host"
    dram, ssd = ready["segments"]
    assert dram["tier"] == "dram" and dram["size_bytes"] == DRAM_BYTES
    assert os.path.dirname(dram["shm_path"]) == node_shm_dir
    assert os.path.getsize(dram["shm_path"]) == DRAM_BYTES
    assert dram["segment_id"].startswith("node-a.") and dram["segment_id"].endswith(".dram0")
    assert ssd["segment_id"].startswith("node-a.") and ssd["segment_id"].endswith(".ssd")
    assert ssd["size_bytes"] == MiB and ssd["tier"] == "ssd" and ssd["shm_path"] == ""


@pytest.mark.parametrize("size", SIZES)
def test_tcp_and_shm_move_bytes_exactly_between_processes(running_node, size):
    _, ready = running_node
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    out = np.zeros(size, dtype=np.uint8)
    where = dram_extent(ready, offset=DRAM_BYTES - size - 4096, size=size)
    with TcpTransport() as tcp, ShmTransport() as shm:
        tcp.write(where, data)  # over the socket into the node's memory ...
        shm.read_into(where, out)  # ... read back through this process's own mapping
        assert np.array_equal(out, data)
        flipped = np.ascontiguousarray(data[::-1])
        shm.write(where, flipped)  # one memcpy into the node's segment ...
        out[:] = 0
        tcp.read_into(where, out)  # ... which the node serves over TCP
        assert np.array_equal(out, flipped)


def test_ssd_tier_of_a_node_process(running_node):
    _, ready = running_node
    seg = next(s for s in ready["segments"] if s["tier"] == "ssd")
    where = Extent("node-a", "test-host", ready["data_address"], seg["segment_id"], "", 0, 5000,
                   "ssd")
    with TcpTransport() as tcp:
        tcp.write(where, b"s" * 5000)
        out = bytearray(5000)
        tcp.read_into(where, out)
        assert out == b"s" * 5000
        tcp.remove_ssd(where)
        with pytest.raises(RemoteNotFound):
            tcp.remove_ssd(where)


def test_sigterm_exits_zero_and_unlinks_shm_files(shm_dir):
    p, ready = start_node(node_args("node-b", "127.0.0.1:0", 4 * MiB, shm_dir))
    path = ready["segments"][0]["shm_path"]
    with ShmTransport() as shm:
        shm.write(dram_extent(ready, 0, 4), b"bye!")  # a client mapping does not block cleanup
        assert os.path.exists(path)
        assert stop_node(p) == 0, node_stderr(p)
    assert not os.path.exists(path) and os.listdir(shm_dir) == []


def test_sigint_also_stops_cleanly(shm_dir):
    p, _ = start_node(node_args("node-c", "127.0.0.1:0", MiB, shm_dir))
    assert stop_node(p, signal.SIGINT) == 0, node_stderr(p)
    assert os.listdir(shm_dir) == []


def test_a_taken_address_exits_one_and_leaves_no_shm_file(shm_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        p = subprocess.run(node_args("node-d", f"127.0.0.1:{port}", MiB, shm_dir),
                           cwd=REPO_ROOT, capture_output=True, timeout=20)
    assert p.returncode == 1 and b"Address already in use" in p.stderr
    assert os.listdir(shm_dir) == []


def test_bad_arguments_exit_two_naming_the_field(shm_dir):
    p = subprocess.run([sys.executable, "-m", "pdserve.kvstore.node", "--node-id", "../x",
                        "--dram-bytes", "1024", "--shm-dir", shm_dir],
                       cwd=REPO_ROOT, capture_output=True, timeout=20)
    assert p.returncode == 2 and b"node_id" in p.stderr
    assert os.listdir(shm_dir) == []


def test_a_restarted_node_does_not_serve_stale_extents(shm_dir):
    address = f"127.0.0.1:{free_port()}"
    p, ready = start_node(node_args("node-e", address, MiB, shm_dir))
    old = dram_extent(ready, 0, 4)
    with TcpTransport() as tcp:
        tcp.write(old, b"old!")
        assert stop_node(p) == 0
        p, again = start_node(node_args("node-e", address, MiB, shm_dir))
        try:
            assert again["data_address"] == address
            assert again["segments"][0]["segment_id"] != old.segment_id  # a new incarnation
            with pytest.raises(RemoteNotFound, match="no segment"):
                tcp.read_into(old, bytearray(4))  # fails loudly instead of reading zeros
        finally:
            assert stop_node(p) == 0, node_stderr(p)
