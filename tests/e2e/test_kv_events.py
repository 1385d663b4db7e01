"""A worker streams its prefix cache's changes (WatchKvEvents): a snapshot, then stored and
removed blocks, with the engine's own chained hashes. Real worker process, tiny model."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from pdserve import rpc
from pdserve.core.block_hash import prompt_block_hashes
from pdserve.core.identity import WORKER
from pdserve.proto import common_pb2
from pdserve.proto import worker_pb2 as wpb
from pdserve.proto import worker_pb2_grpc as wpb_grpc
from pdserve.router.kv_feed import KvFeeds
from tests.helpers import free_port, start_process, stop_process

NUM_BLOCKS = 12
BS = 16


@pytest.fixture(scope="module")
def worker(tiny_llama_dir):
    store_addr = f"127.0.0.1:{free_port()}"
    store = start_process([sys.executable, "-m", "pdserve.kvstore", "--address", store_addr],
                          store_addr)
    addr = f"127.0.0.1:{free_port()}"
    proc = start_process([sys.executable, "-m", "pdserve.worker", "--role", "prefill", "--model",
                          tiny_llama_dir, "--address", addr, "--store-address", store_addr,
                          "--store-kind", "simple", "--num-blocks", str(NUM_BLOCKS),
                          "--block-size-tokens", str(BS)], addr, timeout_s=120)
    yield addr
    assert stop_process(proc, timeout_s=15) == 0
    stop_process(store)


def prefill(addr: str, rid: str, prompt: list[int]) -> None:
    with rpc.make_channel(addr, WORKER) as ch:
        wpb_grpc.WorkerStub(ch).Prefill(wpb.PrefillRequest(
            request_id=rid, prompt_token_ids=prompt,
            sampling=common_pb2.SamplingParams(max_tokens=1)), timeout=60)


def collect(addr: str, until) -> list:
    """Read the stream until `until(batches)` holds; the first batch is the snapshot."""
    batches: list = []
    with rpc.make_channel(addr, WORKER) as ch:
        call = wpb_grpc.WorkerStub(ch).WatchKvEvents(wpb.WatchKvEventsRequest(), timeout=30)
        for b in call:
            batches.append(b)
            if until(batches):
                call.cancel()
                break
    return batches


def stored(batches) -> set[bytes]:
    return {e.block_hash for b in batches for e in b.events if e.kind == wpb.KV_EVENT_KIND_STORED}


def removed(batches) -> set[bytes]:
    return {e.block_hash for b in batches for e in b.events if e.kind == wpb.KV_EVENT_KIND_REMOVED}


def test_stream_reports_stored_then_removed_blocks(worker):
    first = list(range(1000, 1000 + 4 * BS + 1))  # 4 full blocks and one more token
    want = set(prompt_block_hashes(first, BS))
    prefill(worker, "a", first)
    # A fresh subscriber gets them in its snapshot, with the worker's block size and model id.
    snap = collect(worker, lambda bs: True)[0]
    assert snap.snapshot and snap.block_size_tokens == BS and snap.model_id
    assert want <= stored([snap])

    # Live: a prompt that needs every block evicts the first prompt's blocks.
    second = list(range(5000, 5000 + NUM_BLOCKS * BS - 1))  # takes every block
    second_hashes = set(prompt_block_hashes(second, BS))
    timer = threading.Timer(0.5, prefill, (worker, "b", second))
    timer.start()
    try:
        batches = collect(worker, lambda bs: want <= removed(bs[1:])
                          and second_hashes <= stored(bs[1:]))
    finally:
        timer.join()
    assert not any(b.snapshot for b in batches[1:])
    assert [b.seq for b in batches[1:]] == sorted(b.seq for b in batches[1:])


def test_router_feed_indexes_the_workers_cache(worker):
    prompt = list(range(9000, 9000 + 3 * BS + 2))
    hashes = prompt_block_hashes(prompt[:-1], BS)
    feeds = KvFeeds([worker], retry_s=0.2).start()
    try:
        prefill(worker, "c", prompt)
        deadline = time.monotonic() + 20
        while feeds.overlaps(hashes, BS)[0] != [3] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert feeds.overlaps(hashes, BS) == ([3], 0)
        assert feeds.overlaps(hashes, 32) == ([0], 0)  # another block size: nothing claimed
    finally:
        feeds.close()


def test_router_feed_indexes_the_stores_blocks(tmp_path):
    """The store master's WatchEvents feed the index: keys map back to block hashes."""
    from pdserve.kvstore.client import BlockKey, Plane, format_key
    from pdserve.kvstore.dist_client import DistStoreClient
    from pdserve.router.kv_index import store_source
    from tests.kvstore.test_dist_store import start_master, start_node, stop, wait_nodes

    master = f"127.0.0.1:{free_port()}"
    procs = [start_master(master, str(tmp_path / "journal"))]
    procs.append(start_node("feed-node", master)[0])
    feeds = KvFeeds([], master, retry_s=0.2).start()
    hashes = prompt_block_hashes(list(range(300, 300 + 4 * BS)), BS)
    keys = [format_key(BlockKey("m@float32", "", h, 0, 2, Plane.FULL)) for h in hashes]
    source = store_source("m@float32")

    def overlap() -> int:
        with feeds.lock:
            return feeds.index.overlap(source, hashes)

    def wait_for(n: int) -> None:
        deadline = time.monotonic() + 20
        while overlap() != n and time.monotonic() < deadline:
            time.sleep(0.05)
        assert overlap() == n

    try:
        with DistStoreClient(master) as client:
            wait_nodes(client, 1)
            for k in keys:
                client.put_from(k, bytes(1024))
            wait_for(4)
            client.remove(keys[1])
            wait_for(1)
    finally:
        feeds.close()
        for p in reversed(procs):
            stop(p)
