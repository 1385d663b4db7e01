"""A simulated request's token ids, held compactly: runs of equal ids, then a plain list.

Owns `RunTokens`, the list the simulator hands the real scheduler as a prompt and as a
sequence's token ids. A synthesized prompt is a few runs (one id per trace block: thousands of
equal tokens), so storing it as (id, count) runs spares building and copying a list of every
token per request and per worker it visits; tokens appended later (the outputs) go to a plain
list. It reads as the list it stands for: `len`, indexing, slices (plain lists), iteration,
`append`, `extend`, `del` of a slice, equality with a list; and `block_text`, a block as
`core.block_hash` spells it. Must not know what the ids mean.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Iterator


class RunTokens:
    """Token ids: `runs` ((id, count) pairs, in order) followed by appended ids."""

    __slots__ = ("_values", "_ends", "_n", "_tail")

    def __init__(self, runs: Iterable[tuple[int, int]] = ()) -> None:
        self._values: list[int] = []
        self._ends: list[int] = []  # cumulative end of each run
        n = 0
        for value, count in runs:
            if count < 0:
                raise ValueError(f"runs: count {count} < 0 for id {value}")
            if count:
                n += count
                self._values.append(value)
                self._ends.append(n)
        self._n = n
        self._tail: list[int] = []

    @classmethod
    def from_ends(cls, values: list[int], ends: list[int]) -> RunTokens:
        """The runs given as their ids and cumulative ends (increasing, after 0), taken as they
        are (not copied): what `RunTokens(runs)` builds, without a pair per run."""
        out = RunTokens.__new__(RunTokens)  # (mypyc: not cls.__new__)
        out._values, out._ends, out._n = values, ends, ends[-1] if ends else 0
        out._tail = []
        return out

    def copy(self) -> RunTokens:
        out = RunTokens.__new__(RunTokens)
        out._values, out._ends, out._n = self._values, self._ends, self._n  # never mutated
        out._tail = list(self._tail)
        return out

    def __len__(self) -> int:
        return self._n + len(self._tail)

    def __iter__(self) -> Iterator[int]:
        start = 0
        for value, end in zip(self._values, self._ends):
            for _ in range(end - start):
                yield value
            start = end
        yield from self._tail

    def __getitem__(self, key):
        n = self._n
        if isinstance(key, slice):
            start, stop, step = key.indices(len(self))
            if step != 1:
                return list(self)[key]
            out: list[int] = []
            if start < min(stop, n):
                j = bisect_right(self._ends, start)
                pos, hi = start, min(stop, n)
                while pos < hi:
                    end = min(self._ends[j], hi)
                    out += [self._values[j]] * (end - pos)
                    pos = end
                    j += 1
            if stop > n:
                out += self._tail[max(0, start - n):stop - n]
            return out
        i = key + len(self) if key < 0 else key
        if not 0 <= i < len(self):
            raise IndexError("RunTokens index out of range")
        return self._tail[i - n] if i >= n else self._values[bisect_right(self._ends, i)]

    def block_text(self, start: int, stop: int) -> bytes:
        """`b",".join` of the ids in [start, stop) in decimal, as `core.block_hash` spells a
        block, built a run at a time (a run of c ids v is "v," c times) instead of id by id.
        The ids are ints (a simulator's)."""
        n, parts = self._n, []
        if start < min(stop, n):
            j = bisect_right(self._ends, start)
            pos, hi = start, min(stop, n)
            while pos < hi:
                end = min(self._ends[j], hi)
                parts.append(f"{self._values[j]}," * (end - pos))
                pos = end
                j += 1
        if stop > n:
            seg = self._tail[max(0, start - n):stop - n]
            if seg and seg.count(seg[0]) == len(seg):  # outputs: one sampled id repeated
                parts.append(f"{seg[0]}," * len(seg))
            elif seg:
                parts.append(",".join(map(str, seg)) + ",")
        return "".join(parts)[:-1].encode()

    def append(self, token: int) -> None:
        self._tail.append(token)

    def extend(self, tokens: Iterable[int]) -> None:
        self._tail.extend(tokens)

    def __delitem__(self, key) -> None:
        if isinstance(key, slice) and key.step in (None, 1):
            start, stop, _ = key.indices(len(self))
            if start >= self._n:
                del self._tail[start - self._n:stop - self._n]
                return
        tokens = list(self)  # rare (a cut into the runs): hold them as a plain list from now
        del tokens[key]
        self._values, self._ends, self._n, self._tail = [], [], 0, tokens

    def __eq__(self, other) -> bool:
        if isinstance(other, (list, RunTokens)):
            return len(self) == len(other) and list(self) == list(other)
        return NotImplemented

    def __repr__(self) -> str:
        return f"RunTokens({len(self)} tokens)"
