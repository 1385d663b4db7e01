"""The distributed store with real processes: a master, two storage nodes, clients.

Puts and gets over shared memory and TCP, replicas on distinct nodes, and the faults the store
must survive: a storage node killed with -9, the master killed with -9 under a stream of puts, and
bytes flipped on one replica.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from pdserve import rpc
from pdserve.core.identity import MASTER
from pdserve.kvstore.dist_client import (DistStoreClient, DistStoreError, ObjectNotFound,
                                          StoreFull)
from pdserve.kvstore.transport.base import Extent
from pdserve.kvstore.transport.shm import ShmTransport
from pdserve.proto import kvmaster_pb2 as pb
from tests.helpers import REPO_ROOT, free_port

MIB = 1 << 20


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return env


def start_master(address: str, journal_dir: str, *extra: str) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-m", "pdserve.kvstore.master", "--address", address,
                          "--journal-dir", journal_dir, "--node-timeout-s", "3",
                          "--tick-s", "0.2", *extra], env=_env(), stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE)
    rpc.wait_healthy(address, timeout_s=30, peer=MASTER)
    return p


def start_node(node_id: str, master: str, dram_bytes: int = 64 * MIB) -> tuple[subprocess.Popen, dict]:
    p = subprocess.Popen([sys.executable, "-m", "pdserve.kvstore.node", "--node-id", node_id,
                          "--dram-bytes", str(dram_bytes), "--master", master,
                          "--heartbeat-s", "0.3"],
                         env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    assert line, p.stderr.read()
    return p, json.loads(line)


def wait_nodes(client: DistStoreClient, n: int, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while client.stats().nodes_alive < n:
        assert time.monotonic() < deadline, "storage nodes did not register"
        time.sleep(0.1)


def stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


@pytest.fixture
def cluster(tmp_path):
    master = f"127.0.0.1:{free_port()}"
    procs = [start_master(master, str(tmp_path / "journal"))]
    nodes = {}
    for i in range(2):
        p, info = start_node(f"node{i}", master)
        procs.append(p)
        nodes[f"node{i}"] = (p, info)
    yield master, nodes, procs, tmp_path
    for p in reversed(procs):
        stop(p)
    for _, info in nodes.values():  # a node killed with -9 could not unlink its segment
        for seg in info["segments"]:
            if seg["shm_path"] and os.path.exists(seg["shm_path"]):
                os.unlink(seg["shm_path"])


def payload(i: int, size: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 255, size, dtype=np.uint8)


def test_put_get_over_shared_memory_and_tcp_with_two_replicas(cluster):
    master, nodes, *_ = cluster
    with DistStoreClient(master) as local, DistStoreClient(master, host_id="elsewhere") as remote:
        wait_nodes(local, 2)
        for i, size in enumerate((4096, 3 * MIB + 5, 8 * MIB)):
            data = payload(i, size)
            assert local.put_from(f"k{i}", data, replicas=2)
            assert not local.put_from(f"k{i}", data, replicas=2)  # already stored
            for client in (local, remote):  # shm path and TCP path
                out = np.zeros(size, dtype=np.uint8)
                assert client.get_into(f"k{i}", out) == size
                assert np.array_equal(out, data)
        info = local._call("Get", pb.MasterGetRequest(keys=["k2"])).objects[0]
        assert len({r.node_id for r in info.replicas}) == 2
        assert local.exists(["k0", "nope"]) == [True, False]
        assert local.longest_prefix(["k0", "k1", "nope", "k2"]) == 2
        with pytest.raises(ObjectNotFound):
            local.get_into("nope", np.zeros(10, dtype=np.uint8))
        # Two writers of the same content-named key at once (two prefills of one prompt): the
        # second steps aside instead of failing, and the first one's commit serves readers.
        data = payload(9, 8192)
        local._call("PutStart", pb.PutStartRequest(key="race", size_bytes=8192, replicas=1))
        assert not remote.put_from("race", data)
        assert not local.exists(["race"])[0]
        local._call("PutAbort", pb.PutAbortRequest(key="race"))
        assert remote.put_from("race", data)


def test_storage_node_killed_with_two_replicas_every_object_reads_back(cluster):
    master, nodes, *_ = cluster
    with DistStoreClient(master, host_id="elsewhere") as client:  # TCP: a dead node is gone
        wait_nodes(client, 2)
        objects = {f"obj{i}": payload(i, 256 * 1024 + i) for i in range(20)}
        for key, data in objects.items():
            client.put_from(key, data, replicas=2)
        nodes["node0"][0].kill()  # kill -9
        nodes["node0"][0].wait()
        for key, data in objects.items():
            out = np.zeros(data.size, dtype=np.uint8)
            client.get_into(key, out)
            assert np.array_equal(out, data)
        # The master notices the silent node and drops its replicas; reads still work.
        deadline = time.monotonic() + 15
        while client.stats().nodes_alive > 1:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        out = np.zeros(objects["obj3"].size, dtype=np.uint8)
        client.get_into("obj3", out)
        assert np.array_equal(out, objects["obj3"])


def test_flipped_bytes_on_one_replica_are_caught_and_the_replica_dropped(cluster):
    master, *_ = cluster
    with DistStoreClient(master) as client:
        wait_nodes(client, 2)
        data = payload(7, MIB)
        client.put_from("victim", data, replicas=2)
        info = client._call("Get", pb.MasterGetRequest(keys=["victim"])).objects[0]
        bad = info.replicas[0]
        with ShmTransport() as shm:  # flip bytes in one replica, behind the store's back
            ext = Extent(bad.node_id, bad.host_id, bad.data_address, bad.segment_id,
                         bad.shm_path, bad.offset_bytes, 64, bad.tier)
            shm.write(ext, memoryview(bytes(64 * [0xAB])))
        # The client reads replicas in the master's order, so it meets the bad copy first.
        for _ in range(2):
            out = np.zeros(MIB, dtype=np.uint8)
            client.get_into("victim", out)
            assert np.array_equal(out, data)
        assert client.corrupt_reports == 1  # reported once; the second read never saw it
        info = client._call("Get", pb.MasterGetRequest(keys=["victim"])).objects[0]
        assert len(info.replicas) == 1 and info.replicas[0].node_id != bad.node_id


def test_master_killed_under_puts_restarts_with_every_committed_object(cluster):
    master, nodes, procs, tmp_path = cluster
    committed: list[str] = []
    stop_flag = threading.Event()
    with DistStoreClient(master, timeout_s=5) as client:
        wait_nodes(client, 2)
        # An object whose put started but never committed must not survive.
        pending = client._call("PutStart", pb.PutStartRequest(key="uncommitted", size_bytes=4096,
                                                              checksum=0, replicas=1))
        assert pending.placements

        def writer():
            i = 0
            while not stop_flag.is_set():
                try:
                    client.put_from(f"stream{i}", payload(i, 64 * 1024))
                    committed.append(f"stream{i}")
                except DistStoreError:
                    return
                i += 1

        t = threading.Thread(target=writer)
        t.start()
        deadline = time.monotonic() + 20
        while len(committed) < 10:  # kill it mid-stream, once puts are flowing
            assert time.monotonic() < deadline, "puts did not start"
            time.sleep(0.05)
        procs[0].kill()  # kill -9 the master mid-stream
        procs[0].wait()
        stop_flag.set()
        t.join(timeout=30)
    assert len(committed) > 5
    procs[0] = start_master(master, str(tmp_path / "journal"))
    with DistStoreClient(master) as client:
        assert all(client.exists(committed))
        assert client.exists(["uncommitted"]) == [False]
        for key in committed[-3:]:
            i = int(key.removeprefix("stream"))
            out = np.zeros(64 * 1024, dtype=np.uint8)
            client.get_into(key, out)
            assert np.array_equal(out, payload(i, 64 * 1024))


def test_event_stream_reports_stored_and_removed_objects(cluster):
    master, *_ = cluster
    from pdserve.proto import kvmaster_pb2_grpc as pb_grpc

    with DistStoreClient(master) as client:
        wait_nodes(client, 2)
        client.put_from("watched", payload(1, 4096))
        client.remove("watched")
        with rpc.make_channel(master, MASTER) as ch:
            stream = pb_grpc.KVMasterStub(ch).WatchEvents(pb.WatchEventsRequest(after_seq=0),
                                                          timeout=10)
            seen = []
            for ev in stream:
                if ev.key == "watched":
                    seen.append(ev.kind)
                if seen[-1:] == ["removed"]:
                    stream.cancel()
                    break
    assert seen == ["stored", "removed"]


def test_batch_get_reads_many_objects_with_one_master_call(cluster):
    master, *_ = cluster
    with DistStoreClient(master) as client:
        wait_nodes(client, 2)
        objs = {f"b{i}": payload(i, 64 * 1024) for i in range(50)}
        for k, v in objs.items():
            client.put_from(k, v)
        before = _calls(client)
        bufs = [np.zeros(64 * 1024, dtype=np.uint8) for _ in range(51)]
        sizes = client.batch_get_into(list(objs) + ["missing"], bufs)
        assert sizes == [64 * 1024] * 50 + [None]
        assert all(np.array_equal(b, v) for b, v in zip(bufs, objs.values()))
        after = _calls(client)
        # The master's own count: one Get for the 51 keys, and the 50 puts before it.
        assert after["Get"].calls - before.get("Get", _NONE).calls == 1
        assert after["PutStart"].calls >= 50 and after["PutCommit"].calls >= 50
        for m in after.values():  # a histogram as Prometheus lists one
            assert list(m.cumulative) == sorted(m.cumulative) and m.cumulative[-1] == m.calls
            assert len(m.cumulative) == len(m.bounds_s) + 1 and m.seconds > 0


def test_a_decode_fetch_locates_a_prompts_blocks_with_one_master_call(cluster):
    from pdserve.core.step_profile import load_profile
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.emulated import emulated_engine
    from pdserve.engine.model_files import default_model_path
    from pdserve.worker.guarded_store import GuardedStore
    from pdserve.worker.kv_blocks import fetch_run

    master, *_ = cluster
    engine = emulated_engine(EngineConfig(default_model_path()), load_profile("h100-llama3-8b"),
                             kv_scale=1 / 64)
    size = engine.kv.block_bytes
    with DistStoreClient(master) as client:
        wait_nodes(client, 2)
        blocks = [bytes([i]) * size for i in range(30)]
        keys = [f"blk{i}" for i in range(30)]
        store = GuardedStore(client)
        store.batch_put_from([(k, memoryview(b), None) for k, b in zip(keys[:20], blocks)])
        before = _calls(client)
        # The first 20 are stored: they are read in order, the run stops at the first miss.
        got = fetch_run(store, engine, [k.encode() for k in keys], keys)
        assert [b for _, b in got] == blocks[:20]
        assert _calls(client)["Get"].calls - before.get("Get", _NONE).calls == 1
        # A reader of a key the store does not hold says so when used, as get_into does.
        reader, = client.readers(["nowhere"])
        with pytest.raises(ObjectNotFound, match="nowhere is not stored"):
            reader(bytearray(size))


def test_batch_put_stores_many_objects_with_two_master_calls(cluster):
    master, *_ = cluster
    with DistStoreClient(master) as client:
        wait_nodes(client, 2)
        objs = {f"p{i}": payload(100 + i, 4096 + i) for i in range(40)}
        before = _calls(client)
        assert client.batch_put_from(list(objs.items())) == 40
        after = _calls(client)
        # One call to start the 40 puts and one to commit them, each one journal write.
        for m in ("BatchPutStart", "BatchPutCommit"):
            assert after[m].calls - before.get(m, _NONE).calls == 1, m
        assert after.get("PutStart", _NONE).calls == before.get("PutStart", _NONE).calls
        for k, v in objs.items():
            out = np.zeros(v.size, dtype=np.uint8)
            assert client.get_into(k, out) == v.size and np.array_equal(out, v)
        # Keys name content: the stored ones are skipped, the new one is stored.
        again = [*objs.items(), ("p-new", payload(7, 100))]
        assert client.batch_put_from(again) == 1
        assert client.exists(["p0", "p-new"]) == [True, True]


def test_batch_put_stores_what_fits_and_says_the_store_is_full(cluster):
    master, *_ = cluster
    with DistStoreClient(master) as client:  # two nodes of 64 MiB, one replica each
        wait_nodes(client, 2)
        big = [(f"f{i}", payload(200 + i, 40 * MIB)) for i in range(4)]
        with pytest.raises(StoreFull, match="BatchPutStart: f"):
            client.batch_put_from(big)
        stored = client.exists([k for k, _ in big])
        assert 1 <= sum(stored) < 4
        for (k, v), ok in zip(big, stored):
            if ok:
                out = np.zeros(v.size, dtype=np.uint8)
                assert client.get_into(k, out) == v.size and np.array_equal(out, v)


_NONE = pb.MethodCalls()


def _calls(client: DistStoreClient) -> dict[str, pb.MethodCalls]:
    return {m.method: m for m in client.stats().methods}


def test_a_restarted_node_removes_the_segment_file_its_killed_predecessor_left(tmp_path):
    master = f"127.0.0.1:{free_port()}"
    procs = [start_master(master, str(tmp_path / "journal"))]
    try:
        first, info = start_node("stale-node", master, dram_bytes=4 * MIB)
        procs.append(first)
        stale = info["segments"][0]["shm_path"]
        first.kill()  # kill -9: no chance to unlink its segment
        first.wait()
        assert os.path.exists(stale)
        second, info2 = start_node("stale-node", master, dram_bytes=4 * MIB)
        procs.append(second)
        assert not os.path.exists(stale)
        assert os.path.exists(info2["segments"][0]["shm_path"])
    finally:
        for p in reversed(procs):
            stop(p)
