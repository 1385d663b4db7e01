"""The simulator's virtual clock: a heap of timed events.

Owns event order: by time, ties broken by the order of scheduling (a sequence number), so a run
with the same inputs pops the same events in the same order. Must not read the wall clock or
draw random numbers: time only moves when an event is popped.
"""

from __future__ import annotations

import heapq
from typing import Any


class EventQueue:
    """`push(at_s, kind, payload)`; `pop()` returns the earliest (at_s, kind, payload) and moves
    `now` to it. An event cannot be scheduled in the past.

    The heap holds each pending time once, as a float (a float compares in one call, a tuple
    of time and sequence number in two or three); the events of one time wait in a list in
    the order they were pushed. The same order as a heap of (time, sequence number)."""

    __slots__ = ("_heap", "_at", "_n", "now", "popped")

    def __init__(self) -> None:
        self._heap: list[float] = []
        self._at: dict[float, list[tuple[str, Any]]] = {}  # time -> its events, in push order
        self._n = 0
        self.now = 0.0
        self.popped = 0

    def push(self, at_s: float, kind: str, payload: Any = None) -> None:
        if not at_s >= self.now:  # NaN too
            raise ValueError(f"event {kind!r} at {at_s} is before now ({self.now})")
        at_s = float(at_s)
        same = self._at.get(at_s)
        if same is None:
            self._at[at_s] = [(kind, payload)]
            heapq.heappush(self._heap, at_s)
        else:
            same.append((kind, payload))
        self._n += 1

    def pop(self) -> tuple[float, str, Any]:
        at_s = self._heap[0]
        same = self._at[at_s]
        kind, payload = same.pop(0)
        if not same:
            heapq.heappop(self._heap)
            del self._at[at_s]
        self._n -= 1
        self.now = at_s
        self.popped += 1
        return at_s, kind, payload

    def peek_time(self) -> float | None:
        return self._heap[0] if self._heap else None

    def __len__(self) -> int:
        return self._n
