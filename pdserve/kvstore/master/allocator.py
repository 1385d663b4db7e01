"""Space inside one segment: a first-fit free-extent list with coalescing and alignment.

Owns which byte ranges of a segment are free or allocated. Must not know keys, nodes or tiers;
the cluster maps placements onto allocators. Pure: no I/O, no clock.
"""

from __future__ import annotations

import bisect


def align_up(size: int, align: int) -> int:
    return -(-size // align) * align


class ExtentAllocator:
    """Free extents kept sorted by offset; allocation takes the first (lowest) extent that fits.

    Every allocated length is rounded up to `align_bytes`, so every offset is a multiple of it.
    A tail of the segment shorter than `align_bytes` is never handed out.
    """

    def __init__(self, size_bytes: int, align_bytes: int) -> None:
        assert size_bytes > 0 and align_bytes > 0
        self.size_bytes = size_bytes
        self.align_bytes = align_bytes
        # Parallel sorted lists of free extents: starts and lengths (bisect on starts).
        self._starts: list[int] = [0]
        self._lengths: list[int] = [size_bytes]
        self._allocated: dict[int, int] = {}  # offset -> length
        self.used_bytes = 0

    def length_for(self, size: int) -> int:
        return align_up(size, self.align_bytes)

    def alloc(self, size: int) -> int | None:
        """The offset of a fresh extent of `size` (rounded up) bytes, or None if none fits."""
        length = self.length_for(size)
        for i, free_len in enumerate(self._lengths):
            if free_len >= length:
                offset = self._starts[i]
                if free_len == length:
                    del self._starts[i], self._lengths[i]
                else:
                    self._starts[i] += length
                    self._lengths[i] -= length
                self._allocated[offset] = length
                self.used_bytes += length
                return offset
        return None

    def reserve(self, offset: int, size: int) -> bool:
        """Allocates exactly [offset, offset + length); False if any of it is not free.

        Used to rebuild allocations from committed placements on restore.
        """
        length = self.length_for(size)
        if offset % self.align_bytes or offset < 0:
            return False
        i = bisect.bisect_right(self._starts, offset) - 1
        if i < 0:
            return False
        start, free_len = self._starts[i], self._lengths[i]
        if offset + length > start + free_len:
            return False
        # Split the free extent into the part before and the part after the reservation.
        before, after = offset - start, start + free_len - (offset + length)
        del self._starts[i], self._lengths[i]
        if after:
            self._starts.insert(i, offset + length)
            self._lengths.insert(i, after)
        if before:
            self._starts.insert(i, start)
            self._lengths.insert(i, before)
        self._allocated[offset] = length
        self.used_bytes += length
        return True

    def is_allocated(self, offset: int) -> bool:
        return offset in self._allocated

    def free(self, offset: int) -> None:
        """Returns the extent at `offset` and merges it with free neighbours."""
        length = self._allocated.pop(offset)
        self.used_bytes -= length
        i = bisect.bisect_left(self._starts, offset)
        merge_prev = i > 0 and self._starts[i - 1] + self._lengths[i - 1] == offset
        merge_next = i < len(self._starts) and offset + length == self._starts[i]
        if merge_prev and merge_next:
            self._lengths[i - 1] += length + self._lengths[i]
            del self._starts[i], self._lengths[i]
        elif merge_prev:
            self._lengths[i - 1] += length
        elif merge_next:
            self._starts[i] = offset
            self._lengths[i] += length
        else:
            self._starts.insert(i, offset)
            self._lengths.insert(i, length)

    def free_extents(self) -> list[tuple[int, int]]:
        return list(zip(self._starts, self._lengths))

    def allocated_extents(self) -> list[tuple[int, int]]:
        return sorted(self._allocated.items())

    def largest_free(self) -> int:
        return max(self._lengths, default=0)

    def check(self) -> None:
        """Asserts the internal invariants: free and allocated extents tile the segment exactly,
        free extents are coalesced, and used_bytes is the sum of allocated lengths."""
        pieces = sorted([(s, n, "free") for s, n in self.free_extents()]
                        + [(s, n, "used") for s, n in self.allocated_extents()])
        pos = 0
        for i, (start, length, kind) in enumerate(pieces):
            assert start == pos, f"gap or overlap at {pos}: next extent starts at {start}"
            assert length > 0
            if kind == "free" and i > 0:
                assert pieces[i - 1][2] != "free", f"uncoalesced free extents at {start}"
            pos = start + length
        assert pos == self.size_bytes, f"extents end at {pos}, segment is {self.size_bytes}"
        assert self.used_bytes == sum(n for _, n in self.allocated_extents())
