"""The master's gRPC adapter: the pure `MasterCore` behind a lock, made durable and highly available.

Owns the I/O around the core: reading the clock (wall time, so leases, pins and snapshots mean
the same to every master), writing each call's journal records before answering (a commit the
client saw is on disk or in Redis), periodic maintenance (reclaim stale puts, expire silent nodes,
evict past the watermark, carry out DRAM->SSD demotions through a transport), and leadership: a
standby answers UNAVAILABLE until it wins the Redis lease, then rebuilds the state from the
journal and serves. The cluster id: the master claims the one it was started with (or keeps
its journal's) and refuses callers of another cluster (`kvstore.channel`). Must not decide
anything the core decides.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from typing import Callable

import grpc

from pdserve.kvstore.channel import (CLUSTER_ID_METADATA, LEADER_METADATA, MAX_BATCH_ITEMS,
                                     MISMATCH_METADATA, cluster_mismatch)
from pdserve.kvstore.master.config import MasterConfig
from pdserve.kvstore.master.core import MasterCore
from pdserve.kvstore.master.journal import JournalFenced
from pdserve.kvstore.master.model import (AlreadyExists, InvalidArgument, MasterError, NoSpace,
                                          NotFound, Placement, PutInProgress, UnknownNode)
from pdserve.kvstore.transport.base import Extent, TransportError
from pdserve.metrics import HOP_BUCKETS_S, BucketCounts
from pdserve.proto import kvmaster_pb2 as pb
from pdserve.proto import kvmaster_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


def placement_pb(p: Placement) -> pb.Placement:
    return pb.Placement(node_id=p.node_id, host_id=p.host_id, data_address=p.data_address,
                        segment_id=p.segment_id, shm_path=p.shm_path, offset_bytes=p.offset,
                        size_bytes=p.size, tier=p.tier, ucx_address=p.ucx_address)


def _status_of(e: MasterError) -> tuple[grpc.StatusCode, str]:
    if isinstance(e, InvalidArgument):
        return grpc.StatusCode.INVALID_ARGUMENT, str(e)
    if isinstance(e, NoSpace):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, f"{e}; retry after 1s"
    if isinstance(e, PutInProgress):
        return grpc.StatusCode.ABORTED, str(e)
    return grpc.StatusCode.FAILED_PRECONDITION, f"{type(e).__name__}: {e}"


def _extent(p: Placement) -> Extent:
    return Extent(**p.to_dict())


class MethodTimes:
    """Calls per method and a histogram of their handler seconds (waiting for the lock, the
    core, the journal write), for the Stats answer: what a master serving every worker of a
    large cluster spends on each kind of call."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by: dict[str, BucketCounts] = {}  # bounded: the service's methods

    def observe(self, method: str, seconds: float) -> None:
        with self._lock:
            b = self._by.get(method)
            if b is None:
                b = self._by[method] = BucketCounts(HOP_BUCKETS_S)
            b.observe(seconds)

    def snapshot(self) -> list[pb.MethodCalls]:
        with self._lock:
            snaps = {m: b.snapshot() for m, b in self._by.items()}
        return [pb.MethodCalls(method=m, calls=s["cumulative"][-1], bounds_s=s["bounds"],
                               cumulative=s["cumulative"], seconds=s["sum"])
                for m, s in sorted(snaps.items())]


def _check_batch(context, n: int, field: str) -> None:
    if n > MAX_BATCH_ITEMS:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                      f"{field}: at most {MAX_BATCH_ITEMS} in one call, got {n}")


def _timed(handler):
    """Counts a unary handler's calls and times them into the service's MethodTimes."""
    @functools.wraps(handler)
    def timed(self, request, context):
        t0 = time.perf_counter()
        try:
            return handler(self, request, context)
        finally:
            self.method_times.observe(handler.__name__, time.perf_counter() - t0)
    return timed


