"""A storage node under internal TLS: as a real process (flags, TLS data plane, the plaintext
health port, UCX refused) and in process (segment files private and unguessable, UCX only in
plaintext on either side).

No test here relies on `PDSERVE_INSECURE_INTERNAL` or `PDSERVE_TLS_DIR`: they are removed
from the environment the nodes start with, and settings are passed explicitly.
"""

from __future__ import annotations

import os
import re
import stat
import subprocess

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.core.identity import NODE
from pdserve.kvstore.node.config import NodeConfig
from pdserve.kvstore.node.segment import SegmentError, ShmSegment
from pdserve.kvstore.node.service import NodeStartError, StorageNode
from pdserve.kvstore.node.ucx_server import UcxDataServer
from pdserve.kvstore.transport.base import Extent, TransportError, TransportUnavailable
from pdserve.kvstore.transport.select import pick_transport
from pdserve.kvstore.transport.tcp import TcpTransport
from pdserve.kvstore.transport.ucx import UcxTransport
from pdserve.security import pki, tls
from tests.helpers import REPO_ROOT, free_port

from .conftest import MiB, node_args, node_stderr, start_node, stop_node

INCARNATION = re.compile(r"[0-9a-f]{32}")


@pytest.fixture(autouse=True)
def no_setting_from_the_environment(monkeypatch):
    monkeypatch.delenv(tls.INSECURE_ENV, raising=False)
    monkeypatch.delenv(tls.TLS_DIR_ENV, raising=False)


@pytest.fixture(scope="module")
def cluster_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tls"))
    pki.init_folder(path, "test")
    return path


def as_kind(folder: str, kind: str) -> tls.MutualTls:
    return tls.MutualTls(tls.TlsFolder(folder), kind)


def run_node(args: list[str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in (tls.INSECURE_ENV, tls.TLS_DIR_ENV)}
    return subprocess.run(args, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=60)


def dram(ready: dict, offset: int, size: int) -> Extent:
    seg = ready["segments"][0]
    return Extent(ready["node_id"], ready["host_id"], ready["data_address"], seg["segment_id"],
                  seg["shm_path"], offset, size, "dram")


def test_a_tls_node_serves_workers_only_and_its_segment_file_is_private(shm_dir, cluster_dir):
    p, ready = start_node(node_args("tls-a", "127.0.0.1:0", 4 * MiB, shm_dir,
                                    "--tls-dir", cluster_dir))
    try:
        seg = ready["segments"][0]
        node_id, token, tail = seg["segment_id"].split(".")
        assert node_id == "tls-a" and INCARNATION.fullmatch(token) and tail == "dram0"
        assert os.path.basename(seg["shm_path"]) == f"pdserve-{seg['segment_id']}"
        assert stat.S_IMODE(os.stat(seg["shm_path"]).st_mode) == 0o600
        data = np.random.default_rng(1).integers(0, 256, 3 * MiB, dtype=np.uint8)
        out = np.zeros_like(data)
        with TcpTransport(security=as_kind(cluster_dir, "worker")) as tcp:
            tcp.write(dram(ready, 4096, data.size), data)
            tcp.read_into(dram(ready, 4096, data.size), out)
        assert np.array_equal(out, data)
        with TcpTransport(security=tls.Insecure()) as plain, pytest.raises(TransportError):
            plain.read_into(dram(ready, 4096, 16), bytearray(16))
    finally:
        assert stop_node(p) == 0, node_stderr(p)
    assert os.listdir(shm_dir) == []


def test_the_node_refuses_ucx_port_without_insecure_internal(shm_dir, cluster_dir):
    p = run_node(node_args("tls-ucx", "127.0.0.1:0", MiB, shm_dir, "--tls-dir", cluster_dir,
                           "--ucx-port", "0"))
    assert p.returncode == 2, p.stderr
    assert "--ucx-port" in p.stderr and "--insecure-internal" in p.stderr
    assert os.listdir(shm_dir) == []


def test_a_node_with_no_tls_setting_exits_two_naming_the_flags(shm_dir):
    p = run_node(node_args("tls-none", "127.0.0.1:0", MiB, shm_dir))
    assert p.returncode == 2 and "--tls-dir" in p.stderr and "--insecure-internal" in p.stderr
    assert os.listdir(shm_dir) == []


def test_a_bad_tls_folder_exits_two_naming_it(shm_dir, tmp_path):
    p = run_node(node_args("tls-bad", "127.0.0.1:0", MiB, shm_dir, "--tls-dir",
                           str(tmp_path / "missing")))
    assert p.returncode == 2 and "--tls-dir" in p.stderr
    assert os.listdir(shm_dir) == []


def health_of(address: str) -> int:
    with grpc.insecure_channel(address) as channel:  # a Kubernetes probe speaks no TLS
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                          timeout=5)
        return reply.status


