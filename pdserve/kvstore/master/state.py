"""The master's state and the only code that changes committed state: journal records applied.

Owns the object tables (committed and pending), in-flight demotions, deferred frees, the event
log, the journal outbox, and `_apply(record)`, which the live core and a restoring master both
run, so replay rebuilds exactly what the live master had committed. Also snapshot/restore and
the invariant check. Must not decide policy (placement order, what to evict, timeouts): that is
`core.py`. Pure: no I/O, no clock; `now_s` comes in with every call.

The cluster id is committed state too (record `cluster`, and in snapshots): a master restarted
on its journal keeps serving the cluster it was started for.

Soft state, deliberately not journaled (a restored master starts without it): pending puts,
read leases, LRU touch times (a restored object's touch time is its commit time), in-flight
demotions, deferred frees, eviction counters, heartbeats (restored nodes count as seen at
restore time).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable

from pdserve.kvstore.master.cluster import Cluster
from pdserve.kvstore.master.config import MasterConfig
from pdserve.kvstore.master.model import (
    DEMOTED, EVICTED, NODE_DEAD, NODE_JOINED, PROMOTED, REMOVED, REPLICA_DROPPED, STORED, TIERS,
    ClusterIdConflict, Event, EventsLost, Placement, Record, RestoreError, SegmentSpec,
)

SNAPSHOT_VERSION = 1
_NEVER = float("-inf")


@dataclass
class ObjectState:
    key: str
    size: int
    checksum: int
    replicas: list[Placement]  # at most one per node
    started_s: float  # put_start time (pending) or commit time (committed)
    touched_s: float
    lease_until_s: float = _NEVER
    pin_until_s: float = _NEVER

    def replica_on(self, node_id: str) -> Placement | None:
        return next((p for p in self.replicas if p.node_id == node_id), None)


@dataclass
class InFlightDemotion:
    source: Placement
    target: Placement
    started_s: float


@dataclass(order=True)
class _DeferredFree:
    free_at_s: float
    tiebreak: int
    placement: Placement = field(compare=False)


class MasterState:
    def __init__(self, config: MasterConfig) -> None:
        self.config = config
        self._cluster = Cluster(config.alloc_align_bytes)
        self._objects: dict[str, ObjectState] = {}  # committed; insertion order = commit order
        self._pending: dict[str, ObjectState] = {}
        self._demotions: dict[tuple[str, str], InFlightDemotion] = {}  # (key, node_id)
        self._deferred: list[_DeferredFree] = []  # heap by free_at_s
        self._deferred_ids = itertools.count()
        # Bytes per tier already on their way out (demotion sources, deferred frees): eviction
        # does not count them as pressure, or it would evict more to cover bytes it cannot speed.
        self._outgoing: dict[str, int] = {t: 0 for t in TIERS}
        self._evictions: dict[str, int] = {t: 0 for t in TIERS}
        self._events: deque[Event] = deque(maxlen=config.max_events)
        self._event_seq = 0
        self._journal_seq = 0
        self._outbox: list[Record] = []
        self._records_since_snapshot = 0
        self.cluster_id = ""  # "" until claimed: callers of any cluster are served

    # -- journal -------------------------------------------------------------------------------

    @property
    def pending_puts(self) -> int:
        return len(self._pending)

    @property
    def nodes_alive(self) -> int:
        return len(self._cluster.nodes)

    def take_journal(self) -> list[Record]:
        """Records appended since the last call, in seq order; the caller makes them durable."""
        out, self._outbox = self._outbox, []
        return out

    def snapshot_due(self) -> bool:
        return self._records_since_snapshot >= self.config.snapshot_every_ops

    def claim_cluster_id(self, cluster_id: str, now_s: float) -> str:
        """The cluster this master serves: the one its journal names, else `cluster_id`
        (journaled, so a restart keeps it; "" claims none). ClusterIdConflict when the journal
        names another."""
        if not cluster_id or cluster_id == self.cluster_id:
            return self.cluster_id
        if self.cluster_id:
            raise ClusterIdConflict(f"cluster id mismatch: this master was started for cluster "
                                    f"{cluster_id!r}, its journal belongs to cluster "
                                    f"{self.cluster_id!r}")
        self._record("cluster", now_s, cluster_id=cluster_id)
        return cluster_id

    def _record(self, op: str, now_s: float, /, **fields: Any) -> None:
        self._journal_seq += 1
        rec = Record(self._journal_seq, op, fields)
        self._outbox.append(rec)
        self._records_since_snapshot += 1
        self._apply(rec, now_s)

    def _apply(self, rec: Record, now_s: float) -> None:
        f = rec.fields
        try:
            handler = getattr(self, f"_apply_{rec.op}")
        except AttributeError:
            raise RestoreError(f"journal record {rec.seq}: unknown op {rec.op!r}") from None
        try:
            handler(f, now_s)
        except (KeyError, TypeError, ValueError) as e:
            raise RestoreError(f"journal record {rec.seq} ({rec.op}) does not apply: {e!r}") from e

    def _apply_cluster(self, f: dict, now_s: float) -> None:
        self.cluster_id = str(f["cluster_id"])

    def _apply_register_node(self, f: dict, now_s: float) -> None:
        if f["node_id"] in self._cluster.nodes:
            raise RestoreError(f"node {f['node_id']!r} registered twice without node_dead")
        segments = [SegmentSpec.from_dict(s) for s in f["segments"]]
        self._cluster.add_node(f["node_id"], f["host_id"], f["data_address"], segments, now_s,
                               f.get("ucx_address", ""))
        self._emit(NODE_JOINED, "", (f["node_id"],))

    def _apply_node_dead(self, f: dict, now_s: float) -> None:
        node_id = f["node_id"]
        for obj in list(self._objects.values()):
            if obj.replica_on(node_id) is not None:
                self._drop_replica(obj, node_id, "node_lost", now_s)
        for key, obj in list(self._pending.items()):
            obj.replicas = [p for p in obj.replicas if p.node_id != node_id]
            if not obj.replicas:
                del self._pending[key]  # its commit will answer NotFound
        for dk in [dk for dk in self._demotions if dk[1] == node_id]:
            del self._demotions[dk]
        self._deferred = [d for d in self._deferred if d.placement.node_id != node_id]
        heapq.heapify(self._deferred)
        self._cluster.drop_node(node_id)
        self._recount_outgoing()
        self._emit(NODE_DEAD, "", (node_id,))

    def _apply_commit(self, f: dict, now_s: float) -> None:
        key = f["key"]
        if key in self._objects:
            raise RestoreError(f"commit of {key!r}, already committed")
        replicas = [Placement.from_dict(p) for p in f["replicas"]]
        if self._pending.pop(key, None) is None:
            # Replay: the space was never reserved in this master.
            for p in replicas:
                if not self._cluster.reserve(p):
                    raise RestoreError(f"commit of {key!r}: extent {p} is not free")
        self._objects[key] = ObjectState(key, f["size"], f["checksum"], replicas,
                                         started_s=f["now_s"], touched_s=f["now_s"])
        self._emit(STORED, key, tuple(p.node_id for p in replicas))

    def _apply_remove(self, f: dict, now_s: float) -> None:
        obj = self._objects.pop(f["key"])
        for p in obj.replicas:
            self._forget_demotion(obj.key, p.node_id, now_s)
            self._release(p, obj.lease_until_s, now_s)
        self._emit(REMOVED, obj.key, tuple(p.node_id for p in obj.replicas))

    def _apply_evict(self, f: dict, now_s: float) -> None:
        obj = self._objects[f["key"]]
        self._evictions[self._replica(obj, f["node_id"]).tier] += 1
        self._drop_replica(obj, f["node_id"], "lru", now_s)

    def _apply_corrupt(self, f: dict, now_s: float) -> None:
        obj = self._objects[f["key"]]
        self._replica(obj, f["node_id"])
        self._drop_replica(obj, f["node_id"], "corrupt", now_s)

    def _apply_demote(self, f: dict, now_s: float) -> None:
        obj = self._objects[f["key"]]
        source = self._replica(obj, f["node_id"])
        target = Placement.from_dict(f["target"])
        inflight = self._demotions.pop((obj.key, f["node_id"]), None)
        if inflight is not None:
            self._outgoing[source.tier] -= self._len(inflight)
        elif not self._cluster.reserve(target):
            raise RestoreError(f"demote of {obj.key!r}: extent {target} is not free")
        obj.replicas = [target if p is source else p for p in obj.replicas]
        self._release(source, obj.lease_until_s, now_s)
        self._emit(PROMOTED if target.tier == "dram" else DEMOTED, obj.key, (f["node_id"],))

    def _apply_pin(self, f: dict, now_s: float) -> None:
        self._objects[f["key"]].pin_until_s = f["pin_until_s"]

    # -- helpers shared by the apply handlers and the core ------------------------------------

    @staticmethod
    def _replica(obj: ObjectState, node_id: str) -> Placement:
        p = obj.replica_on(node_id)
        if p is None:
            raise RestoreError(f"{obj.key!r} has no replica on node {node_id!r}")
        return p

    def _len(self, d: InFlightDemotion) -> int:
        return self._cluster.length_of(d.source.size)

    def _recount_outgoing(self) -> None:
        self._outgoing = {t: 0 for t in TIERS}
        for d in self._demotions.values():
            self._outgoing[d.source.tier] += self._len(d)
        for d in self._deferred:
            self._outgoing[d.placement.tier] += self._cluster.length_of(d.placement.size)

    def _drop_replica(self, obj: ObjectState, node_id: str, reason: str, now_s: float) -> None:
        p = obj.replica_on(node_id)
        obj.replicas.remove(p)
        self._forget_demotion(obj.key, node_id, now_s)
        self._release(p, obj.lease_until_s, now_s)
        if obj.replicas:
            self._emit(REPLICA_DROPPED, obj.key, (node_id,), reason)
        else:
            del self._objects[obj.key]
            self._emit(EVICTED, obj.key, (node_id,), reason)

    def _release(self, p: Placement, free_at_s: float, now_s: float) -> None:
        """Frees an extent now, or at `free_at_s` if someone may still be using it then: a
        reader holding a lease copies out of it, a demotion copier writes into it. So a removed
        object is invisible at once, but its bytes stay put until its readers are done."""
        if free_at_s > now_s and p.node_id in self._cluster.nodes:
            heapq.heappush(self._deferred, _DeferredFree(free_at_s, next(self._deferred_ids), p))
            self._outgoing[p.tier] += self._cluster.length_of(p.size)
        else:
            self._cluster.free(p)

    def _forget_demotion(self, key: str, node_id: str, now_s: float) -> None:
        """Cancels an in-flight demotion whose source replica is going away; its copier may
        still be writing the target until the demotion would time out, so free it then."""
        d = self._demotions.pop((key, node_id), None)
        if d is not None:
            self._outgoing[d.source.tier] -= self._len(d)
            self._release(d.target, d.started_s + self.config.put_timeout_s, now_s)

    def _release_deferred(self, now_s: float) -> None:
        while self._deferred and self._deferred[0].free_at_s <= now_s:
            p = heapq.heappop(self._deferred).placement
            self._outgoing[p.tier] -= self._cluster.length_of(p.size)
            self._cluster.free(p)

    def _emit(self, kind: str, key: str, node_ids: tuple[str, ...], reason: str = "") -> None:
        self._event_seq += 1
        self._events.append(Event(self._event_seq, kind, key, node_ids, reason))

    # -- events --------------------------------------------------------------------------------

    def events_since(self, seq: int) -> list[Event]:
        """Events with seq > `seq`, oldest first. Only the last `max_events` are kept: asking
        for older ones raises EventsLost (the follower must resynchronise from scratch)."""
        if seq >= self._event_seq:
            return []
        first = self._events[0].seq if self._events else self._event_seq + 1
        if seq < first - 1:
            raise EventsLost(f"events after seq {seq} are gone; the log starts at seq {first}")
        return list(itertools.islice(self._events, seq - first + 1, None))

    # -- snapshot / restore --------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """The committed state as JSON-serialisable data (pending puts are not part of it)."""
        self._records_since_snapshot = 0
        return {
            "version": SNAPSHOT_VERSION,
            "journal_seq": self._journal_seq,
            "event_seq": self._event_seq,
            "cluster_id": self.cluster_id,
            "nodes": [n.to_dict() for n in self._cluster.nodes.values()],
            "objects": [
                {"key": o.key, "size": o.size, "checksum": o.checksum, "commit_s": o.started_s,
                 "pin_until_s": None if o.pin_until_s == _NEVER else o.pin_until_s,
                 "replicas": [p.to_dict() for p in o.replicas]}
                for o in self._objects.values()
            ],
        }

    def _load_snapshot(self, snap: dict[str, Any], now_s: float) -> None:
        if snap.get("version") != SNAPSHOT_VERSION:
            raise RestoreError(f"snapshot version {snap.get('version')!r} is not "
                               f"{SNAPSHOT_VERSION}")
        try:
            self._journal_seq = int(snap["journal_seq"])
            self._event_seq = int(snap["event_seq"])
            self.cluster_id = str(snap.get("cluster_id", ""))  # absent in older snapshots
            for n in snap["nodes"]:
                self._cluster.add_node(n["node_id"], n["host_id"], n["data_address"],
                                       [SegmentSpec.from_dict(s) for s in n["segments"]], now_s,
                                       n.get("ucx_address", ""))
            for o in snap["objects"]:
                replicas = [Placement.from_dict(p) for p in o["replicas"]]
                for p in replicas:
                    if not self._cluster.reserve(p):
                        raise RestoreError(f"snapshot object {o['key']!r}: extent {p} not free")
                pin = _NEVER if o["pin_until_s"] is None else o["pin_until_s"]
                self._objects[o["key"]] = ObjectState(
                    o["key"], o["size"], o["checksum"], replicas, started_s=o["commit_s"],
                    touched_s=o["commit_s"], pin_until_s=pin)
        except (KeyError, TypeError, ValueError) as e:
            raise RestoreError(f"malformed snapshot: {e!r}") from e

    def replay(self, records: Iterable[Record], now_s: float) -> None:
        """Applies journal records written by another master (restore, or a standby following
        the leader's log). Records at or below the current seq are skipped; a gap is refused."""
        for rec in records:
            if rec.seq <= self._journal_seq:
                continue  # already in the snapshot (crash between snapshot and log truncation)
            if rec.seq != self._journal_seq + 1:
                raise RestoreError(f"journal gap: record {rec.seq} follows {self._journal_seq}")
            self._apply(rec, now_s)
            self._journal_seq = rec.seq

    def committed_state(self) -> dict[str, Any]:
        """Nodes and committed objects, for comparing masters (soft state left out)."""
        return {
            "nodes": {n.node_id: n.to_dict() for n in self._cluster.nodes.values()},
            "objects": {o.key: (o.size, o.checksum, o.pin_until_s,
                                sorted(tuple(sorted(p.to_dict().items())) for p in o.replicas))
                        for o in self._objects.values()},
            "journal_seq": self._journal_seq,
            "event_seq": self._event_seq,
            "cluster_id": self.cluster_id,
        }

    def check_invariants(self) -> None:
        """Asserts: extents tile each segment; every allocated extent is held by exactly one
        committed replica, pending placement, demotion target/source or deferred free; every
        committed object has a replica, at most one per node, on a live node."""
        self._cluster.check()
        held: list[tuple[str, str, int, int]] = []

        def hold(p: Placement) -> None:
            held.append((p.node_id, p.segment_id, p.offset, self._cluster.length_of(p.size)))

        for table in (self._objects, self._pending):
            for obj in table.values():
                assert obj.replicas, f"{obj.key!r} has no replica"
                nodes = [p.node_id for p in obj.replicas]
                assert len(set(nodes)) == len(nodes), f"{obj.key!r}: two replicas on one node"
                assert all(n in self._cluster.nodes for n in nodes)
                for p in obj.replicas:
                    hold(p)
        for d in self._demotions.values():
            hold(d.target)
        for d in self._deferred:
            hold(d.placement)
        assert len(held) == len(set(held)), "an extent is held twice"
        assert set(held) == self._cluster.allocated_extents(), "allocations != holders"
        expected = {t: 0 for t in TIERS}
        for d in self._demotions.values():
            expected[d.source.tier] += self._len(d)
        for d in self._deferred:
            expected[d.placement.tier] += self._cluster.length_of(d.placement.size)
        assert self._outgoing == expected, (self._outgoing, expected)