class MasterService(pb_grpc.KVMasterServicer):
    def __init__(self, config: MasterConfig, journal, *, election=None, address: str = "",
                 clock: Callable[[], float] = time.time, transport=None,
                 heartbeat_interval_s: float = 1.0, cluster_id: str = "") -> None:
        self.config = config
        self.journal = journal
        self.election = election
        self.address = address
        self.clock = clock
        self.transport = transport  # carries DRAM->SSD demotions (TcpTransport)
        self.heartbeat_interval_s = heartbeat_interval_s
        self.cluster_id = cluster_id  # as started; the journal's, once loaded, if it had one
        self._lock = threading.RLock()
        self.method_times = MethodTimes()
        self.core: MasterCore | None = None
        if election is None:
            self._load()

    # ---- durability and leadership ------------------------------------------------------------
    def _load(self) -> None:
        """Rebuild the core from the journal and claim the cluster id (ClusterIdConflict when
        the journal belongs to another cluster: this master then serves nothing)."""
        snapshot, records = self.journal.load()
        core = MasterCore.restore(self.config, snapshot, records, self.clock())
        self.cluster_id = core.claim_cluster_id(self.cluster_id, self.clock())
        self.core = core
        self._flush()  # a newly claimed id is durable before anyone is served
        log.info("master state loaded: %d journal records after the snapshot; cluster id %r",
                 len(records), self.cluster_id)

    def _flush(self) -> None:
        """Make this call's records durable before the caller hears back. A fenced journal
        (we lost the lease) makes us step down: the change is not acknowledged."""
        records = self.core.take_journal()
        if records:
            try:
                self.journal.append(records)
            except JournalFenced:
                log.warning("journal refused our writes: lost the leader lease; stepping down")
                self.core = None
                raise
        if self.core.snapshot_due():
            snap = self.core.snapshot()
            self.journal.write_snapshot(snap, snap["journal_seq"])

    def is_leader(self) -> bool:
        return self.election is None or self.core is not None

    def campaign(self) -> bool:
        """One election round (standby: try to win; leader: renew). Returns leadership."""
        if self.election is None:
            return True
        with self._lock:
            if self.core is not None:
                if self.election.renew():
                    return True
                log.warning("lost the leader lease; stepping down")
                self.core = None
                return False
            if self.election.try_acquire():
                self._load()
                log.info("became leader")
                return True
            return False

    def refuse_unless_leading(self, context) -> MasterCore:
        """The core, when this master leads and the caller is of its cluster; else the call is
        refused (UNAVAILABLE naming the leader, or FAILED_PRECONDITION naming both clusters).
        The caller holds the lock, or reads only what the core's replacement cannot break."""
        core = self.core
        if core is None:
            leader = self.election.current_leader() if self.election else ""
            context.set_trailing_metadata(((LEADER_METADATA, leader or ""),))
            context.abort(grpc.StatusCode.UNAVAILABLE, f"not the leader; leader is {leader}")
        self._refuse_other_cluster(context, core)
        return core

    def _serve(self, context, fn):
        """Run fn(now_s) on the core under the lock, flush the journal, map errors to statuses."""
        with self._lock:
            self.refuse_unless_leading(context)
            try:
                out = fn(self.clock())
                error = None
            except (InvalidArgument, NoSpace, PutInProgress, MasterError) as e:
                error = e
            try:
                self._flush()  # a failed call may still have changed state (e.g. evicted)
            except JournalFenced:
                context.abort(grpc.StatusCode.UNAVAILABLE, "lost the leader lease; retry")
            if error is not None:
                context.abort(*_status_of(error))
            return out

    def _refuse_other_cluster(self, context, core: MasterCore) -> None:
        caller = next((v for k, v in context.invocation_metadata() or ()
                       if k == CLUSTER_ID_METADATA), "")
        why = cluster_mismatch(caller, core.cluster_id)
        if why is not None:
            context.set_trailing_metadata(((MISMATCH_METADATA, core.cluster_id),))
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, why)

    # ---- maintenance --------------------------------------------------------------------------
    def tick(self) -> None:
        """Reclaim stale puts, expire silent nodes, evict, then move demoted objects."""
        with self._lock:
            if self.core is None:
                return
            now = self.clock()
            self.core.reclaim_pending(now)
            self.core.expire_nodes(now)
            self.core.evict(now)
            demotions = self.core.take_demotions()
            self._flush()
        for d in demotions:
            ok = self._copy(d.source, d.target)
            with self._lock:
                if self.core is None:
                    return
                if ok:
                    self.core.demote_done(d.key, d.target.node_id, self.clock())
                else:
                    self.core.demote_abort(d.key, d.target.node_id)
                self._flush()

    def _copy(self, src: Placement, dst: Placement) -> bool:
        if self.transport is None:
            return False
        try:
            buf = bytearray(src.size)
            self.transport.read_into(_extent(src), memoryview(buf))
            self.transport.write(_extent(dst), memoryview(buf))
            return True
        except (TransportError, OSError) as e:
            log.warning("demotion of %s failed: %s", src, e)
            return False

    # ---- RPCs ---------------------------------------------------------------------------------
    @_timed
    def RegisterNode(self, request, context):
        segs = [(s.segment_id, s.size_bytes, s.tier, s.shm_path) for s in request.segments]
        self._serve(context, lambda now: self.core.register_node(
            request.node_id, request.host_id, request.data_address, segs, now,
            request.ucx_address))
        return pb.RegisterNodeResponse(heartbeat_interval_s=self.heartbeat_interval_s)

    @_timed
    def Heartbeat(self, request, context):
        def beat(now):
            try:
                self.core.heartbeat(request.node_id, now)
                return True
            except UnknownNode:
                return False
        return pb.HeartbeatResponse(known=self._serve(context, beat))

    @_timed
    def PutStart(self, request, context):
        def start(now):
            try:
                return self.core.put_start(request.key, request.size_bytes, request.checksum,
                                           max(1, request.replicas), now)
            except AlreadyExists:
                return None
        placements = self._serve(context, start)
        if placements is None:
            return pb.PutStartResponse(already_exists=True)
        return pb.PutStartResponse(placements=[placement_pb(p) for p in placements])

    @_timed
    def BatchPutStart(self, request, context):
        """PutStart for many keys under one lock and one journal write: a prefill's blocks
        cost the master one call and one fsync, not two per block."""
        _check_batch(context, len(request.puts), "puts")

        def start(now):
            items = []
            for r in request.puts:
                try:
                    placements = self.core.put_start(r.key, r.size_bytes, r.checksum,
                                                     max(1, r.replicas), now)
                except AlreadyExists:
                    items.append(pb.PutStartItem(outcome=pb.PutStartItem.ALREADY_EXISTS))
                except PutInProgress:
                    items.append(pb.PutStartItem(outcome=pb.PutStartItem.IN_PROGRESS))
                except NoSpace as e:
                    items.append(pb.PutStartItem(outcome=pb.PutStartItem.NO_SPACE, error=str(e)))
                except InvalidArgument as e:
                    items.append(pb.PutStartItem(outcome=pb.PutStartItem.INVALID, error=str(e)))
                else:
                    items.append(pb.PutStartItem(placements=[placement_pb(p) for p in placements]))
            return items
        return pb.BatchPutStartResponse(items=self._serve(context, start))

    @_timed
    def BatchPutCommit(self, request, context):
        _check_batch(context, len(request.keys), "keys")

        def commit(now):
            failed, errors = [], []
            for key in request.keys:
                try:
                    self.core.put_commit(key, now)
                except MasterError as e:
                    failed.append(key)
                    errors.append(str(e))
            return failed, errors
        failed, errors = self._serve(context, commit)
        return pb.BatchPutCommitResponse(failed_keys=failed, errors=errors)

    @_timed
    def PutCommit(self, request, context):
        self._serve(context, lambda now: self.core.put_commit(request.key, now))
        return pb.PutCommitResponse()

    @_timed
    def PutAbort(self, request, context):
        self._serve(context, lambda now: self.core.put_abort(request.key))
        return pb.PutAbortResponse()

    @_timed
    def Get(self, request, context):
        def get(now):
            out = []
            for key in request.keys:
                try:
                    info = self.core.get(key, now)
                except NotFound:
                    out.append(pb.ObjectInfo(key=key, found=False))
                    continue
                out.append(pb.ObjectInfo(key=key, found=True, size_bytes=info.size,
                                         checksum=info.checksum,
                                         replicas=[placement_pb(p) for p in info.replicas],
                                         lease_s=max(0.0, info.lease_until_s - now)))
            return out
        return pb.MasterGetResponse(objects=self._serve(context, get))

    @_timed
    def Exists(self, request, context):
        return pb.MasterExistsResponse(
            exists=self._serve(context, lambda now: self.core.exists(list(request.keys))))

    @_timed
    def Remove(self, request, context):
        def remove(now):
            try:
                self.core.remove(request.key, now)
                return True
            except NotFound:
                return False
        return pb.MasterRemoveResponse(removed=self._serve(context, remove))

    @_timed
    def Pin(self, request, context):
        def pin(now):
            try:
                self.core.pin(request.key, request.ttl_s, now)
                return True
            except NotFound:
                return False
        return pb.PinResponse(pinned=self._serve(context, pin))

    @_timed
    def LongestPrefix(self, request, context):
        n, locs = self._serve(context, lambda now: self.core.longest_prefix(list(request.keys), now))
        return pb.LongestPrefixResponse(cached_blocks=n, locations=[
            pb.ReplicaList(replicas=[placement_pb(p) for p in reps]) for reps in locs])

    @_timed
    def ReportCorrupt(self, request, context):
        def report(now):
            try:
                self.core.report_corrupt(request.key, request.node_id, now)
                return len(self.core.get(request.key, now).replicas)
            except NotFound:
                return 0
        return pb.ReportCorruptResponse(replicas_left=self._serve(context, report))

    def WatchEvents(self, request, context):
        seq = request.after_seq
        while context.is_active():
            events = self._serve(context, lambda now: self.core.events_since(seq))
            for e in events:
                seq = e.seq
                yield pb.StoreEvent(seq=e.seq, kind=e.kind, key=e.key, node_ids=list(e.node_ids),
                                    reason=e.reason)
            if not events:
                time.sleep(0.05)

    def GetLeader(self, request, context):
        leader = self.address if self.election is None else (self.election.current_leader() or "")
        return pb.GetLeaderResponse(leader_address=leader, is_leader=self.is_leader(),
                                    cluster_id=self.cluster_id)

    def Stats(self, request, context):
        def stats(now):
            tiers = self.core.stats()
            return pb.MasterStatsResponse(
                tiers=[pb.TierStats(tier=t.tier, capacity_bytes=t.capacity_bytes,
                                    used_bytes=t.used_bytes, objects=t.objects,
                                    evictions=t.evictions) for t in tiers.values()],
                pending_puts=self.core.pending_puts, nodes_alive=self.core.nodes_alive,
                cluster_id=self.core.cluster_id, methods=self.method_times.snapshot())
        return self._serve(context, stats)
