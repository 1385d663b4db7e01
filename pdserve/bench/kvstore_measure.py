"""Timing loops of `pdserve bench kvstore`: raw seconds per operation, nothing derived.

Owns how each system is driven: a memoryview memcpy and the object checksum (the baselines a store's copy
and checksum are measured against), `DistStoreClient` put_from/get_into rounds (master round trips
and crc32 included), the raw transports against a reserved extent, redis-py SET/GET, and the
batch gets (1,000 small objects). Every loop returns lists of seconds; ratios are made from them
in `kvstore.summarize`. Each path is checked byte-exact once, so a fast wrong answer cannot pass.
Must not start processes or print.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

import numpy as np

from pdserve.kvstore.checksum import object_checksum
from pdserve.kvstore.transport.base import Extent
from pdserve.kvstore.transport.measure import measure_bandwidth

NOSPACE_RETRY_S = 10.0


class MeasureError(RuntimeError):
    """A system returned wrong bytes, or could not store an object at all."""


def payload(size: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def times_s(fn: Callable[[], object], repeats: int, warmup: bool = False) -> list[float]:
    if warmup:
        fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def memcpy_s(src: np.ndarray, dst: np.ndarray, repeats: int) -> list[float]:
    """Seconds of `dst[:] = src` through memoryviews (what ShmTransport does); the first copy,
    which takes the page faults, is not timed."""
    s, d = memoryview(src), memoryview(dst)

    def copy() -> None:
        d[:] = s
    return times_s(copy, repeats, warmup=True)


def crc32_s(src: np.ndarray, repeats: int) -> list[float]:
    """Seconds of the object checksum over `src`: DistStoreClient computes one per put and get."""
    return times_s(lambda: object_checksum(src), repeats, warmup=True)


def _unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def _put_retrying(client, key: str, view) -> None:
    """put_from, retried while the node is full: a removed object's bytes come back only when its
    read lease ends (the bench's master uses a short lease)."""
    from pdserve.kvstore.dist_client import StoreFull

    deadline = time.monotonic() + NOSPACE_RETRY_S
    while True:
        try:
            if not client.put_from(key, view):
                raise MeasureError(f"put {key}: the key was already stored")
            return
        except StoreFull:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def client_round(client, src: np.ndarray, dst: np.ndarray, label: str,
                 check: bool) -> tuple[float, float]:
    """One round of put_from (fresh key), get_into, remove through one DistStoreClient: the
    seconds of the put and of the get, each end to end (master calls, transport, checksum).
    The remove keeps the node's segment from filling; it is not timed. `check`: compare every
    byte read (else only the count)."""
    key = _unique(f"bw-{label}-{src.size}")
    t0 = time.perf_counter()
    _put_retrying(client, key, src)
    put = time.perf_counter() - t0
    dst[:16] = 0
    t0 = time.perf_counter()
    n = client.get_into(key, dst)
    get = time.perf_counter() - t0
    if n != src.size or (check and not np.array_equal(src, dst)):
        raise MeasureError(f"{label}: get_into of {src.size} bytes returned other bytes")
    client.remove(key)
    return put, get


def client_rounds(client, src: np.ndarray, dst: np.ndarray, repeats: int,
                  label: str) -> dict[str, list[float]]:
    """`repeats` rounds of `client_round`, the first checked byte for byte."""
    put, get = [], []
    for r in range(repeats):
        p, g = client_round(client, src, dst, label, check=r == 0)
        put.append(p)
        get.append(g)
    return {"put_s": put, "get_s": get}


def raw_round(transport, extent: Extent, src: np.ndarray, dst: np.ndarray,
              check: bool) -> tuple[float, float]:
    """One write and one read_into of `src.size` bytes at the start of `extent` (no master, no
    checksum): their seconds. `check`: compare every byte read back."""
    target = extent.sub(0, src.size)
    s, d = memoryview(src), memoryview(dst)
    dst[:16] = 0
    t0 = time.perf_counter()
    transport.write(target, s)
    put = time.perf_counter() - t0
    t0 = time.perf_counter()
    transport.read_into(target, d)
    get = time.perf_counter() - t0
    if check and not np.array_equal(src, dst):
        raise MeasureError(f"{transport.kind}: read back of {src.size} bytes differs")
    return put, get


def reserve_extent(master_address: str, size: int, security=None
                   ) -> tuple[Extent, Callable[[], None]]:
    """An extent of `size` bytes on the node, reserved through the master (a put that is started
    and never committed), so raw transport writes land on space nobody else uses. Returns the
    extent and the call that gives it back (PutAbort). `security`: how to call the master
    (default: this process's internal TLS)."""
    from pdserve import rpc
    from pdserve.proto import kvmaster_pb2 as pb
    from pdserve.proto import kvmaster_pb2_grpc as pb_grpc

    key = _unique("bench-raw-extent")
    channel = rpc.make_channel(master_address, "master", security_=security)
    stub = pb_grpc.KVMasterStub(channel)
    start = stub.PutStart(pb.PutStartRequest(key=key, size_bytes=size, checksum=0, replicas=1),
                          timeout=30)
    if not start.placements:
        channel.close()
        raise MeasureError(f"master gave no placement for a {size}-byte reservation")
    p = start.placements[0]
    extent = Extent(node_id=p.node_id, host_id=p.host_id, data_address=p.data_address,
                    segment_id=p.segment_id, shm_path=p.shm_path, offset=p.offset_bytes,
                    size=p.size_bytes, tier=p.tier or "dram")

    def release() -> None:
        stub.PutAbort(pb.PutAbortRequest(key=key), timeout=30)
        channel.close()
    return extent, release


def raw_transport(transport, extent: Extent, size: int, repeats: int) -> dict:
    """One row of `transport.measure.measure_bandwidth` (write, read_into, its own memcpy)."""
    return measure_bandwidth(transport, extent, sizes=(size,), repeats=repeats)["results"][0]


def redis_rounds(r, src: np.ndarray, repeats: int) -> dict[str, list[float]]:
    """redis-py SET (from a memoryview, no copy on our side) and GET (returns a new bytes object,
    the copy out of the socket included) of one key, overwritten each round."""
    key = _unique(f"bw-redis-{src.size}")
    view = memoryview(src)
    put = times_s(lambda: r.set(key, view), repeats)
    got: list[bytes] = []

    def get() -> None:
        got[:] = [r.get(key)]
    get_times = times_s(get, repeats)
    if got[0] is None or not np.array_equal(np.frombuffer(got[0], dtype=np.uint8), src):
        raise MeasureError(f"redis GET of {src.size} bytes returned other bytes")
    got.clear()
    r.delete(key)
    return {"put_s": put, "get_s": get_times}


# ---- batch gets -------------------------------------------------------------------------------
def batch_store(client, data: np.ndarray, count: int, size: int) -> list[str]:
    """Puts `count` objects of `size` bytes (slices of `data`); returns their keys."""
    prefix = _unique("batch")
    keys = [f"{prefix}-{i}" for i in range(count)]
    view = memoryview(data)
    for i, key in enumerate(keys):
        _put_retrying(client, key, view[i * size:(i + 1) * size])
    return keys


def batch_get_client(client, keys: list[str], data: np.ndarray, size: int,
                     repeats: int) -> list[float]:
    """DistStoreClient.batch_get_into (one master round trip for all keys, then one transport
    read per object) into consecutive slices of one buffer."""
    out = np.zeros_like(data)
    view = memoryview(out)
    slices = [view[i * size:(i + 1) * size] for i in range(len(keys))]

    def run() -> None:
        client.batch_get_into(keys, slices)
    times = times_s(run, repeats)
    if not np.array_equal(out, data):
        raise MeasureError("batch get through DistStoreClient returned other bytes")
    return times


def batch_redis(r, data: np.ndarray, count: int, size: int, repeats: int) -> dict[str, list[float]]:
    """MGET of all keys in one command, and a non-transactional pipeline of `count` GETs."""
    prefix = _unique("batch-redis")
    keys = [f"{prefix}-{i}" for i in range(count)]
    view = memoryview(data)
    with r.pipeline(transaction=False) as p:
        for i, key in enumerate(keys):
            p.set(key, view[i * size:(i + 1) * size])
        p.execute()
    expected = data.tobytes()
    got: list[list] = [[]]

    def mget() -> None:
        got[0] = r.mget(keys)

    def pipelined() -> None:
        with r.pipeline(transaction=False) as p:
            for key in keys:
                p.get(key)
            got[0] = p.execute()
    out = {}
    for name, fn in (("mget_s", mget), ("pipeline_s", pipelined)):
        out[name] = times_s(fn, repeats)
        if b"".join(got[0]) != expected:
            raise MeasureError(f"redis batch get ({name[:-2]}) returned other bytes")
    r.delete(*keys)
    return out
