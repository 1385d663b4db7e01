"""The store's gRPC adapter: serves `pdserve.v1.KVStore` over a `MemoryStore`.

Owns sockets, threads, signal handling and the mapping of core errors to gRPC status codes.
Must not hold storage logic (that is `store.MemoryStore`) or interpret keys.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Iterator

import grpc
from grpc_health.v1 import health

from pdserve import rpc
from pdserve.core.identity import MASTER
from pdserve.kvstore.config import StoreConfig, parse_address
from pdserve.kvstore.store import ChecksumMismatch, MemoryStore, ObjectMeta, StoreFullError
from pdserve.proto import kvstore_pb2 as pb
from pdserve.proto import kvstore_pb2_grpc as pb_grpc

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KVStore"].full_name  # "pdserve.v1.KVStore"


class ServeError(RuntimeError):
    """The store could not start serving (e.g. the address is taken)."""


def _meta_to_proto(meta: ObjectMeta) -> pb.ObjectMeta:
    return pb.ObjectMeta(dtype=meta.dtype, shape=meta.shape, checksum=meta.checksum)


class KVStoreServicer(pb_grpc.KVStoreServicer):
    """Translates KVStore RPCs into calls on one MemoryStore, one call at a time."""

    def __init__(self, store: MemoryStore) -> None:
        self._store = store
        # The core is single-threaded by design; gRPC handlers run on a thread pool.
        self._lock = threading.Lock()

    def Put(self, request: pb.PutRequest, context: grpc.ServicerContext) -> pb.PutResponse:
        if not request.key:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "key: must not be empty")
        meta = ObjectMeta(
            dtype=request.meta.dtype,
            shape=tuple(request.meta.shape),
            checksum=request.meta.checksum,
        )
        try:
            with self._lock:
                evicted = self._store.put(request.key, request.data, meta)
        except ChecksumMismatch as e:
            # DATA_LOSS, not INVALID_ARGUMENT: clients compute the checksum themselves, so a
            # mismatch means bytes were corrupted in flight, and a retry may succeed.
            context.abort(grpc.StatusCode.DATA_LOSS, str(e))
        except StoreFullError as e:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{e}; retrying will not help")
        return pb.PutResponse(evicted_objects=evicted)

    def Get(self, request: pb.GetRequest, context: grpc.ServicerContext) -> pb.GetResponse:
        return self._get(request.key)

    def BatchGet(
        self, request: pb.BatchGetRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.GetResponse]:
        # One message per key keeps each message under the size limit however many keys come.
        for key in request.keys:
            yield self._get(key)

    def Exists(self, request: pb.ExistsRequest, context: grpc.ServicerContext) -> pb.ExistsResponse:
        with self._lock:
            flags = self._store.exists(list(request.keys))
        return pb.ExistsResponse(exists=flags)

    def Remove(self, request: pb.RemoveRequest, context: grpc.ServicerContext) -> pb.RemoveResponse:
        with self._lock:
            found = self._store.remove(request.key)
        return pb.RemoveResponse(found=found)

    def Stats(self, request: pb.StoreStatsRequest, context: grpc.ServicerContext) -> pb.StoreStats:
        with self._lock:
            s = self._store.stats()
        return pb.StoreStats(
            object_count=s.object_count,
            used_bytes=s.used_bytes,
            capacity_bytes=s.capacity_bytes,
            puts=s.puts,
            gets=s.gets,
            hits=s.hits,
            misses=s.misses,
            evictions=s.evictions,
        )

    def _get(self, key: str) -> pb.GetResponse:
        with self._lock:
            obj = self._store.get(key)
        if obj is None:
            return pb.GetResponse(key=key, found=False)
        return pb.GetResponse(key=key, found=True, data=obj.data, meta=_meta_to_proto(obj.meta))


@dataclass
class RunningStore:
    """A started store server; `address` is the bound one (port 0 resolved)."""

    server: grpc.Server
    health: health.HealthServicer
    address: str

    def stop(self, grace_s: float) -> None:
        # Report NOT_SERVING first so health-checking clients stop sending new work.
        self.health.enter_graceful_shutdown()
        self.server.stop(grace_s).wait()


def start(config: StoreConfig) -> RunningStore:
    """Builds, binds and starts the store server; raises ServeError if it cannot bind."""
    host, _ = parse_address(config.address)
    server = rpc.make_server(config.max_workers)
    servicer = KVStoreServicer(MemoryStore(config.capacity_bytes))
    # The single-process store is the store's master and data at once: it serves as "master".
    rpc.add_servicer(server, pb_grpc.add_KVStoreServicer_to_server, servicer, rpc.Guard(MASTER))
    health_servicer = rpc.add_health_and_reflection(server, [SERVICE_NAME])
    try:
        port = rpc.bind(server, config.address, MASTER)
    except RuntimeError as e:  # grpc raises RuntimeError when the bind fails
        raise ServeError(f"cannot listen on {config.address}: {e}") from e
    if port == 0:
        raise ServeError(f"cannot listen on {config.address}")
    server.start()
    return RunningStore(server, health_servicer, f"{host}:{port}")


def serve(config: StoreConfig, on_ready: Callable[[str], None] | None = None) -> None:
    """Runs the store until SIGTERM or SIGINT, then shuts down cleanly and returns.

    Must be called from the main thread (it installs signal handlers). `on_ready` gets the bound
    address once the server accepts connections.
    """
    rpc.catch_stop_signals()  # before the server is reachable, so no signal is missed
    running = start(config)
    try:
        if on_ready is not None:
            on_ready(running.address)
        rpc.wait_for_signal()
    finally:
        running.stop(config.shutdown_grace_s)
