"""The block pool: which KV blocks are free, who holds them, and which prefix each one caches.

Owns reference counts, the content-hash index (equal prefixes share blocks) and LRU eviction of
cached blocks that nobody holds. It must not touch tensors: it hands out block ids.

Blocks are named by their chained content hashes (`pdserve.core.block_hash`): a block's hash
covers its parent's hash, its tokens and a salt (the tenant), so two prompts share a block only
if they share everything before it too, and one tenant never hits another's blocks (invariant 6).

The pool also reports its prefix cache's changes (`BlockEventLog`): a block registered under a
hash is "stored", a cached block taken for other content is "removed". The log is bounded: past
`max_events` the oldest go (counted), and a reader that asks for lost events is told to resync
from a snapshot of the cached hashes. The worker streams it to routers (KV-aware routing).
"""

from __future__ import annotations

import threading
from array import array
from collections import deque
from dataclasses import dataclass
from typing import Protocol

# Block naming is shared with the router and the simulator; re-exported for the engine's callers.
from pdserve.core.block_hash import hash_block, prompt_block_hashes  # noqa: F401
from pdserve.core.errors import NoFreeBlocksError  # noqa: F401 - raised here, re-exported


STORED = "stored"
REMOVED = "removed"


@dataclass(frozen=True)
class BlockEvent:
    seq: int
    kind: str  # STORED or REMOVED
    block_hash: bytes


class EventSink(Protocol):
    def append(self, kind: str, block_hash: bytes) -> None: ...


class BlockEventLog:
    """Bounded log of prefix-cache changes. Written by the engine thread; read by RPC threads
    (hence the condition), which wait for new events instead of polling."""

    def __init__(self, max_events: int = 4096) -> None:
        if max_events < 1:
            raise ValueError(f"max_events must be >= 1, got {max_events}")
        self._events: deque[BlockEvent] = deque(maxlen=max_events)
        self._cond = threading.Condition()
        self.last_seq = 0
        self.dropped = 0

    def append(self, kind: str, block_hash: bytes) -> None:
        with self._cond:
            if len(self._events) == self._events.maxlen:
                self.dropped += 1
            self.last_seq += 1
            self._events.append(BlockEvent(self.last_seq, kind, block_hash))
            self._cond.notify_all()

    def since(self, seq: int) -> tuple[list[BlockEvent], bool]:
        """(events with seq > `seq`, lost): lost means some of them were dropped, and the
        reader must resync from a snapshot."""
        with self._cond:
            if seq >= self.last_seq:
                return [], False
            first = self._events[0].seq if self._events else self.last_seq + 1
            if seq < first - 1:
                return [], True
            return list(self._events)[seq - first + 1:], False

    def wait(self, seq: int, timeout_s: float) -> bool:
        """Block until an event after `seq` exists or `timeout_s` passes; True if one does."""
        with self._cond:
            return self._cond.wait_for(lambda: self.last_seq > seq, timeout=timeout_s)


@dataclass
class PoolStats:
    num_blocks: int
    num_free: int  # free or evictable (cached with no holder)
    num_cached: int
    evictions: int


