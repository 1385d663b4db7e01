"""The store as a real process on loopback: data between processes, batches, errors, shutdown."""

from __future__ import annotations

import sys
import time
import zlib

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from pdserve import rpc
from pdserve.core.identity import MASTER
from pdserve.kvstore import service
from pdserve.kvstore.__main__ import main as store_main
from pdserve.kvstore.client import (
    BlockKey,
    BufferTooSmall,
    KeyNotFound,
    KVStoreClient,
    Plane,
    StoreUnavailable,
    format_key,
)
from pdserve.kvstore.config import StoreConfig
from pdserve.kvstore.store import ObjectMeta, StoreFullError
from pdserve.proto import kvstore_pb2, kvstore_pb2_grpc
from tests.helpers import free_port, process_output, start_process, stop_process

MiB = 1 << 20
CAPACITY_BYTES = 16 * MiB


def store_args(address: str, capacity_bytes: int = CAPACITY_BYTES) -> list[str]:
    return [sys.executable, "-m", "pdserve.kvstore", "--address", address,
            "--capacity-bytes", str(capacity_bytes)]


@pytest.fixture(scope="module")
def store_address():
    address = f"127.0.0.1:{free_port()}"
    p = start_process(store_args(address), address, timeout_s=30)
    yield address
    stop_process(p)


@pytest.fixture
def client(store_address):
    with KVStoreClient(store_address, timeout_s=10) as c:
        yield c


def block_key(i: int, plane: Plane = Plane.FULL) -> str:
    return format_key(BlockKey("test/model", "tenant-a", i.to_bytes(8, "big"), 0, 4, plane))


def test_put_from_and_get_into_numpy_buffers_between_processes(client) -> None:
    rng = np.random.default_rng(0)
    src = rng.standard_normal((4, 256, 1024), dtype=np.float32)  # 4 MiB
    key = block_key(1)
    client.put_from(key, src)
    dst = np.empty_like(src)
    assert client.get_into(key, dst) == src.nbytes
    np.testing.assert_array_equal(dst, src)
    # Any writable buffer works: a bytearray, or a memoryview on part of a bigger array.
    big = np.zeros(src.nbytes + 100, dtype=np.uint8)
    assert client.get_into(key, memoryview(big)[50:]) == src.nbytes
    assert big[50:50 + src.nbytes].tobytes() == src.tobytes() and not big[:50].any()
    assert client.get(key) == src.tobytes()


def test_get_into_errors_are_typed(client) -> None:
    key = block_key(2)
    client.put_from(key, b"x" * 100)
    with pytest.raises(BufferTooSmall, match="100 bytes, buffer holds 99"):
        client.get_into(key, bytearray(99))
    with pytest.raises(KeyNotFound) as info:
        client.get_into(block_key(999), bytearray(10))
    assert info.value.keys == (block_key(999),)
    with pytest.raises(TypeError, match="read-only"):
        client.get_into(key, b"immutable")
    assert client.get(block_key(999)) is None


def test_exists_remove_and_stats(client) -> None:
    a, b = block_key(3, Plane.ANCHOR), block_key(3, Plane.RESIDUAL)
    before = client.stats()
    client.put_from(a, np.ones(1000, dtype=np.float16), ObjectMeta("float16", (10, 100)))
    client.put_from(b, bytearray(500))
    assert client.exists([a, block_key(998), b]) == [True, False, True]
    client.get(a)
    client.get(block_key(998))
    assert client.remove(a) and not client.remove(a)
    assert client.exists([a, b]) == [False, True]
    after = client.stats()
    assert after.capacity_bytes == CAPACITY_BYTES
    assert after.puts - before.puts == 2
    assert (after.gets - before.gets, after.hits - before.hits) == (2, 1)
    assert after.misses - before.misses == 1
    assert after.used_bytes - before.used_bytes == 500
    assert after.object_count - before.object_count == 1