def test_health_address_answers_plaintext_probes_serving_while_the_node_runs(shm_dir,
                                                                             cluster_dir):
    health = f"127.0.0.1:{free_port()}"
    p, ready = start_node(node_args("tls-h", "127.0.0.1:0", MiB, shm_dir, "--tls-dir",
                                    cluster_dir, "--health-address", health))
    try:
        assert health_of(health) == health_pb2.HealthCheckResponse.SERVING
        with TcpTransport(security=as_kind(cluster_dir, "worker")) as tcp:
            tcp.ping(ready["data_address"])  # the data plane itself is still TLS
    finally:
        assert stop_node(p) == 0, node_stderr(p)
    with pytest.raises(grpc.RpcError):  # gone with the node
        health_of(health)
    assert os.listdir(shm_dir) == []


# ---- in process -------------------------------------------------------------------------------

def test_segments_are_named_with_a_128_bit_incarnation(shm_dir, cluster_dir):
    tokens = set()
    for _ in range(2):
        with StorageNode(NodeConfig("n", "h", MiB, shm_dir=shm_dir),
                         security=as_kind(cluster_dir, NODE)) as node:
            assert INCARNATION.fullmatch(node.incarnation)
            (path,) = [os.path.join(shm_dir, f) for f in os.listdir(shm_dir)]
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
            assert node.info.segments[0].segment_id == f"n.{node.incarnation}.dram0"
            tokens.add(node.incarnation)
    assert len(tokens) == 2 and os.listdir(shm_dir) == []


def test_stale_files_of_this_id_are_removed_in_either_token_length_and_no_others(shm_dir):
    stale = ["pdserve-n.0123abcd.dram0", f"pdserve-n.{'ab' * 16}.dram0"]
    kept = ["pdserve-n.x.0123abcd.dram0", "pdserve-n.0123abc.dram0", "pdserve-nn.0123abcd.dram0"]
    for name in stale + kept:
        open(os.path.join(shm_dir, name), "wb").close()
    with StorageNode(NodeConfig("n", "h", MiB, shm_dir=shm_dir), security=tls.Insecure()):
        names = set(os.listdir(shm_dir))
    assert not names & set(stale) and set(kept) <= names


def test_a_segment_file_is_made_0600_whatever_the_umask_and_never_through_a_link(shm_dir):
    old = os.umask(0)
    try:
        with ShmSegment.create(os.path.join(shm_dir, "open"), 4096) as seg:
            assert stat.S_IMODE(os.stat(seg.path).st_mode) == 0o600
    finally:
        os.umask(old)
    target = os.path.join(shm_dir, "target")
    open(target, "wb").close()
    os.symlink(target, os.path.join(shm_dir, "planted"))
    with pytest.raises(SegmentError, match="planted"):  # O_EXCL: an existing name, even a link
        ShmSegment.create(os.path.join(shm_dir, "planted"), 4096)
    assert os.path.getsize(target) == 0


def test_an_in_process_node_under_tls_refuses_ucx_and_leaves_nothing(shm_dir, cluster_dir):
    node = StorageNode(NodeConfig("u", "h", MiB, shm_dir=shm_dir, ucx_port=0),
                       security=as_kind(cluster_dir, NODE))
    with pytest.raises(NodeStartError, match="--ucx-port needs --insecure-internal"):
        node.start()
    assert os.listdir(shm_dir) == []


def test_ucx_is_never_picked_or_made_unless_internal_tls_is_off(cluster_dir):
    assert pick_transport("h1", "h2", ucx=True, insecure=False) == "tcp"
    assert pick_transport("h1", "h2", ucx=True, insecure=True) == "ucx"
    assert pick_transport("h1", "h1", ucx=True, insecure=False) == "shm"
    with pytest.raises(TransportUnavailable, match="--insecure-internal"):
        UcxTransport(security=as_kind(cluster_dir, "worker"))
    with pytest.raises(PermissionError, match="--insecure-internal"):
        UcxDataServer({}, "127.0.0.1", security=as_kind(cluster_dir, NODE))