class BlockPool:
    """Blocks with no holder are free, in the order they are reused: plain blocks released
    since the start, the most recent first; then those never taken yet, by id; then cached
    ones, the least recently released first (taking one evicts its hash). Kept in three parts
    so that a pool of tens of thousands of blocks costs a few bytes per block, not an ordered
    map entry each: a stack of released plain blocks, the id the untaken ones start at, and a
    doubly linked list of the cached ones in two arrays indexed by block id."""

    def __init__(self, num_blocks: int, max_events: int = 4096) -> None:
        self.num_blocks = num_blocks
        self.ref = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.by_hash: dict[bytes, int] = {}
        self._plain: list[int] = []  # released plain blocks; the last is reused first
        self._untaken = 0  # blocks [_untaken, num_blocks) were never taken
        # Cached blocks with no holder, least recently released first: a ring through the
        # sentinel `num_blocks` (its next is the oldest, its previous the newest).
        self._next = array("i", [num_blocks]) * (num_blocks + 1)
        self._prev = array("i", [num_blocks]) * (num_blocks + 1)
        self._idle_cached = 0
        self.evictions = 0
        # Where the changes go: a `BlockEventLog`, or what else takes `append(kind, hash)`.
        self.events: EventSink = BlockEventLog(max_events)

    @property
    def num_free(self) -> int:
        return len(self._plain) + self.num_blocks - self._untaken + self._idle_cached

    def lookup(self, h: bytes) -> int | None:
        return self.by_hash.get(h)

    def _unlink(self, bid: int) -> None:
        """Take a cached block with no holder out of the reuse order."""
        nxt, prev = self._next, self._prev
        before, after = prev[bid], nxt[bid]
        nxt[before] = after
        prev[after] = before
        self._idle_cached -= 1

    def _take_free(self) -> int:
        """The next free block in reuse order (one must exist), held by nobody yet."""
        plain = self._plain
        if plain:
            return plain.pop()
        end = self.num_blocks
        bid = self._untaken
        if bid < end:
            self._untaken = bid + 1
            return bid
        nxt = self._next
        bid = nxt[end]  # the oldest cached: unlinked here, as `_unlink` does
        after = nxt[bid]
        nxt[end] = after
        self._prev[after] = end
        self._idle_cached -= 1
        return bid

    def take_cached(self, block_id: int) -> None:
        """Hold a cached block (prefix hit)."""
        if self.ref[block_id] == 0:
            assert self.block_hash[block_id] is not None, f"block {block_id} is not cached"
            self._unlink(block_id)
        self.ref[block_id] += 1

    def allocate(self, n: int) -> list[int]:
        """n blocks, each as `allocate_one` takes it (one loop: a prompt takes dozens)."""
        free = self.num_free
        if n > free:
            raise NoFreeBlocksError(f"need {n} blocks, {free} free")
        block_hash, ref, plain, take = self.block_hash, self.ref, self._plain, self._take_free
        out = []
        for _ in range(n):
            bid = plain.pop() if plain else take()
            if block_hash[bid] is not None:
                self._evict(bid)
            ref[bid] = 1
            out.append(bid)
        return out

    def allocate_one(self) -> int:
        """One block, held once: a plain free block, else the least recently released cached
        one, evicted (its hash leaves the index: a "removed" event)."""
        if not self.num_free:
            raise NoFreeBlocksError("need 1 block, 0 free")
        bid = self._take_free()
        if self.block_hash[bid] is not None:
            self._evict(bid)
        self.ref[bid] = 1
        return bid

    def _evict(self, bid: int) -> None:
        old = self.block_hash[bid]
        assert old is not None  # only cached blocks are evicted
        del self.by_hash[old]
        self.block_hash[bid] = None
        self.evictions += 1
        self.events.append(REMOVED, old)

    def place(self, hashes: list[bytes], has_data: list[bool], n_full: int,
              cache: bool) -> tuple[list[int], list[tuple[int, int]]]:
        """Hold the leading run of a prompt's blocks that can be placed here, in order: a full
        block (index < `n_full`) the cache holds by its hash is taken; else one with data
        (`has_data[i]`) gets a free block, registered under its hash when full and `cache`.
        Stops at the first that can be neither. Returns (the blocks held, (index, block id) of
        those whose data the caller writes). The same as `lookup`, `take_cached`,
        `allocate_one` and `register` per block, in one loop."""
        by_hash, ref, block_hash, events = self.by_hash, self.ref, self.block_hash, self.events
        table: list[int] = []
        writes: list[tuple[int, int]] = []
        for i, (h, data) in enumerate(zip(hashes, has_data)):
            bid = by_hash.get(h) if i < n_full else None
            if bid is not None:
                if ref[bid] == 0:
                    self._unlink(bid)
                ref[bid] += 1
            elif data and self.num_free:
                bid = self._take_free()
                if block_hash[bid] is not None:
                    self._evict(bid)
                ref[bid] = 1
                writes.append((i, bid))
                # Not cached here (looked up above), and evicting removed only another hash.
                if i < n_full and cache:
                    block_hash[bid] = h
                    by_hash[h] = bid
                    events.append(STORED, h)
            else:
                break
            table.append(bid)
        return table, writes

    def release(self, block_ids: list[int]) -> None:
        """Drop one hold on each block; blocks are released tail first so a prompt's
        last blocks are evicted before its first ones (the first are shared more)."""
        ref, block_hash, plain = self.ref, self.block_hash, self._plain
        nxt, prev, end = self._next, self._prev, self.num_blocks
        for bid in reversed(block_ids):
            held = ref[bid]
            assert held > 0, f"block {bid} released twice"
            ref[bid] = held - 1
            if held == 1:
                if block_hash[bid] is None:
                    plain.append(bid)  # plain blocks are reused first
                else:  # cached: the newest in their reuse order
                    newest = prev[end]
                    nxt[newest] = bid
                    prev[bid] = newest
                    nxt[bid] = end
                    prev[end] = bid
                    self._idle_cached += 1

    def register(self, block_id: int, h: bytes) -> None:
        """Mark a held, fully written block as caching the prefix `h`."""
        assert self.ref[block_id] > 0, f"block {block_id} is registered with no holder"
        if self.block_hash[block_id] is not None:
            return  # already cached
        if self.by_hash.setdefault(h, block_id) != block_id:
            return  # cached by another block holding the same content
        self.block_hash[block_id] = h
        self.events.append(STORED, h)

    def free_order(self) -> list[int]:
        """The free blocks in the order they would be reused (plain, untaken, cached)."""
        out = self._plain[::-1] + list(range(self._untaken, self.num_blocks))
        bid = self._next[self.num_blocks]
        while bid != self.num_blocks:
            out.append(bid)
            bid = self._next[bid]
        return out

    def cached_hashes(self) -> list[bytes]:
        """Every hash the prefix cache holds now (the snapshot a resync starts from)."""
        return list(self.by_hash)

    def stats(self) -> PoolStats:
        return PoolStats(self.num_blocks, self.num_free, len(self.by_hash), self.evictions)
