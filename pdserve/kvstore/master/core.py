"""MasterCore: the store master's decisions, pure (docs/kvstore.md, "Master core (pure)").

Owns the protocol: node registration and liveness, two-phase puts with replica placement,
reads with leases, pins, the longest cached prefix, corruption reports, and watermark eviction
(approximate LRU by sampling; DRAM replicas demoted to SSD on the same node when there is room;
an object read while only on SSD promoted back to DRAM on its node).
Every committed-state change goes through a journal record (see `state.py`), so a master rebuilt
with `restore` knows every committed object and no uncommitted one. Must not do I/O, read clocks
or take locks: the adapter serialises calls, passes `now_s` (one clock shared by all masters,
e.g. wall time, so pins survive a failover), carries out demotions and persists the journal.

Decisions worth knowing:
- `remove` of a leased object hides it at once; its bytes are freed when the lease ends.
- A node that registers again is treated as restarted: its old replicas are dropped first.
- A put lands on min(replicas, live nodes) distinct nodes if space allows, otherwise on as
  many as have room (at least one, else NoSpace). DRAM first; SSD only when DRAM is full even
  after eviction.
- Eviction runs after every put_start and on `evict(now_s)` (call it periodically), per tier,
  past high_watermark down to low_watermark; a put that does not fit also evicts for room on
  the nodes it still needs. Bytes already leaving (demotions in flight, frees deferred behind a
  lease) do not count as pressure. A demoted object stays readable from DRAM until
  `demote_done`; `demote_abort` (or put_timeout_s) cancels and keeps the DRAM copy.
- Promotion reuses the demotion machinery (a "tier move": the same outbox, `demote_done` /
  `demote_abort` and journal record), in the other direction: `get` of an object with no DRAM
  replica orders a copy of one SSD replica into DRAM on the same node, making room there by
  demoting colder objects if needed (the copy then waits for a later read). The reader is
  served from SSD meanwhile; later reads find the DRAM copy.
- `longest_prefix` leases the matched blocks (the router is about to send a worker to read
  them) but does not refresh their LRU time; `exists` does neither.
"""

from __future__ import annotations

import heapq

import math
from typing import Iterable, Sequence

from pdserve.kvstore.master.config import MasterConfig
from pdserve.kvstore.master.model import (
    TIERS, AlreadyExists, Demotion, InvalidArgument, NoSpace, NotFound, ObjectInfo, Placement,
    PutInProgress, Record, SegmentSpec, TierStats, UnknownNode,
)
from pdserve.kvstore.master.state import InFlightDemotion, MasterState, ObjectState


def _check_key(key: object) -> str:
    if not isinstance(key, str) or not key:
        raise InvalidArgument(f"key must be a non-empty string, got {key!r}")
    return key


