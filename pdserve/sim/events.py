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
    `now` to it. An event cannot be scheduled in the past."""

    __slots__ = ("_heap", "_seq", "now", "popped")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, str, Any]] = []
        self._seq = 0
        self.now = 0.0
        self.popped = 0

    def push(self, at_s: float, kind: str, payload: Any = None) -> None:
        if at_s < self.now:
            raise ValueError(f"event {kind!r} at {at_s} is before now ({self.now})")
        self._seq += 1
        heapq.heappush(self._heap, (at_s, self._seq, kind, payload))

    def pop(self) -> tuple[float, str, Any]:
        at_s, _, kind, payload = heapq.heappop(self._heap)
        self.now = at_s
        self.popped += 1
        return at_s, kind, payload

    def peek_time(self) -> float | None:
        return self._heap[0][0] if self._heap else None

    def __len__(self) -> int:
        return len(self._heap)
