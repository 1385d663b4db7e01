"""KV movement in the simulator: links shared by concurrent transfers, and the shared KV store.

Owns `Link` (processor sharing: n transfers in flight each progress at 1/n of the link, so a
transfer's uncontended time from the profile stretches with contention) and `KvStore` (capacity
in blocks, least recently used eviction; what it stores and evicts becomes the router's KV index
events). Must not decide routing or read a clock: `now` comes in.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

from pdserve.sim.engine_model import leading_run

_DONE_S = 1e-12


class Link:
    """Transfers in flight on one link; each key's remaining work in uncontended seconds."""

    __slots__ = ("name", "active", "last_s", "version", "busy_s")

    def __init__(self, name: str) -> None:
        self.name = name
        self.active: dict[Any, float] = {}
        self.last_s = 0.0
        self.version = 0  # bumped on every change: a completion event of an older one is stale
        self.busy_s = 0.0

    def _advance(self, now: float) -> None:
        dt = now - self.last_s
        if self.active and dt > 0:
            share = dt / len(self.active)
            for k in self.active:
                self.active[k] -= share
            self.busy_s += dt
        self.last_s = now

    def add(self, now: float, key: Any, work_s: float) -> None:
        self._advance(now)
        self.active[key] = max(0.0, work_s)
        self.version += 1

    def next_done_s(self, now: float) -> float | None:
        """When the first transfer in flight ends, if nothing else joins."""
        if not self.active:
            return None
        return now + max(0.0, min(self.active.values())) * len(self.active)

    def complete(self, now: float) -> list[Any]:
        """Take the transfers done by `now` (in the order they started)."""
        self._advance(now)
        done = [k for k, left in self.active.items() if left <= _DONE_S]
        for k in done:
            del self.active[k]
        if done:
            self.version += 1
        return done


class KvStore:
    """The shared store's blocks by hash, least recently used first."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity = capacity_blocks
        self.blocks: OrderedDict[bytes, None] = OrderedDict()
        self.evicted = 0
        self.puts = 0
        # The last `overlap` asked: (its chain, the answer, `changes` then). A request's chain
        # is asked about by the router and then fetched (`leading`) with nothing stored in
        # between; the second walk of a 10-million-block table is spared.
        self.changes = 0  # puts so far (a touch reorders blocks and changes no answer)
        self._last: tuple[Sequence[bytes] | None, int, int] = (None, 0, -1)

    def overlap(self, hashes: Sequence[bytes]) -> int:
        """Leading blocks of the chain the store holds (untouched: what the router's index of
        the store answers). The chain must not change in place after it is asked about."""
        n = leading_run(hashes, self.blocks.__contains__)
        self._last = (hashes, n, self.changes)
        return n

    def leading(self, hashes: Sequence[bytes]) -> int:
        """Leading blocks of the chain the store holds (touched: recently used)."""
        chain, n, changes = self._last
        if chain is not hashes or changes != self.changes:
            n = self.overlap(hashes)
        for h in hashes[:n]:
            self.blocks.move_to_end(h)
        return n

    def put(self, hashes: Iterable[bytes]) -> tuple[list[bytes], list[bytes]]:
        """Store the blocks; (newly stored, evicted to make room)."""
        if self.capacity <= 0:
            return [], []
        new, gone = [], []
        blocks = self.blocks
        self.changes += 1
        for h in hashes:
            n = len(blocks)
            blocks[h] = None  # a new block goes last; one already held stays where it is
            if len(blocks) == n:
                blocks.move_to_end(h)
                continue
            new.append(h)
            self.puts += 1
        while len(self.blocks) > self.capacity:
            h, _ = self.blocks.popitem(last=False)
            gone.append(h)
            self.evicted += 1
        return new, gone
