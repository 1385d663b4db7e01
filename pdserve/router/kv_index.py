"""Where KV blocks live, as the router knows it: a bounded map source -> cached block hashes.

A source is a worker's own prefix cache (named by the worker's address, fed by its
`WatchKvEvents` stream) or the shared store (`store_source(model_id)`, fed by the master's
`WatchEvents`). Hashes are the chained block hashes of `pdserve.core.block_hash`, so the
overlap of a prompt with a source is the number of leading hashes the source holds.

Owns the map and its bounds. Pure: events in, overlaps out; no I/O, no clock, no threads (the
feeds that apply events hold a lock around it). Must not talk to workers or the store.

Bounded (invariant 5): at most `max_blocks_per_source` hashes per source and `max_sources`
sources. Past the first bound the least recently stored hash is forgotten (`dropped` counts
them); events for a source past the second are ignored (`refused`). Forgetting only shortens
later overlaps, and an index that is stale in the other direction (a removal not seen yet) only
sends a request where its prefix no longer is: the worker then computes it. Either way routing
gets less good, never wrong.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

STORED = "stored"
REMOVED = "removed"
CLEARED = "cleared"  # the source's entries are unknown from here on (resync, reconnect)


def store_source(model_id: str) -> str:
    """The index source of the shared store's blocks of one model."""
    return f"store:{model_id}"


@dataclass(frozen=True)
class KvEvent:
    source: str
    kind: str  # STORED, REMOVED or CLEARED
    hashes: tuple[bytes, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in (STORED, REMOVED, CLEARED):
            raise ValueError(f"kind must be {STORED!r}, {REMOVED!r} or {CLEARED!r}, "
                             f"got {self.kind!r}")


class KvIndex:
    def __init__(self, max_blocks_per_source: int = 200_000, max_sources: int = 256,
                 by_hash: bool = False, scanned: Iterable[str] = ()) -> None:
        if max_blocks_per_source < 1 or max_sources < 1:
            raise ValueError("max_blocks_per_source and max_sources must be >= 1")
        self.max_blocks_per_source = max_blocks_per_source
        self.max_sources = max_sources
        self._blocks: dict[str, OrderedDict[bytes, None]] = {}
        # With `by_hash`, the same pairs by hash: which sources hold a block, so `holders` walks
        # only those instead of every source (worth its upkeep per block change with many
        # sources). One holder is kept as its name, a set only for a shared block.
        # `scanned` sources stay out of that map: `holders` asks each of them with one pass over
        # the hashes (for a large source that takes most new blocks, such as the store, one
        # pass per question costs less than the map's upkeep per block).
        self.by_hash = by_hash
        self._where: dict[bytes, str | set[str]] = {}
        self._scanned = frozenset(scanned)
        self.applied = 0
        self.dropped = 0
        self.refused = 0

    def apply(self, event: KvEvent) -> None:
        blocks = self._blocks.get(event.source)
        if blocks is None:
            if event.kind != STORED:
                return  # nothing known to remove or clear
            if len(self._blocks) >= self.max_sources:
                self.refused += 1
                return
            blocks = self._blocks[event.source] = OrderedDict()
        self.applied += 1
        source = event.source
        if event.kind == CLEARED:
            for h in blocks:
                self._forget(h, source)
            blocks.clear()
        elif event.kind == REMOVED:
            for h in event.hashes:
                if blocks.pop(h, 0) is None:
                    self._forget(h, source)
        else:
            for h in event.hashes:
                self._store(blocks, source, h)
            while len(blocks) > self.max_blocks_per_source:
                self._forget(blocks.popitem(last=False)[0], source)
                self.dropped += 1

    def apply_changes(self, source: str, changes: Iterable[tuple[str, bytes]]) -> None:
        """One source's block changes in order, [(STORED | REMOVED, hash)]: the same as
        applying `KvEvent(source, kind, (hash,))` for each, without an event per block (a
        worker's log interleaves the two kinds block by block as it evicts and stores)."""
        blocks = self._blocks.get(source)
        cap = self.max_blocks_per_source
        for kind, h in changes:
            if blocks is None:
                if kind != STORED:
                    continue
                if len(self._blocks) >= self.max_sources:
                    self.refused += 1
                    continue
                blocks = self._blocks[source] = OrderedDict()
            self.applied += 1
            if kind == REMOVED:
                if blocks.pop(h, 0) is None:
                    self._forget(h, source)
            elif kind == STORED:
                if self._store(blocks, source, h) and len(blocks) > cap:
                    self._forget(blocks.popitem(last=False)[0], source)
                    self.dropped += 1
            else:
                raise ValueError(f"kind must be {STORED!r} or {REMOVED!r}, got {kind!r}")

    def _store(self, blocks: OrderedDict, source: str, h: bytes) -> bool:
        """Mark `h` stored (most recently) by `source`; whether it is new there."""
        n = len(blocks)
        blocks[h] = None  # a new hash goes last; one already held stays where it is
        if len(blocks) == n:
            blocks.move_to_end(h)
            return False
        if not self.by_hash or source in self._scanned:
            return True
        where = self._where
        holding = where.setdefault(h, source)  # one lookup for a block new to the map
        if holding is source:
            return True
        if isinstance(holding, str):
            where[h] = {holding, source}
        else:
            holding.add(source)
        return True

    def _forget(self, h: bytes, source: str) -> None:
        if not self.by_hash or source in self._scanned:
            return
        where = self._where
        holding = where.pop(h)  # one lookup for a block held by one source (the most)
        if isinstance(holding, str):
            return
        holding.discard(source)
        where[h] = next(iter(holding)) if len(holding) == 1 else holding

    def apply_all(self, events: Iterable[KvEvent]) -> None:
        for e in events:
            self.apply(e)

    def overlap(self, source: str, hashes: Sequence[bytes]) -> int:
        """Leading entries of the chained `hashes` that `source` holds."""
        blocks = self._blocks.get(source)
        if not blocks:
            return 0
        n = 0
        for h in hashes:
            if h not in blocks:
                break
            n += 1
        return n

    def overlaps(self, sources: Sequence[str], hashes: Sequence[bytes]) -> list[int]:
        return [self.overlap(s, hashes) for s in sources]

    def holders(self, hashes: Iterable[bytes]) -> dict[str, int]:
        """{source: overlap} for every source whose overlap with the chained `hashes` is at
        least one (the others' is zero): the work is the holders of each leading block, not
        the number of sources (with `by_hash`; else a pass over the sources)."""
        chain: Sequence[bytes] = hashes if isinstance(hashes, Sequence) else list(hashes)
        if not self.by_hash:
            return {s: n for s in self._blocks if (n := self.overlap(s, chain))}
        out: dict[str, int] = {}
        live: set[str] | None = None
        n = 0
        for h in chain:
            found = self._where.get(h)
            if found is None:
                break
            holding = {found} if isinstance(found, str) else found
            nxt = set(holding) if live is None else live & holding
            if live is not None:
                for s in live - nxt:
                    out[s] = n
            live = nxt
            n += 1
            if not live:
                break
        for s in live or ():
            out[s] = n
        for s in self._scanned:
            if n := self.overlap(s, chain):
                out[s] = n
        return out

    def size(self, source: str) -> int:
        return len(self._blocks.get(source, ()))

    def holds(self, source: str, block_hash: bytes) -> bool:
        return block_hash in self._blocks.get(source, ())

    @property
    def sources(self) -> list[str]:
        return list(self._blocks)
