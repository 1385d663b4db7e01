"""The store's pure core: objects in memory, bounded by a byte capacity, evicted LRU.

Owns the key -> (bytes, meta) map, capacity accounting, least-recently-used eviction, checksum
verification on put, and the counters. Must not do I/O, read clocks or take locks: the service
serializes calls into it. Keys are opaque strings here; only clients give them structure.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from dataclasses import dataclass

from pdserve.kvstore.errors import StoreError


class StoreFullError(StoreError):
    """An object is larger than the store's whole capacity, so no eviction can make room."""


class ChecksumMismatch(StoreError):
    """Object data does not match its CRC-32: it was corrupted on the way."""


@dataclass(frozen=True)
class ObjectMeta:
    """What an object's bytes are; the store keeps it and never interprets dtype or shape."""

    dtype: str = "uint8"
    shape: tuple[int, ...] = ()
    # zlib.crc32 of the data.
    checksum: int = 0


@dataclass(frozen=True)
class StoredObject:
    data: bytes
    meta: ObjectMeta


@dataclass(frozen=True)
class StoreStats:
    object_count: int
    used_bytes: int
    capacity_bytes: int
    puts: int
    gets: int
    hits: int
    misses: int
    evictions: int


class MemoryStore:
    """Objects by key, at most `capacity_bytes` of data, least recently used evicted first.

    Recency: a put or a get (hit) makes an object the most recently used; `exists` does not,
    because a router probing for cached prefixes should not keep blocks alive by looking.
    """

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        # Insertion order is recency order: first = least recently used.
        self._objects: OrderedDict[str, StoredObject] = OrderedDict()
        self._used_bytes = 0
        self._puts = self._gets = self._hits = self._misses = self._evictions = 0

    def put(self, key: str, data: bytes, meta: ObjectMeta) -> int:
        """Stores `data` under `key`, replacing any old object; returns how many were evicted.

        All or nothing: on ChecksumMismatch or StoreFullError the store is unchanged.
        """
        actual = zlib.crc32(data)
        if actual != meta.checksum:
            raise ChecksumMismatch(
                f"key {key!r}: crc32 of data is {actual:#010x}, "
                f"meta.checksum says {meta.checksum:#010x}"
            )
        size = len(data)
        if size > self.capacity_bytes:
            raise StoreFullError(
                f"key {key!r}: object of {size} bytes exceeds the store capacity of "
                f"{self.capacity_bytes} bytes"
            )
        # Replacing is not an eviction: drop the old version before making room.
        self._drop(key)
        evicted = 0
        while self._used_bytes + size > self.capacity_bytes:
            _, victim = self._objects.popitem(last=False)
            self._used_bytes -= len(victim.data)
            evicted += 1
        self._objects[key] = StoredObject(data, meta)
        self._used_bytes += size
        self._puts += 1
        self._evictions += evicted
        return evicted

    def get(self, key: str) -> StoredObject | None:
        """The object under `key` (now the most recently used), or None."""
        self._gets += 1
        obj = self._objects.get(key)
        if obj is None:
            self._misses += 1
            return None
        self._hits += 1
        self._objects.move_to_end(key)
        return obj

    def exists(self, keys: list[str]) -> list[bool]:
        """Presence of each key, in order; does not change recency or counters."""
        return [key in self._objects for key in keys]

    def remove(self, key: str) -> bool:
        """Deletes `key`; returns whether it existed."""
        return self._drop(key)

    def lru_keys(self) -> list[str]:
        """Keys from least to most recently used (the order eviction takes them)."""
        return list(self._objects)

    def stats(self) -> StoreStats:
        return StoreStats(
            object_count=len(self._objects),
            used_bytes=self._used_bytes,
            capacity_bytes=self.capacity_bytes,
            puts=self._puts,
            gets=self._gets,
            hits=self._hits,
            misses=self._misses,
            evictions=self._evictions,
        )

    def _drop(self, key: str) -> bool:
        obj = self._objects.pop(key, None)
        if obj is None:
            return False
        self._used_bytes -= len(obj.data)
        return True
