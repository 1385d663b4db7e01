"""Store clients ride out a store that restarts, and fail fast while it is gone.

The pure retry rule (`kvstore.retry`) on its own; then real processes on loopback: a master that
comes up while a client's operation is retrying is reached within that operation (the channel
reconnects within a second, not gRPC's default minutes); a client that found no master fails its
next operations at once (one round of attempts, no backoff) until one answers; the simple store's
client does the same; a client drops its mapping of a node's old segment file when the node
comes back as a new incarnation.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import numpy as np
import pytest

from pdserve.kvstore.client import KVStoreClient
from pdserve.kvstore.dist_client import DistStoreClient, StoreUnreachable
from pdserve.kvstore.retry import StoreRetryPolicy
from pdserve.kvstore.store import StoreError
from tests.helpers import free_port, start_process, stop_process
from tests.kvstore.test_dist_store import payload, start_master, start_node, stop, wait_nodes


def test_retry_rule():
    p = StoreRetryPolicy(budget_s=3.0, backoff_s=0.05, backoff_max_s=0.5)
    assert [p.delay_s(n) for n in (1, 2, 3, 4, 5, 6, 100)] == [0.05, 0.1, 0.2, 0.4, 0.5, 0.5,
                                                                  0.5]
    d = p.decide(1, "UNAVAILABLE", 0.0, store_down=False)
    assert d.retry and d.delay_s == 0.05
    assert p.decide(3, "DEADLINE_EXCEEDED", 1.0, store_down=False).retry
    for code in ("FAILED_PRECONDITION", "RESOURCE_EXHAUSTED", "INVALID_ARGUMENT", "ABORTED",
                 "INTERNAL"):
        assert not p.decide(1, code, 0.0, store_down=False).retry
    assert not p.decide(1, "UNAVAILABLE", 0.0, store_down=True).retry  # known down: fail fast
    assert not p.decide(5, "UNAVAILABLE", 2.6, store_down=False).retry  # 2.6 + 0.5 > 3
    assert p.decide(5, "UNAVAILABLE", 2.4, store_down=False).retry
    assert p.attempt_timeout(0.0, store_down=False) == 3.0
    assert p.attempt_timeout(2.9, store_down=False) == 0.25  # a last attempt gets its minimum
    assert p.attempt_timeout(0.0, store_down=True) == 1.0
    with pytest.raises(ValueError, match="rounds is 1-based"):
        p.decide(0, "UNAVAILABLE", 0.0, store_down=False)
    with pytest.raises(ValueError, match="budget_s"):
        StoreRetryPolicy(budget_s=-1)
    with pytest.raises(ValueError, match="attempt_timeout_s"):
        StoreRetryPolicy(attempt_timeout_s=0)


def test_an_operation_reaches_a_master_that_starts_while_it_retries(tmp_path):
    master = f"127.0.0.1:{free_port()}"
    procs = []

    def start_late():
        time.sleep(1.0)
        procs.append(start_master(master, str(tmp_path / "journal")))

    with DistStoreClient(master, retry=StoreRetryPolicy(budget_s=20.0)) as client:
        t = threading.Thread(target=start_late)
        t.start()
        try:
            assert client.exists(["k"]) == [False]  # one operation, across the master's start
            assert not client.store_down
        finally:
            t.join()
            for p in procs:
                stop(p)


def test_a_client_that_found_no_master_fails_fast_until_one_answers(tmp_path):
    master = f"127.0.0.1:{free_port()}"
    waits: list[float] = []
    with DistStoreClient(master, retry=StoreRetryPolicy(budget_s=1.0),
                         sleep=lambda s: (waits.append(s), time.sleep(s))) as client:
        with pytest.raises(StoreUnreachable, match="no master answered"):
            client.exists(["k"])
        assert client.store_down and waits  # the first operation backed off and retried
        waits.clear()
        for _ in range(3):
            with pytest.raises(StoreUnreachable, match="failing fast"):
                client.longest_prefix(["k"])
        assert waits == []  # one round each, no backoff
        m = start_master(master, str(tmp_path / "journal"))
        try:
            deadline = time.monotonic() + 10  # the channel reconnects within about a second
            while True:
                try:
                    assert client.exists(["k"]) == [False]
                    break
                except StoreUnreachable:
                    assert time.monotonic() < deadline, "the master was never reached again"
                    time.sleep(0.1)
            assert not client.store_down
        finally:
            stop(m)
        with pytest.raises(StoreUnreachable):  # the master gone again: the rule starts over
            client.exists(["k"])


def test_the_simple_store_client_rides_out_a_restart():
    address = f"127.0.0.1:{free_port()}"
    args = [sys.executable, "-m", "pdserve.kvstore", "--address", address]
    p = start_process(args, address)
    client = KVStoreClient(address, retry=StoreRetryPolicy(budget_s=20.0))
    try:
        client.put_from("a", b"first")
        stop_process(p)
        restarted = []

        def restart():
            time.sleep(1.0)
            restarted.append(start_process(args, address))

        t = threading.Thread(target=restart)
        t.start()
        client.put_from("b", b"second")  # retried until the restarted store answers
        t.join()
        assert client.get("b") == b"second" and client.get("a") is None  # memory only
        assert not client.store_down
        stop_process(restarted[0])
        quick = KVStoreClient(address, retry=StoreRetryPolicy(budget_s=0.3))
        with pytest.raises(StoreError, match="UNAVAILABLE"):
            quick.exists(["a"])
        assert quick.store_down
        quick.close()
    finally:
        client.close()
        if p.poll() is None:
            stop_process(p)


def test_a_restarted_nodes_old_segment_is_unmapped_by_clients(tmp_path):
    master = f"127.0.0.1:{free_port()}"
    procs = [start_master(master, str(tmp_path / "journal"))]
    try:
        node, info = start_node("reborn", master, dram_bytes=4 << 20)
        procs.append(node)
        old_path = info["segments"][0]["shm_path"]
        with DistStoreClient(master) as client:
            wait_nodes(client, 1)
            assert client.put_from("before", payload(1, 8192))
            assert old_path in client._shm._segments  # mapped by the write
            node.kill()  # kill -9: the old file stays until the next start of this id
            node.wait()
            node, info = start_node("reborn", master, dram_bytes=4 << 20)
            procs.append(node)
            new_path = info["segments"][0]["shm_path"]
            assert new_path != old_path and not os.path.exists(old_path)
            deadline = time.monotonic() + 20
            while not client.put_from(f"after{len(procs)}", payload(2, 8192)):
                assert time.monotonic() < deadline
            out = np.zeros(8192, dtype=np.uint8)
            client.get_into(f"after{len(procs)}", out)
            assert np.array_equal(out, payload(2, 8192))
            assert new_path in client._shm._segments
            assert old_path not in client._shm._segments  # its memory can go now
    finally:
        for p in reversed(procs):
            stop(p)
