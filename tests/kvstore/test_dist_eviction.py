"""Eviction and the SSD tier with real processes.

Filling a node's DRAM past the high-water mark evicts the least recently used objects first and
keeps recently read ones; with an SSD tier, evicted objects are demoted to files and still read
back intact. Used bytes never pass the segment: the DRAM bound holds.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np

from pdserve.kvstore.dist_client import DistStoreClient
from pdserve.proto import kvmaster_pb2 as pb
from tests.helpers import free_port
from tests.kvstore.test_dist_store import _env, payload, start_master, stop, wait_nodes

MIB = 1 << 20


def start_node_with(node_id: str, master: str, dram: int, ssd_dir: str | None = None,
                    ssd_bytes: int = 0) -> subprocess.Popen:
    args = [sys.executable, "-m", "pdserve.kvstore.node", "--node-id", node_id,
            "--dram-bytes", str(dram), "--master", master, "--heartbeat-s", "0.3"]
    if ssd_dir:
        args += ["--ssd-dir", ssd_dir, "--ssd-bytes", str(ssd_bytes)]
    p = subprocess.Popen(args, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    assert p.stdout.readline(), p.stderr.read()
    return p


def dram_stats(client: DistStoreClient) -> pb.TierStats:
    return next(t for t in client.stats().tiers if t.tier == "dram")


def test_lru_objects_are_evicted_first_and_dram_stays_bounded(tmp_path):
    master = f"127.0.0.1:{free_port()}"
    procs = [start_master(master, str(tmp_path / "j"), "--lease-s", "0.3")]
    procs.append(start_node_with("evict-node", master, dram=16 * MIB))
    try:
        with DistStoreClient(master) as client:
            wait_nodes(client, 1)
            for i in range(12):  # 12 MiB of 16: past the 90% mark only with what follows
                client.put_from(f"old{i}", payload(i, MIB))
            time.sleep(0.4)  # read leases (0.3 s here) are time-based: let them lapse
            out = np.zeros(MIB, dtype=np.uint8)
            client.get_into("old0", out)  # old0 becomes the most recently used of the old ones
            for i in range(6):
                client.put_from(f"new{i}", payload(100 + i, MIB))
                assert dram_stats(client).used_bytes <= 16 * MIB
            present = dict(zip([f"old{i}" for i in range(12)],
                               client.exists([f"old{i}" for i in range(12)])))
            assert present["old0"], "a recently read object was evicted before older ones"
            assert not present["old1"] and not present["old2"], "the oldest were kept"
            assert all(client.exists([f"new{i}" for i in range(6)]))
            assert dram_stats(client).evictions > 0
    finally:
        for p in reversed(procs):
            stop(p)


def test_evicted_objects_spill_to_ssd_and_read_back(tmp_path):
    master = f"127.0.0.1:{free_port()}"
    procs = [start_master(master, str(tmp_path / "j"))]
    procs.append(start_node_with("ssd-node", master, dram=8 * MIB, ssd_dir=str(tmp_path / "ssd"),
                                 ssd_bytes=64 * MIB))
    try:
        with DistStoreClient(master) as client:
            wait_nodes(client, 1)
            objects = {f"obj{i}": payload(i, MIB) for i in range(20)}  # 20 MiB through 8 of DRAM
            for key, data in objects.items():
                client.put_from(key, data)
            deadline = time.monotonic() + 20
            while next(t for t in client.stats().tiers if t.tier == "ssd").objects == 0:
                assert time.monotonic() < deadline, "nothing was demoted to the SSD tier"
                time.sleep(0.2)
            assert all(client.exists(list(objects)))
            for key, data in objects.items():
                out = np.zeros(MIB, dtype=np.uint8)
                client.get_into(key, out)
                assert np.array_equal(out, data), key
            assert os.listdir(tmp_path / "ssd")
            # A cold object read from SSD comes back into DRAM (the master copies it after the
            # read), and reads back intact from there.
            cold = next(k for k in objects if [t for _, t in client.locate(k)] == ["ssd"])
            deadline = time.monotonic() + 20
            while [t for _, t in client.locate(cold)] != ["dram"]:
                assert time.monotonic() < deadline, f"{cold} was not promoted back to DRAM"
                time.sleep(0.2)
            out = np.zeros(MIB, dtype=np.uint8)
            client.get_into(cold, out)
            assert np.array_equal(out, objects[cold])
    finally:
        for p in reversed(procs):
            stop(p)
