"""Client of the distributed store: metadata from the master, bytes straight to and from nodes.

Owns one put and one get end to end: `put_from` asks the master where (PutStart), writes every
replica through the best transport for that node (shared memory on the same host, UCX across
hosts where the node serves it and `ucxx` is installed, TCP otherwise), then commits; `get_into` asks where (Get, which grants a read lease), reads the nearest
replica, verifies its checksum (`kvstore.checksum`), and on a mismatch reports the bad replica and tries the next one.
Follows the leader among several masters (a standby's refusal names the leader, tried next) and
rides out a master restart or failover: transient failures are retried within the operation's
budget (`kvstore.retry`), and once an operation found no master the next ones fail fast until one
answers. Sends its cluster id with every call (`kvstore.channel`). A node that came back as a new
incarnation has new segment files: the old ones' mappings are dropped when its new placements
appear. Must not import `pdserve.engine`.
"""

from __future__ import annotations

import functools
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from pdserve.kvstore.channel import (MAX_BATCH_ITEMS, ClusterMismatch,
                                     ask_the_named_leader_next, call_metadata,
                                     check_cluster_id, is_cluster_mismatch, make_store_channel)
from pdserve.kvstore.checksum import object_checksum
from pdserve.kvstore.errors import DistStoreError, NotStored, PutInProgress
from pdserve.kvstore.retry import TRANSIENT_CODES, StoreRetryPolicy
from pdserve.kvstore.transport.base import Extent, TransportError, byte_view
from pdserve.kvstore.transport.select import pick_transport
from pdserve.kvstore.transport.shm import ShmTransport
from pdserve.kvstore.transport.tcp import TcpTransport
from pdserve.proto import kvmaster_pb2 as pb
from pdserve.proto import kvmaster_pb2_grpc as pb_grpc


class ObjectNotFound(DistStoreError, NotStored, KeyError):
    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class AllReplicasBad(DistStoreError):
    """Every replica failed its checksum or could not be read: the caller recomputes."""


class StoreUnreachable(DistStoreError):
    """No master answered within the operation's budget (down, restarting, failing over)."""


class StoreFull(DistStoreError):
    """The master refused a put: no storage node registered, or none has room even after
    eviction (RESOURCE_EXHAUSTED). Later puts may succeed."""


class ClusterRefused(DistStoreError, ClusterMismatch):
    """The master serves another cluster; the message names both ids."""


def _extent(p: pb.Placement) -> Extent:
    return Extent(node_id=p.node_id, host_id=p.host_id, data_address=p.data_address,
                  segment_id=p.segment_id, shm_path=p.shm_path, offset=p.offset_bytes,
                  size=p.size_bytes, tier=p.tier or "dram", ucx_address=p.ucx_address)


