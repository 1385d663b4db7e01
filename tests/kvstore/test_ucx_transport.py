"""The UCX transport with real processes: a node serving its DRAM segment over a ucxx listener,
a client on "another host" (a different host id, so shared memory is not used) putting and
getting through it, errors for bad ranges, and a corrupt replica still caught by the checksum.

Needs `ucxx` (PyPI `ucxx-cu12`, in the test extra); skips and says so where it is missing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from pdserve.kvstore.dist_client import DistStoreClient
from pdserve.kvstore.node.protocol import Status
from pdserve.kvstore.node.ucx_protocol import (
    MESSAGE_BYTES,
    UcxOp,
    UcxProtocolError,
    decode_reply,
    decode_request,
    encode_reply,
    encode_request,
)
from pdserve.kvstore.transport.base import Extent, RemoteNotFound, RemoteOutOfRange
from pdserve.kvstore.transport.ucx import ucx_available
from pdserve.security import tls
from tests.helpers import free_port
from tests.kvstore.test_dist_store import MIB, _env, start_master, stop, wait_nodes

needs_ucx = pytest.mark.skipif(not ucx_available(),
                               reason="ucxx is not installed (pip install ucxx-cu12)")


@pytest.fixture(scope="module", autouse=True)
def plaintext_cluster():
    """UCX has no TLS: it runs only with internal TLS off (`--insecure-internal`), so these
    processes and this one run without it; the setting is put back after the module."""
    saved = {k: os.environ.pop(k, None) for k in (tls.TLS_DIR_ENV, tls.INSECURE_ENV)}
    os.environ[tls.INSECURE_ENV] = "1"
    tls.reset()
    yield
    os.environ.pop(tls.INSECURE_ENV, None)
    os.environ.update({k: v for k, v in saved.items() if v is not None})
    tls.reset()


def test_protocol_round_trips_and_rejects_garbage():
    op, sid, off, size = decode_request(encode_request(UcxOp.READ, "n0.ab.dram0", 4096, 1 << 30))
    assert (op, sid, off, size) == (UcxOp.READ, "n0.ab.dram0", 4096, 1 << 30)
    assert decode_reply(encode_reply(Status.NOT_FOUND, "x" * 500))[0] == Status.NOT_FOUND
    bad = bytearray(MESSAGE_BYTES)
    bad[0] = 99
    with pytest.raises(UcxProtocolError, match="unknown op"):
        decode_request(bad)
    with pytest.raises(UcxProtocolError):
        decode_request(b"short")
    with pytest.raises(UcxProtocolError):
        encode_request(UcxOp.READ, "s" * 200)


def start_ucx_node(node_id: str, master: str, host_id: str) -> tuple[subprocess.Popen, dict]:
    p = subprocess.Popen([sys.executable, "-m", "pdserve.kvstore.node", "--node-id", node_id,
                          "--dram-bytes", str(64 * MIB), "--master", master, "--host-id", host_id,
                          "--heartbeat-s", "0.3", "--ucx-port", "0"],
                         env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    assert line, p.stderr.read()
    return p, json.loads(line)


@pytest.fixture(scope="module")
def ucx_store(tmp_path_factory):
    master = f"127.0.0.1:{free_port()}"
    procs = [start_master(master, str(tmp_path_factory.mktemp("journal")))]
    try:
        node, info = start_ucx_node("ucxnode", master, host_id="storage-host")
        procs.append(node)
        yield master, info
    finally:
        for p in reversed(procs):
            stop(p)


@needs_ucx
def test_client_on_another_host_moves_bytes_over_ucx(ucx_store):
    master, info = ucx_store
    assert info["ucx_address"], "the node announced no UCX listener"
    with DistStoreClient(master, host_id="compute-host") as client:
        wait_nodes(client, 1)
        rng = np.random.default_rng(0)
        sizes = [1, 4096, 3 * MIB + 17]
        blobs = {f"ucx/{i}": rng.integers(0, 256, n, dtype=np.uint8) for i, n in enumerate(sizes)}
        for key, data in blobs.items():
            assert client.put_from(key, data)
        for key, data in blobs.items():
            assert client.transport_kind(key) == "ucx"
            out = np.zeros(data.size + 9, dtype=np.uint8)
            assert client.get_into(key, out) == data.size
            assert np.array_equal(out[: data.size], data)
        # Batch get over the same endpoint.
        outs = [np.zeros(d.size, dtype=np.uint8) for d in blobs.values()]
        assert client.batch_get_into(list(blobs), outs) == [d.size for d in blobs.values()]
        assert all(np.array_equal(o, d) for o, d in zip(outs, blobs.values()))
        assert client.corrupt_reports == 0


@needs_ucx
def test_ucx_errors_name_the_fault_and_the_node_keeps_serving(ucx_store):
    master, info = ucx_store
    from pdserve.kvstore.transport.ucx import UcxTransport

    seg = next(s for s in info["segments"] if s["tier"] == "dram")
    t = UcxTransport()
    try:
        good = Extent("ucxnode", "storage-host", info["data_address"], seg["segment_id"], "",
                      0, 64, ucx_address=info["ucx_address"])
        with pytest.raises(RemoteNotFound):
            t.read_into(Extent("ucxnode", "h", "", "no-such-segment", "", 0, 64,
                               ucx_address=info["ucx_address"]), bytearray(64))
        with pytest.raises(RemoteOutOfRange):
            t.read_into(Extent("ucxnode", "h", "", seg["segment_id"], "", seg["size_bytes"] - 8,
                               64, ucx_address=info["ucx_address"]), bytearray(64))
        t.ping(info["ucx_address"])
        payload = bytes(range(64))
        t.write(good, payload)
        back = bytearray(64)
        t.read_into(good, back)
        assert bytes(back) == payload
    finally:
        t.close()
