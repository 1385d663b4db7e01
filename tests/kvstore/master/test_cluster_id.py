"""Cluster identity: a master serves one cluster, keeps it in its journal, refuses the others.

The core claims an id once and keeps it through snapshots and replay; a master process started
with `--cluster-id` refuses a client of another cluster with FAILED_PRECONDITION naming both
ids (the client raises ClusterRefused), serves clients of its own cluster or of none, and keeps
the id when restarted on its journal without the flag; started for another cluster on that
journal it exits 1 naming both. With Redis HA, a standby names the leader when it refuses a
call, and a standby started for another cluster gives the lease back and exits 1 when it takes
over the journal.
"""

from __future__ import annotations

import subprocess
import sys
import time

import grpc
import pytest

from pdserve import rpc
from pdserve.core.identity import MASTER
from pdserve.kvstore.channel import cluster_mismatch, leader_hint
from pdserve.kvstore.dist_client import ClusterRefused, DistStoreClient
from pdserve.kvstore.master import ClusterIdConflict, MasterConfig, MasterCore
from pdserve.proto import kvmaster_pb2 as pb
from pdserve.proto import kvmaster_pb2_grpc as pb_grpc
from tests.helpers import REPO_ROOT, free_port
from tests.kvstore.master.test_ha_processes import is_leader
from tests.kvstore.test_dist_store import _env, start_master, stop


def test_the_core_claims_once_and_keeps_the_id_through_snapshot_and_replay():
    core = MasterCore(MasterConfig())
    assert core.claim_cluster_id("", 1.0) == ""  # nothing claimed: any caller
    assert core.claim_cluster_id("prod-a", 1.0) == "prod-a"
    assert core.claim_cluster_id("", 2.0) == "prod-a"  # started without the flag: kept
    assert core.claim_cluster_id("prod-a", 2.0) == "prod-a"
    with pytest.raises(ClusterIdConflict, match="'prod-b'.*'prod-a'"):
        core.claim_cluster_id("prod-b", 3.0)
    records = core.take_journal()
    assert [r.op for r in records] == ["cluster"]
    assert MasterCore.restore(MasterConfig(), None, records, 5.0).cluster_id == "prod-a"
    snap = core.snapshot()
    assert MasterCore.restore(MasterConfig(), snap, [], 5.0).cluster_id == "prod-a"
    del snap["cluster_id"]  # a snapshot written before cluster ids existed
    assert MasterCore.restore(MasterConfig(), snap, [], 5.0).cluster_id == ""


def test_mismatch_rule():
    assert cluster_mismatch("", "a") is None and cluster_mismatch("a", "") is None
    assert cluster_mismatch("a", "a") is None
    assert cluster_mismatch("b", "a") == ("cluster id mismatch: the caller's cluster id is 'b', "
                                          "the store master's is 'a'")


def leader_info(address: str) -> pb.GetLeaderResponse:
    with rpc.make_channel(address, MASTER) as ch:
        return pb_grpc.KVMasterStub(ch).GetLeader(pb.GetLeaderRequest(), timeout=5)


def test_a_master_refuses_other_clusters_and_keeps_its_id_across_restarts(tmp_path):
    address = f"127.0.0.1:{free_port()}"
    journal = str(tmp_path / "journal")
    m = start_master(address, journal, "--cluster-id", "prod-a")
    try:
        assert leader_info(address).cluster_id == "prod-a"
        with DistStoreClient(address, cluster_id="prod-b") as other:
            with pytest.raises(ClusterRefused) as e:
                other.exists(["k"])
            assert "'prod-b'" in str(e.value) and "'prod-a'" in str(e.value)
            assert not other.store_down  # a refusal is an answer, not an outage
        for mine in ("prod-a", ""):
            with DistStoreClient(address, cluster_id=mine) as client:
                assert client.exists(["k"]) == [False]
                assert client.check_cluster().cluster_id == "prod-a"
    finally:
        stop(m)
    m = start_master(address, journal)  # restarted on its journal, without the flag
    try:
        assert leader_info(address).cluster_id == "prod-a"
        with DistStoreClient(address, cluster_id="prod-b") as other:
            with pytest.raises(ClusterRefused):
                other.exists(["k"])
    finally:
        stop(m)
    p = subprocess.run([sys.executable, "-m", "pdserve.kvstore.master", "--address", address,
                        "--journal-dir", journal, "--cluster-id", "prod-b"], cwd=REPO_ROOT,
                       env=_env(), capture_output=True, text=True, timeout=60)
    assert p.returncode == 1
    assert "cluster id mismatch" in p.stderr
    assert "'prod-b'" in p.stderr and "'prod-a'" in p.stderr


def test_a_bad_cluster_id_is_refused_naming_the_flag(tmp_path):
    p = subprocess.run([sys.executable, "-m", "pdserve.kvstore.master", "--address",
                        f"127.0.0.1:{free_port()}", "--journal-dir", str(tmp_path),
                        "--cluster-id", "no spaces"], cwd=REPO_ROOT, env=_env(),
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "cluster_id" in p.stderr


def start_ha(address: str, redis_port: int, cluster_id: str) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-m", "pdserve.kvstore.master", "--address", address,
                          "--redis-url", f"redis://127.0.0.1:{redis_port}",
                          "--leader-lease-s", "2", "--tick-s", "0.2", "--cluster-id", cluster_id],
                         env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    rpc.wait_healthy(address, timeout_s=30, peer=MASTER)
    return p


def test_ha_standby_names_the_leader_and_refuses_a_journal_of_another_cluster(redis_server):
    addrs = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    procs = [start_ha(addrs[0], redis_server, "green")]
    try:
        deadline = time.monotonic() + 10
        while not is_leader(addrs[0]):
            assert time.monotonic() < deadline, "the first master never became leader"
            time.sleep(0.05)
        assert leader_info(addrs[0]).cluster_id == "green"  # claimed in the Redis journal
        procs.append(start_ha(addrs[1], redis_server, "blue"))
        with rpc.make_channel(addrs[1], MASTER) as ch:
            with pytest.raises(grpc.RpcError) as e:
                pb_grpc.KVMasterStub(ch).Stats(pb.MasterStatsRequest(), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert leader_hint(e.value) == addrs[0]  # a client asks the leader next
        procs[0].kill()  # kill -9 the leader: the blue standby wins the lease, finds green
        procs[0].wait()
        assert procs[1].wait(timeout=30) == 1
        err = procs[1].stderr.read()
        assert "cluster id mismatch" in err and "'blue'" in err and "'green'" in err
    finally:
        for p in procs:
            stop(p)
            p.stderr.close()