class DistStoreClient:
    def __init__(self, master_addresses: Sequence[str] | str, host_id: str | None = None,
                 timeout_s: float = 30.0, default_replicas: int = 1,
                 ucx: bool | None = None, cluster_id: str = "",
                 retry: StoreRetryPolicy | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        """`ucx`: use UCX to nodes on other hosts that serve it (None: where `ucxx` is installed;
        False: never, TCP instead). `retry`: how one master call is retried (default: within
        `timeout_s` per operation; a worker passes its own short budget, so that it recomputes
        rather than waits). `cluster_id`: the cluster this
        client belongs to ("": any)."""
        if isinstance(master_addresses, str):
            master_addresses = master_addresses.split(",")
        self.masters = [a.strip() for a in master_addresses if a.strip()]
        if not self.masters:
            raise ValueError("master_addresses: need at least one host:port")
        self.host_id = host_id or socket.gethostname()
        self.timeout_s = timeout_s
        self.retry = retry or StoreRetryPolicy(budget_s=timeout_s, attempt_timeout_s=timeout_s)
        self.cluster_id = check_cluster_id(cluster_id)
        self._metadata = call_metadata(self.cluster_id)
        self._clock, self._sleep = clock, sleep
        # True once an operation found no master; the next ones fail fast until one answers.
        self.store_down = False
        self._leader = 0
        self._channels = [make_store_channel(a) for a in self.masters]
        self._stubs = [pb_grpc.KVMasterStub(c) for c in self._channels]
        self._segment_paths: dict[tuple[str, str], str] = {}  # (node, segment) -> shm path
        self._paths_lock = threading.Lock()
        self._shm = ShmTransport()
        self._tcp = TcpTransport()
        self._ucx = None
        self._use_ucx = ucx
        self.corrupt_reports = 0
        self.reads_by_transport: Counter[str] = Counter()  # replica reads, per transport kind
        self.default_replicas = default_replicas

    # ---- master calls, following the leader --------------------------------------------------
    def _call(self, method: str, request):
        """One master call: rounds over the masters (the last leader first, then whoever a
        standby names), retried as `self.retry` says. Typed errors for the answers callers act
        on; StoreUnreachable when no master answered."""
        started = self._clock()
        rounds = 0
        while True:
            rounds += 1
            order = [(self._leader + k) % len(self._stubs) for k in range(len(self._stubs))]
            last: grpc.RpcError | None = None
            while order:
                i = order.pop(0)
                timeout = self.retry.attempt_timeout(self._clock() - started, self.store_down)
                try:
                    out = getattr(self._stubs[i], method)(request, timeout=timeout,
                                                          metadata=self._metadata)
                except grpc.RpcError as e:
                    if e.code().name not in TRANSIENT_CODES:
                        self.store_down = False  # a master answered, if only to refuse
                        raise self._answer_error(method, e) from None
                    last = e
                    ask_the_named_leader_next(order, self.masters, e)
                    continue
                self._leader = i
                self.store_down = False
                return out
            assert last is not None
            elapsed = self._clock() - started
            d = self.retry.decide(rounds, last.code().name, elapsed, self.store_down)
            if not d.retry:
                self.store_down = True
                raise StoreUnreachable(f"{method}: no master answered ({last.code().name}: "
                                       f"{last.details()}; {d.reason})")
            self._sleep(d.delay_s)

    @staticmethod
    def _answer_error(method: str, e: grpc.RpcError) -> DistStoreError:
        if is_cluster_mismatch(e):
            return ClusterRefused(e.details())
        if e.code() == grpc.StatusCode.ABORTED:
            return PutInProgress(f"{method}: {e.details()}")
        if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return StoreFull(f"{method}: {e.details()}")
        return DistStoreError(f"{method}: {e.code().name}: {e.details()}")

    def check_cluster(self) -> pb.MasterStatsResponse:
        """Asks the leader (Stats); ClusterRefused when it serves another cluster,
        StoreUnreachable when none answers."""
        return self._call("Stats", pb.MasterStatsRequest())

    def _transport(self, ext: Extent):
        if ext.shm_path:
            self._note_segment(ext)
        kind = pick_transport(ext.host_id, self.host_id, tier=ext.tier, ucx=self._use_ucx,
                              node_serves_ucx=bool(ext.ucx_address))
        if kind == "ucx":
            return self._ucx_transport()
        return self._shm if kind == "shm" else self._tcp

    def _note_segment(self, ext: Extent) -> None:
        """A node back as a new incarnation names new segment files: unmap the old one here
        (the node unlinked it; only mappings like ours kept its memory alive)."""
        slot = (ext.node_id, ext.segment_id.rpartition(".")[2])
        with self._paths_lock:
            old = self._segment_paths.get(slot)
            if old == ext.shm_path:
                return
            self._segment_paths[slot] = ext.shm_path
        if old is not None:
            self._shm.forget(old)

    def _ucx_transport(self):
        # Made on first use: importing ucxx starts UCX, which a same-host client never needs.
        if self._ucx is None:
            from pdserve.kvstore.transport.ucx import UcxTransport

            self._ucx = UcxTransport()
        return self._ucx

    def locate(self, key: str) -> list[tuple[str, str]]:
        """(node id, tier) of each replica of `key` (grants a read lease, like a get)."""
        info = self._call("Get", pb.MasterGetRequest(keys=[key])).objects[0]
        if not info.found:
            raise ObjectNotFound(f"{key} is not stored")
        return [(p.node_id, p.tier or "dram") for p in info.replicas]

    def transport_kind(self, key: str) -> str:
        """Which transport a get of `key` would use first (for tests and diagnostics)."""
        info = self._call("Get", pb.MasterGetRequest(keys=[key])).objects[0]
        if not info.found:
            raise ObjectNotFound(f"{key} is not stored")
        return self._transport(_extent(self._nearest_first(info)[0])).kind

    def _nearest_first(self, info: pb.ObjectInfo) -> list:
        """Replicas in read order: this host's before others', DRAM before SSD."""
        return sorted(info.replicas, key=lambda p: (p.host_id != self.host_id, p.tier != "dram"))

    # ---- data ---------------------------------------------------------------------------------
    def put_from(self, key: str, buffer, replicas: int = 1) -> bool:
        """Store the bytes of `buffer` under `key`; False if the key was already stored or
        another writer is storing it right now (keys name content, so theirs are the same
        bytes; a reader that comes before their commit misses and recomputes)."""
        view = memoryview(buffer).cast("B")
        checksum = object_checksum(view)
        try:
            start = self._call("PutStart", pb.PutStartRequest(key=key, size_bytes=view.nbytes,
                                                              checksum=checksum,
                                                              replicas=replicas))
        except PutInProgress:
            return False
        if start.already_exists:
            return False
        self._write_replicas(key, start.placements, view)
        self._call("PutCommit", pb.PutCommitRequest(key=key))
        return True

    def _write_replicas(self, key: str, placements, view: memoryview) -> None:
        """Write every replica of a started put; on a failure abort the put (DistStoreError)."""
        try:
            for p in placements:
                ext = _extent(p)
                self._transport(ext).write(ext, view)
        except (TransportError, OSError) as e:
            try:
                self._call("PutAbort", pb.PutAbortRequest(key=key))
            except DistStoreError:
                pass  # the master reclaims an uncommitted put after its put timeout anyway
            raise DistStoreError(f"put {key}: writing a replica failed: {e}") from e

    def batch_put_from(self, items) -> int:
        """put_from for (key, buffer[, meta]) items (meta is ignored: the store keeps bytes),
        with two master calls for all of them (one journal write each) instead of two per
        item; returns how many were newly stored. Every item that fits is stored; then
        DistStoreError for a write that failed, StoreFull if the store had no room for one."""
        stored = 0
        for at in range(0, len(items), MAX_BATCH_ITEMS):
            stored += self._put_batch(items[at:at + MAX_BATCH_ITEMS])
        return stored

    def _put_batch(self, items) -> int:
        if not items:
            return 0
        views = [memoryview(item[1]).cast("B") for item in items]
        start = self._call("BatchPutStart", pb.BatchPutStartRequest(puts=[
            pb.PutStartRequest(key=item[0], size_bytes=v.nbytes, checksum=object_checksum(v),
                               replicas=self.default_replicas)
            for item, v in zip(items, views)]))
        written: list[str] = []
        failure: DistStoreError | None = None
        for item, view, r in zip(items, views, start.items):
            if r.outcome == pb.PutStartItem.NO_SPACE:
                failure = failure or StoreFull(f"BatchPutStart: {item[0]}: {r.error}")
            elif r.outcome == pb.PutStartItem.INVALID:
                failure = failure or DistStoreError(f"BatchPutStart: {item[0]}: {r.error}")
            elif r.outcome == pb.PutStartItem.STARTED:
                try:
                    self._write_replicas(item[0], r.placements, view)
                    written.append(item[0])
                except DistStoreError as e:
                    failure = e
        if written:
            done = self._call("BatchPutCommit", pb.BatchPutCommitRequest(keys=written))
            if done.failed_keys:
                raise DistStoreError(f"BatchPutCommit: {done.failed_keys[0]}: {done.errors[0]}")
        if failure is not None:
            raise failure
        return len(written)

    def _read_replicas(self, info: pb.ObjectInfo, view: memoryview) -> int:
        order = self._nearest_first(info)
        for p in order:
            ext = _extent(p)
            dst = view[: info.size_bytes]
            transport = self._transport(ext)
            try:
                transport.read_into(ext, dst)
            except (TransportError, OSError):
                continue  # a dead node: the master will drop it; try the next replica
            self.reads_by_transport[transport.kind] += 1
            if object_checksum(dst) == info.checksum:
                return info.size_bytes
            self.corrupt_reports += 1
            self._call("ReportCorrupt", pb.ReportCorruptRequest(key=info.key, node_id=p.node_id))
        raise AllReplicasBad(f"get {info.key}: no replica of {len(order)} read back intact")

    def get_into(self, key: str, buffer) -> int:
        """Read `key` into the caller's writable buffer; returns the bytes written."""
        return self._read_found(self._call("Get", pb.MasterGetRequest(keys=[key])).objects[0],
                                buffer)

    def readers(self, keys: Sequence[str]) -> list[Callable[[Any], int]]:
        """One reader per key, the objects located with one master call (per
        `MAX_BATCH_ITEMS`): `reader(buffer)` reads that object into the caller's writable
        buffer and returns the bytes written, as `get_into` does (ObjectNotFound where the key
        was not stored). The master leases what it located, so a reader used within the lease
        reads what was located."""
        infos = []
        for at in range(0, len(keys), MAX_BATCH_ITEMS):
            infos += self._call("Get", pb.MasterGetRequest(
                keys=list(keys[at:at + MAX_BATCH_ITEMS]))).objects
        return [functools.partial(self._read_found, info) for info in infos]

    def _read_found(self, info, buffer) -> int:
        view = memoryview(buffer).cast("B")
        if not info.found:
            raise ObjectNotFound(f"{info.key} is not stored")
        if info.size_bytes > view.nbytes:
            raise DistStoreError(f"get {info.key}: buffer of {view.nbytes} bytes is smaller "
                                 f"than the object ({info.size_bytes})")
        return self._read_replicas(info, view)

    def batch_get_into(self, keys: Sequence[str], buffers: Sequence) -> list[int | None]:
        """get_into for many keys with one master round trip; None where a key is not stored."""
        if len(keys) != len(buffers):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")
        infos = self._call("Get", pb.MasterGetRequest(keys=list(keys))).objects
        out: list[int | None] = []
        for info, buf in zip(infos, buffers):
            view = memoryview(buf).cast("B")
            if not info.found:
                out.append(None)
            elif info.size_bytes > view.nbytes:
                raise DistStoreError(f"get {info.key}: buffer of {view.nbytes} bytes is smaller "
                                     f"than the object ({info.size_bytes})")
            else:
                out.append(self._read_replicas(info, view))
        return out

    def get(self, key: str) -> bytes | None:
        info = self._call("Get", pb.MasterGetRequest(keys=[key])).objects[0]
        if not info.found:
            return None
        buf = bytearray(info.size_bytes)
        self._read_replicas(info, memoryview(buf))
        return bytes(buf)

    def exists(self, keys: Sequence[str]) -> list[bool]:
        return list(self._call("Exists", pb.MasterExistsRequest(keys=list(keys))).exists)

    def longest_prefix(self, keys: Sequence[str]) -> int:
        return self._call("LongestPrefix", pb.LongestPrefixRequest(keys=list(keys))).cached_blocks

    def remove(self, key: str) -> bool:
        return self._call("Remove", pb.MasterRemoveRequest(key=key)).removed

    def stats(self) -> pb.MasterStatsResponse:
        return self._call("Stats", pb.MasterStatsRequest())

    def close(self) -> None:
        self._shm.close()
        self._tcp.close()
        if self._ucx is not None:
            self._ucx.close()
        for c in self._channels:
            c.close()

    def __enter__(self) -> "DistStoreClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["DistStoreClient", "DistStoreError", "ObjectNotFound", "AllReplicasBad",
           "StoreUnreachable", "StoreFull", "ClusterRefused", "byte_view"]