def test_batch_put_and_get(client) -> None:
    arrays = [np.full((256, 1024), i, dtype=np.int32) for i in range(6)]  # 1 MiB each
    keys = [block_key(100 + i) for i in range(6)]
    client.batch_put_from(zip(keys, arrays))
    outs = [np.empty_like(a) for a in arrays]
    assert client.batch_get_into(keys, outs) == [a.nbytes for a in arrays]
    for a, out in zip(arrays, outs):
        np.testing.assert_array_equal(a, out)
    missing = block_key(997)
    with pytest.raises(KeyNotFound) as info:
        client.batch_get_into([keys[0], missing], [bytearray(MiB), bytearray(1)])
    assert info.value.keys == (missing,)
    got = client.batch_get_into([missing, keys[1]], [bytearray(1), bytearray(MiB)],
                                missing_ok=True)
    assert got == [None, MiB]


def test_full_store_evicts_and_oversized_put_is_refused(client) -> None:
    before = client.stats()
    chunk = bytes(4 * MiB)
    keys = [block_key(200 + i) for i in range(5)]  # 20 MiB into 16 MiB
    for key in keys:
        client.put_from(key, chunk)
    stats = client.stats()
    assert stats.used_bytes <= CAPACITY_BYTES and stats.evictions > before.evictions
    assert client.exists(keys) == [False, True, True, True, True]
    with pytest.raises(StoreFullError, match="exceeds the store capacity"):
        client.put_from(block_key(299), bytes(CAPACITY_BYTES + 1))


def test_bad_requests_get_clear_status_and_the_store_keeps_serving(store_address) -> None:
    with rpc.make_channel(store_address, MASTER) as channel:
        stub = kvstore_pb2_grpc.KVStoreStub(channel)
        data = b"abc"
        bad = kvstore_pb2.PutRequest(key="k", data=data,
                                     meta=kvstore_pb2.ObjectMeta(checksum=zlib.crc32(data) ^ 1))
        with pytest.raises(grpc.RpcError) as info:
            stub.Put(bad, timeout=5)
        assert info.value.code() == grpc.StatusCode.DATA_LOSS
        with pytest.raises(grpc.RpcError) as info:
            stub.Put(kvstore_pb2.PutRequest(key=""), timeout=5)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "key" in info.value.details()
        assert stub.Stats(kvstore_pb2.StoreStatsRequest(), timeout=5).capacity_bytes > 0


def test_health_and_reflection_list_the_store(store_address) -> None:
    with rpc.make_channel(store_address, MASTER) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        status = health.Check(health_pb2.HealthCheckRequest(service="pdserve.v1.KVStore"))
        assert status.status == health_pb2.HealthCheckResponse.SERVING
        services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
    assert {"pdserve.v1.KVStore", "grpc.health.v1.Health"} <= services


def test_unreachable_store_raises_store_unavailable() -> None:
    address = f"127.0.0.1:{free_port()}"
    with KVStoreClient(address, timeout_s=2) as c, pytest.raises(StoreUnavailable):
        c.exists(["k"])
    with pytest.raises(TimeoutError, match=address):
        rpc.wait_healthy(address, timeout_s=0.2)


def test_second_store_on_a_taken_port_fails_to_start(store_address) -> None:
    with pytest.raises(service.ServeError, match="cannot listen"):
        service.start(StoreConfig(address=store_address))


def test_bad_command_line_exits_2(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        store_main(["--capacity-bytes", "0"])
    assert info.value.code == 2
    assert "capacity_bytes" in capsys.readouterr().err


def test_sigterm_stops_the_store_cleanly() -> None:
    address = f"127.0.0.1:{free_port()}"
    p = start_process(store_args(address, capacity_bytes=MiB), address, timeout_s=30)
    with KVStoreClient(address) as c:
        c.put_from("k", b"v")
    started = time.monotonic()
    assert stop_process(p, timeout_s=5) == 0
    assert time.monotonic() - started < 5
    out, err = process_output(p)
    assert f"ready on {address}" in out, err


def test_longest_prefix_counts_leading_stored_keys(client) -> None:
    keys = [f"lp/{i}" for i in range(4)]
    for k in (keys[0], keys[1], keys[3]):
        client.put_from(k, b"x" * 16)
    assert client.longest_prefix(keys) == 2
    assert client.longest_prefix([]) == 0
