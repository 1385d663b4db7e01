"""KV bytes through the host staging pool, on a machine without CUDA.

The pool falls back to plain (unpinned) buffers without CUDA; built with `stage_cpu=True` it
stages CPU tensors exactly as it stages device tensors (one buffer per put, a copy in, bytes
handed over, the buffer back; reads filled into buffers, then copied out), so the bytes must
round-trip exactly through a real store process, the pool must stay within its bytes however
many blocks go through, and a caller past its capacity waits, then gets a clear timeout. By
default CPU tensors are handed over zero-copy, as before the pool existed."""

from __future__ import annotations

import sys
import threading

import pytest
import torch

from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling import SamplingParams
from pdserve.kvstore.client import KVStoreClient
from pdserve.worker.kv_blocks import block_key, blocks_as_buffers, fetch_block, fetch_run
from pdserve.worker.kv_staging import HostStaging, StagingError, StagingTimeout
from tests.helpers import free_port, start_process, stop_process

KIB = 1 << 10


def test_without_cuda_the_buffers_are_plain_memory():
    if torch.cuda.is_available():
        pytest.skip("this host has CUDA: the pool pins its buffers")
    pool = HostStaging(256 * KIB)
    assert pool.pin is False
    buf = pool.acquire(1000)
    assert buf.numel() == 1000 and not buf.is_pinned()
    pool.release(buf)


def test_cpu_tensors_are_handed_over_zero_copy_by_default():
    pool = HostStaging(256 * KIB)
    t = torch.arange(16, dtype=torch.float32)
    with pool.host_views([t]) as (view,):
        t[0] = 42.0  # the view is the tensor's own memory
        assert torch.frombuffer(view, dtype=torch.float32)[0].item() == 42.0
    assert pool.allocated_bytes == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_staged_bytes_round_trip_exactly(dtype):
    pool = HostStaging(256 * KIB, stage_cpu=True)
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(3, 5, 7, generator=gen).to(dtype)
    b = torch.randn(6, 9, generator=gen).to(dtype).t()  # not contiguous
    with pool.host_views([a, b]) as views:
        assert pool.in_use_bytes > 0
        a[0, 0, 0] = 99  # staged: a copy, later writes do not reach it
        got = [torch.frombuffer(bytearray(v), dtype=dtype) for v in views]
    assert pool.in_use_bytes == 0
    assert got[0][0].item() != 99
    a[0, 0, 0] = got[0][0]
    assert torch.equal(got[0].view(torch.uint8), a.reshape(-1).view(torch.uint8))
    assert torch.equal(got[1].view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def test_the_pool_is_bounded_and_a_waiter_gets_a_freed_buffer():
    pool = HostStaging(256 * KIB, stage_cpu=True, wait_s=0.2)
    first, second = pool.acquire(128 * KIB), pool.acquire(100 * KIB)  # both 128 KiB buffers
    assert pool.allocated_bytes == 256 * KIB
    with pytest.raises(StagingTimeout, match="within 0.2s"):
        pool.acquire(64 * KIB)
    with pytest.raises(StagingError, match="does not fit the staging pool of 262144 bytes"):
        pool.acquire(300 * KIB)
    pool.wait_s = 10.0
    got = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire(128 * KIB)))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()  # waits while the pool is full
    pool.release(first)
    waiter.join(5)
    assert got and got[0].numel() == 128 * KIB
    pool.release(second)
    # A buffer of another size is dropped to make room: the pool never holds more.
    big = pool.acquire(100 * KIB + 1)
    assert pool.allocated_bytes <= 256 * KIB == pool.peak_allocated_bytes
    pool.release(big)
    pool.release(got[0])
    assert pool.in_use_bytes == 0


# ---- engine blocks through a real store ----------------------------------------------------------
@pytest.fixture(scope="module")
def store():
    addr = f"127.0.0.1:{free_port()}"
    p = start_process([sys.executable, "-m", "pdserve.kvstore", "--address", addr], addr)
    client = KVStoreClient(addr)
    yield client
    client.close()
    stop_process(p)


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return LLMEngine(EngineConfig(tiny_llama_dir, cache=CacheConfig(block_size_tokens=4,
                                                                     num_blocks=64)))


def _parked_blocks(engine, n_tokens: int, seed: int):
    ids = [(seed * 31 + i * 7) % 200 + 3 for i in range(n_tokens)]
    rid = engine.add_request(None, ids, SamplingParams(max_tokens=1), prefill_only=True)
    while engine.has_work():
        engine.step()
    return engine.take_parked_kv(rid)


def test_blocks_round_trip_through_staging_and_the_store(engine, store):
    kv = _parked_blocks(engine, 40, seed=1)  # 10 blocks
    block_bytes = kv.blocks[0].numel() * kv.blocks[0].element_size()
    # Room for about two blocks' buffers: puts and fetches of ten blocks must still fit.
    pool = HostStaging(max(64 * KIB, 2 * block_bytes), stage_cpu=True)
    keys = [block_key("tiny@float32", "stage", h, engine.model_config.num_hidden_layers)
            for h in kv.block_hashes]
    with blocks_as_buffers(kv.blocks, pool) as bufs:
        store.batch_put_from([(k, *buf) for k, buf in zip(keys, bufs)])
    assert pool.in_use_bytes == 0
    got = fetch_run(store, engine, kv.block_hashes, keys, staging=pool)
    assert [h for h, _ in got] == kv.block_hashes
    for (_, block), want in zip(got, kv.blocks):
        assert block.dtype == want.dtype and block.shape == want.shape
        assert torch.equal(block.view(torch.uint8), want.view(torch.uint8))
    assert pool.in_use_bytes == 0 and pool.peak_allocated_bytes <= pool.capacity_bytes


def test_a_run_stops_at_the_first_missing_block_and_gives_every_buffer_back(engine, store):
    kv = _parked_blocks(engine, 24, seed=2)  # 6 blocks; the fourth is never put
    keys = [block_key("tiny@float32", "gap", h, engine.model_config.num_hidden_layers)
            for h in kv.block_hashes]
    pool = HostStaging(256 * KIB, stage_cpu=True)
    present = [k for i, k in enumerate(keys) if i != 3]
    with blocks_as_buffers([b for i, b in enumerate(kv.blocks) if i != 3], pool) as bufs:
        store.batch_put_from([(k, *buf) for k, buf in zip(present, bufs)])
    got = fetch_run(store, engine, kv.block_hashes, keys, staging=pool)
    assert len(got) == 3
    assert all(torch.equal(b, w) for (_, b), w in zip(got, kv.blocks))
    assert fetch_block(store, keys[3], engine, staging=pool) is None
    assert torch.equal(fetch_block(store, keys[4], engine, staging=pool), kv.blocks[4])
    assert pool.in_use_bytes == 0


def test_a_fetch_that_finds_the_pool_full_stops_there_and_the_rest_is_recomputed(engine, store):
    kv = _parked_blocks(engine, 8, seed=3)  # 2 blocks
    keys = [block_key("tiny@float32", "full", h, engine.model_config.num_hidden_layers)
            for h in kv.block_hashes]
    pool = HostStaging(256 * KIB, stage_cpu=True, wait_s=0.1)
    with blocks_as_buffers(kv.blocks, pool) as bufs:
        store.batch_put_from([(k, *buf) for k, buf in zip(keys, bufs)])
    held = pool.acquire(256 * KIB)  # another caller holds the whole pool
    assert fetch_run(store, engine, kv.block_hashes, keys, staging=pool) == []
    pool.release(held)
    assert len(fetch_run(store, engine, kv.block_hashes, keys, staging=pool)) == 2
