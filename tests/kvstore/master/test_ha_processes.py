"""High availability with real processes: two masters share a Redis journal and lease.

The leader is killed with -9 under a stream of puts; the standby wins the lease, rebuilds the
metadata from Redis, and the client (given both addresses) follows it. Every put the client saw
committed is still there.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import numpy as np

from pdserve import rpc
from pdserve.core.identity import MASTER
from pdserve.kvstore.dist_client import DistStoreClient, DistStoreError
from pdserve.proto import kvmaster_pb2 as pb
from pdserve.proto import kvmaster_pb2_grpc as pb_grpc
from tests.helpers import free_port
from tests.kvstore.test_dist_store import _env, payload, start_node, stop, wait_nodes


def start_ha_master(address: str, redis_port: int, log_dir) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-m", "pdserve.kvstore.master", "--address", address,
                          "--redis-url", f"redis://127.0.0.1:{redis_port}",
                          "--leader-lease-s", "2", "--tick-s", "0.2"],
                         env=_env(), stdout=subprocess.DEVNULL,
                         stderr=open(log_dir / f"master-{address.split(':')[1]}.log", "w"))
    rpc.wait_healthy(address, timeout_s=30, peer=MASTER)
    return p


def wait_for(cond, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def is_leader(address: str) -> bool:
    with rpc.make_channel(address, MASTER) as ch:
        return pb_grpc.KVMasterStub(ch).GetLeader(pb.GetLeaderRequest(), timeout=5).is_leader


def test_standby_takes_over_with_every_committed_object(redis_server, tmp_path):
    addrs = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    masters = [start_ha_master(addrs[0], redis_server, tmp_path)]
    deadline = time.monotonic() + 10
    while not is_leader(addrs[0]):  # let the first one win the lease before the second starts
        assert time.monotonic() < deadline, "the first master never became leader"
        time.sleep(0.05)
    masters.append(start_ha_master(addrs[1], redis_server, tmp_path))
    node, _ = start_node("ha-node", ",".join(addrs))
    try:
        assert is_leader(addrs[0]) and not is_leader(addrs[1])
        committed: list[str] = []
        done = threading.Event()
        with DistStoreClient(addrs, timeout_s=2) as client:
            wait_nodes(client, 1)

            def writer():
                i = 0
                deadline = time.monotonic() + 40
                while not done.is_set() and time.monotonic() < deadline:
                    try:
                        client.put_from(f"ha{i}", payload(i, 32 * 1024))
                        committed.append(f"ha{i}")
                        i += 1
                    except DistStoreError:
                        time.sleep(0.1)  # failover in progress: retry the same key

            t = threading.Thread(target=writer)
            t.start()
            wait_for(lambda: len(committed) >= 10)
            before = len(committed)
            masters[0].kill()  # kill -9 the leader
            masters[0].wait()
            deadline = time.monotonic() + 20
            while len(committed) < before + 10:
                assert time.monotonic() < deadline, "puts did not resume after failover"
                time.sleep(0.1)
            done.set()
            t.join(timeout=30)
            assert is_leader(addrs[1])
            assert all(client.exists(committed))
            out = np.zeros(32 * 1024, dtype=np.uint8)
            client.get_into(committed[before - 1], out)
            assert np.array_equal(out, payload(before - 1, 32 * 1024))
    finally:
        stop(node)
        for m in masters:
            stop(m)