def _check_time(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidArgument(f"{name} must be a finite number, got {value!r}")
    return float(value)


class MasterCore(MasterState):
    def __init__(self, config: MasterConfig | None = None) -> None:
        super().__init__(config or MasterConfig())
        self._demotion_outbox: list[Demotion] = []
        self.promotions_ordered = 0
        self._sample_cursor = 0  # the rotating window of eviction candidates

    @classmethod
    def restore(cls, config: MasterConfig, snapshot: dict | None, records: Iterable[Record],
                now_s: float) -> MasterCore:
        """A master with the committed state of `snapshot` plus `records` after it. Nodes count
        as last seen at `now_s`, so they have node_timeout_s to heartbeat the new master."""
        core = cls(config)
        if snapshot is not None:
            core._load_snapshot(snapshot, now_s)
        core.replay(records, now_s)
        return core

    # -- nodes ---------------------------------------------------------------------------------

    def register_node(self, node_id: str, host_id: str, data_address: str,
                      segments: Sequence[SegmentSpec | tuple], now_s: float,
                      ucx_address: str = "") -> None:
        """Adds a storage node; a node already known is treated as restarted (replicas dropped)."""
        _check_key(node_id)
        for name, value in (("host_id", host_id), ("data_address", data_address),
                            ("ucx_address", ucx_address)):
            if not isinstance(value, str):
                raise InvalidArgument(f"node {node_id!r}: {name} must be a string, got {value!r}")
        specs = [s if isinstance(s, SegmentSpec) else SegmentSpec(*s) for s in segments]
        if not specs:
            raise InvalidArgument(f"node {node_id!r}: segments must not be empty")
        if len({s.segment_id for s in specs}) != len(specs):
            raise InvalidArgument(f"node {node_id!r}: segment ids must be distinct")
        now_s = _check_time("now_s", now_s)
        if node_id in self._cluster.nodes:
            self._record("node_dead", now_s, node_id=node_id)
        self._record("register_node", now_s, node_id=node_id, host_id=host_id,
                     data_address=data_address, ucx_address=ucx_address,
                     segments=[s.to_dict() for s in specs])

    def heartbeat(self, node_id: str, now_s: float) -> None:
        node = self._cluster.nodes.get(node_id)
        if node is None:
            raise UnknownNode(f"node {node_id!r} is not registered (or was declared dead)")
        node.last_seen_s = max(node.last_seen_s, now_s)

    def expire_nodes(self, now_s: float) -> list[str]:
        """Declares nodes silent for longer than node_timeout_s dead; returns their ids."""
        dead = sorted(n.node_id for n in self._cluster.nodes.values()
                      if now_s - n.last_seen_s > self.config.node_timeout_s)
        for node_id in dead:
            self._record("node_dead", now_s, node_id=node_id)
        return dead

    # -- two-phase put -------------------------------------------------------------------------

    def put_start(self, key: str, size: int, checksum: int, replicas: int,
                  now_s: float) -> list[Placement]:
        """Reserves space for `key` on distinct nodes; the object stays invisible until
        put_commit. Raises AlreadyExists, PutInProgress, NoSpace, InvalidArgument."""
        _check_key(key)
        for name, value in (("size", size), ("replicas", replicas), ("checksum", checksum)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidArgument(f"{name} must be an integer, got {value!r}")
        if size <= 0 or replicas < 1 or not 0 <= checksum < 2**32:
            raise InvalidArgument(f"need size > 0, replicas >= 1, 0 <= checksum < 2**32; got "
                                  f"size={size}, replicas={replicas}, checksum={checksum}")
        now_s = _check_time("now_s", now_s)
        if key in self._objects:
            raise AlreadyExists(f"key {key!r} is already committed")
        if key in self._pending:
            raise PutInProgress(f"a put of key {key!r} is already in progress")
        self._release_deferred(now_s)
        if not self._cluster.nodes:
            raise NoSpace("no storage nodes are registered")
        if self._cluster.length_of(size) > self._cluster.largest_segment():
            raise NoSpace(f"key {key!r}: {size} bytes exceed every segment "
                          f"(largest {self._cluster.largest_segment()} bytes)")
        wanted = min(replicas, len(self._cluster.nodes))
        placements: list[Placement] = []
        # DRAM, then DRAM after eviction, then SSD, then SSD after eviction.
        for tiers, evict_tier in ((("dram",), None), (("dram",), "dram"),
                                  (("dram", "ssd"), None), (("dram", "ssd"), "ssd")):
            if len(placements) == wanted:
                break
            used = {p.node_id for p in placements}
            if evict_tier is not None:
                others = set(self._cluster.nodes) - used
                need = self._cluster.length_of(size) * (wanted - len(placements))
                self._evict_tier(evict_tier, now_s, need_bytes=need, nodes=others)
            placements += self._cluster.place(size, wanted - len(placements), tiers, used)
        if not placements:
            raise NoSpace(f"key {key!r}: no node has {size} free bytes, even after eviction")
        self._pending[key] = ObjectState(key, size, checksum, placements, now_s, now_s)
        self._maybe_evict(now_s)
        return placements

    def put_commit(self, key: str, now_s: float) -> None:
        """Makes a pending put visible. Committing an already committed key is a no-op (a
        retried commit); a put that was aborted or reclaimed raises NotFound."""
        if key in self._objects:
            return
        obj = self._pending.get(key)
        if obj is None:
            raise NotFound(f"no pending put of key {key!r} (aborted, timed out or never started)")
        self._record("commit", now_s, key=key, size=obj.size, checksum=obj.checksum,
                     replicas=[p.to_dict() for p in obj.replicas], now_s=now_s)

    def put_abort(self, key: str) -> bool:
        """Frees a pending put's space; False if there was none."""
        obj = self._pending.pop(key, None)
        if obj is None:
            return False
        for p in obj.replicas:
            self._cluster.free(p)
        return True

    def reclaim_pending(self, now_s: float) -> list[str]:
        """Frees puts not committed within put_timeout_s and aborts demotions as old; also
        frees deferred extents whose time has come. Returns the reclaimed puts' keys."""
        self._release_deferred(now_s)
        limit = now_s - self.config.put_timeout_s
        stale = [k for k, o in self._pending.items() if o.started_s <= limit]
        for key in stale:
            self.put_abort(key)
        for (key, node_id), d in list(self._demotions.items()):
            if d.started_s <= limit:
                self.demote_abort(key, node_id)
        return stale

    # -- reads ---------------------------------------------------------------------------------

    def get(self, key: str, now_s: float) -> ObjectInfo:
        """A committed object's metadata with a read lease of lease_s; refreshes its LRU time."""
        obj = self._objects.get(key)
        if obj is None:
            raise NotFound(f"no committed object under key {key!r}")
        obj.touched_s = max(obj.touched_s, now_s)
        self._lease(obj, now_s)
        info = ObjectInfo(key, obj.size, obj.checksum, tuple(obj.replicas), obj.lease_until_s)
        if self.config.promote_on_read:
            self._maybe_promote(obj, now_s)
        return info

    def _maybe_promote(self, obj: ObjectState, now_s: float) -> None:
        """Orders one SSD replica of an SSD-only object back into DRAM on its node."""
        if any(p.tier == "dram" for p in obj.replicas):
            return
        for p in obj.replicas:
            if (obj.key, p.node_id) in self._demotions:
                return  # a move of this object is already in flight
        for p in obj.replicas:
            target = self._cluster.allocate_on(p.node_id, ("dram",), p.size)
            if target is None:
                # No room: demote colder objects off this node; a later read finds room.
                self._evict_tier("dram", now_s, need_bytes=self._cluster.length_of(p.size),
                                 nodes={p.node_id})
                continue
            self._demotions[(obj.key, p.node_id)] = InFlightDemotion(p, target, now_s)
            self._outgoing["ssd"] += self._cluster.length_of(p.size)
            self.promotions_ordered += 1
            self._demotion_outbox.append(Demotion(obj.key, p, target))
            return

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is committed; no lease, no LRU refresh."""
        return [k in self._objects for k in keys]

    def longest_prefix(self, keys: Sequence[str],
                       now_s: float) -> tuple[int, list[list[Placement]]]:
        """How many leading keys are committed, and the replicas of each; the matched objects
        are leased (a worker is about to read them) but their LRU time is left alone."""
        found: list[list[Placement]] = []
        for key in keys:
            obj = self._objects.get(key)
            if obj is None:
                break
            self._lease(obj, now_s)
            found.append(list(obj.replicas))
        return len(found), found

    def _lease(self, obj: ObjectState, now_s: float) -> None:
        obj.lease_until_s = max(obj.lease_until_s, now_s + self.config.lease_s)

    # -- lifecycle -----------------------------------------------------------------------------

    def remove(self, key: str, now_s: float) -> None:
        """Deletes a committed object: invisible at once; a leased one's bytes are freed when
        its lease ends."""
        if key not in self._objects:
            raise NotFound(f"no committed object under key {key!r}")
        self._record("remove", now_s, key=key)

    def pin(self, key: str, ttl_s: float, now_s: float) -> float:
        """Keeps the object out of eviction until now_s + ttl_s (pins only extend); returns the
        pin's end."""
        obj = self._objects.get(key)
        if obj is None:
            raise NotFound(f"no committed object under key {key!r}")
        if _check_time("ttl_s", ttl_s) <= 0:
            raise InvalidArgument(f"ttl_s must be positive, got {ttl_s!r}")
        until = max(obj.pin_until_s, now_s + ttl_s)
        if until != obj.pin_until_s:
            self._record("pin", now_s, key=key, pin_until_s=until)
        return until

    def report_corrupt(self, key: str, node_id: str, now_s: float) -> bool:
        """Drops `node_id`'s replica of `key` (a reader found a bad checksum there); False if
        there is no such replica. The last replica dropped removes the object."""
        obj = self._objects.get(key)
        if obj is None or obj.replica_on(node_id) is None:
            return False
        self._record("corrupt", now_s, key=key, node_id=node_id)
        return True

    # -- eviction and demotion -----------------------------------------------------------------

    def evict(self, now_s: float) -> None:
        """Runs the watermark check on every tier (the adapter calls it periodically, since
        leases and pins expiring can make progress possible without any new put)."""
        self._release_deferred(now_s)
        self._maybe_evict(now_s)

    def take_demotions(self) -> list[Demotion]:
        """Tier moves (demotions to SSD, promotions to DRAM) ordered since the last call; carry
        each out (copy source to target), then demote_done/abort."""
        out, self._demotion_outbox = self._demotion_outbox, []
        return out

    def demote_done(self, key: str, node_id: str, now_s: float) -> bool:
        """The SSD copy is written: readers switch to it and the DRAM extent is freed (when
        the object's lease ends, if leased). False if the demotion was cancelled meanwhile."""
        if (key, node_id) not in self._demotions:
            return False
        d = self._demotions[(key, node_id)]
        self._record("demote", now_s, key=key, node_id=node_id, target=d.target.to_dict())
        return True

    def demote_abort(self, key: str, node_id: str) -> bool:
        """The copy failed: free the SSD extent; the DRAM replica stays (eviction may retry)."""
        d = self._demotions.pop((key, node_id), None)
        if d is None:
            return False
        self._outgoing[d.source.tier] -= self._len(d)
        self._cluster.free(d.target)
        return True

    def _effective_used(self, tier: str) -> int:
        return self._cluster.used(tier) - self._outgoing[tier]

    def _maybe_evict(self, now_s: float) -> None:
        # DRAM first: its demotions may push SSD past its own watermark.
        for tier in TIERS:
            cap = self._cluster.capacity(tier)
            if cap and self._effective_used(tier) > self.config.high_watermark * cap:
                self._evict_tier(tier, now_s, target_used=self.config.low_watermark * cap)

    def _evictable(self, obj: ObjectState, tier: str, now_s: float,
                   nodes: set[str] | None) -> bool:
        if obj.lease_until_s > now_s or obj.pin_until_s > now_s:
            return False
        return any(p.tier == tier and (nodes is None or p.node_id in nodes)
                   and (obj.key, p.node_id) not in self._demotions for p in obj.replicas)

    def _evict_tier(self, tier: str, now_s: float, target_used: float | None = None,
                    need_bytes: int = 0, nodes: set[str] | None = None) -> None:
        """Evicts `tier` replicas, approximately least recently touched first, until the tier's
        used bytes (less those already on their way out) are <= target_used and need_bytes
        have been moved out of `nodes`, or nothing more is evictable."""
        candidates = [o for o in self._objects.values()
                      if self._evictable(o, tier, now_s, nodes)]
        # Exact LRU: a heap of (last touch, insertion order); built in O(n), popped per victim.
        heap = [(o.touched_s, i) for i, o in enumerate(candidates)] \
            if self.config.eviction_sample == 0 else None
        if heap is not None:
            heapq.heapify(heap)
        freed = 0
        while candidates and ((target_used is not None
                               and self._effective_used(tier) > target_used)
                              or freed < need_bytes):
            if heap is not None:
                if not heap:
                    break
                victim = candidates[heapq.heappop(heap)[1]]
            else:
                victim = candidates.pop(self._sample_oldest(candidates))
            freed += self._evict_object(victim, tier, now_s, nodes)

    def _sample_oldest(self, candidates: list[ObjectState]) -> int:
        """Index of the least recently touched among a window of eviction_sample candidates.

        The window rotates over the candidates (a clock hand, not random), so runs are
        reproducible; with no more candidates than eviction_sample it is exact LRU.
        """
        n = len(candidates)
        k = min(self.config.eviction_sample, n)
        start = self._sample_cursor % n
        self._sample_cursor = start + k
        window = [(start + j) % n for j in range(k)]
        return min(window, key=lambda i: (candidates[i].touched_s, i))

    def _evict_object(self, obj: ObjectState, tier: str, now_s: float,
                      nodes: set[str] | None) -> int:
        """Moves obj's `tier` replicas out: DRAM ones to SSD on the same node where it has
        room (a demotion order), the rest dropped. Returns the bytes moved out."""
        moved = 0
        for p in list(obj.replicas):
            if (p.tier != tier or (nodes is not None and p.node_id not in nodes)
                    or (obj.key, p.node_id) in self._demotions):  # already on its way out
                continue
            length = self._cluster.length_of(p.size)
            target = self._cluster.allocate_on(p.node_id, ("ssd",), p.size) \
                if tier == "dram" else None
            if target is not None:
                self._demotions[(obj.key, p.node_id)] = InFlightDemotion(p, target, now_s)
                self._outgoing[tier] += length
                self._evictions[tier] += 1
                self._demotion_outbox.append(Demotion(obj.key, p, target))
            else:
                self._record("evict", now_s, key=obj.key, node_id=p.node_id)
            moved += length
        return moved

    # -- observation ---------------------------------------------------------------------------

    def stats(self) -> dict[str, TierStats]:
        out = {}
        for tier in TIERS:
            objects = sum(1 for o in self._objects.values()
                          if any(p.tier == tier for p in o.replicas))
            pending = sum(1 for o in self._pending.values()
                          if any(p.tier == tier for p in o.replicas))
            out[tier] = TierStats(tier, self._cluster.capacity(tier), self._cluster.used(tier),
                                  objects, self._evictions[tier], pending)
        return out
