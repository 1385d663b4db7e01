"""The router's calls in flight to each worker, and why one was ended by the router.

Owns the registry of worker calls per worker address, and their ending when the router gives
up on that worker (it stopped answering its health polls, or its channel is made anew): each is
cancelled with the reason kept, so the caller tells a call the router ended (re-route it, in
pdserve's words) from one that failed. And the deadline on a call's answer: a watchdog
thread ends a call that got none in time and reports its worker stalled (`on_stall`), since a
worker whose engine is stuck may still answer its health polls. A worker that stops without
dying (a paused VM, a starved core) never answers; without this its calls wait for the
request's deadline. Must not decide what a request does next (`route.after_failure` does), how
long a first answer may take (`pool.WorkerSet.first_answer_s`) or poll.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

log = logging.getLogger(__name__)

# A first answer may take this many times the predicted compute before the router gives up.
FIRST_ANSWER_FACTOR = 4.0


def first_answer_deadline(work_tokens: float, tokens_per_s: float | None, min_s: float
                          ) -> float | None:
    """How long a call may wait for its first answer: FIRST_ANSWER_FACTOR times the predicted
    compute of `work_tokens` prompt tokens at `tokens_per_s`, and at least `min_s`. None: no
    deadline (`min_s` 0 turns it off; work but no measured rate: a slow worker's first long
    prompts are not cut). Pure."""
    if min_s <= 0:
        return None
    if work_tokens <= 0:
        return min_s
    if tokens_per_s is None or not tokens_per_s > 0:
        return None
    return max(min_s, FIRST_ANSWER_FACTOR * work_tokens / tokens_per_s)


class Tracked:
    """One call in flight; `why` says why the router ended it (None: it did not)."""

    __slots__ = ("call", "why")

    def __init__(self, call: Any) -> None:
        self.call, self.why = call, None


class WorkerCalls:
    """Thread-safe; bounded by the calls in flight (each leaves when it ends) and the deadlines
    armed within the longest one (each leaves at its time)."""

    def __init__(self, on_stall: Callable[[str, str, float], None] = lambda a, why, s: None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`on_stall(address, why, seconds)`: a call to `address` got no first answer within
        `seconds` (called on the watchdog thread, after the call was cancelled)."""
        self._lock = threading.Lock()
        self._calls: dict[str, set[Tracked]] = {}
        self.on_stall = on_stall
        self.clock = clock
        self._deadlines: list[tuple[float, int, str, Tracked, float]] = []  # a heap
        self._seq = itertools.count()
        self._wake = threading.Condition(self._lock)
        self._watchdog: threading.Thread | None = None

    @contextlib.contextmanager
    def tracking(self, address: str, call: Any, first_answer_s: float | None = None
                 ) -> Iterator[Tracked]:
        """Within the block, `end(address, ...)` cancels `call` and sets the handle's `why`
        (kept after the block); with `first_answer_s`, so does the watchdog when the call has
        not left the block by then (its answer not come), and it reports the worker stalled."""
        tracked = Tracked(call)
        with self._lock:
            self._calls.setdefault(address, set()).add(tracked)
            if first_answer_s is not None:
                heapq.heappush(self._deadlines, (self.clock() + first_answer_s, next(self._seq),
                                                 address, tracked, first_answer_s))
                if self._watchdog is None:
                    self._watchdog = threading.Thread(target=self._watch, daemon=True,
                                                      name="worker-call-deadlines")
                    self._watchdog.start()
                self._wake.notify()
        try:
            yield tracked
        finally:
            with self._lock:
                calls = self._calls.get(address)
                if calls is not None:
                    calls.discard(tracked)
                    if not calls:
                        del self._calls[address]

    def end(self, address: str, why: str) -> int:
        """Cancel every call in flight to `address`, each told `why`; how many."""
        with self._lock:
            calls = list(self._calls.get(address, ()))
            for tracked in calls:
                tracked.why = why
        for tracked in calls:
            tracked.call.cancel()
        return len(calls)

    def in_flight(self, address: str) -> int:
        with self._lock:
            return len(self._calls.get(address, ()))

    def _watch(self) -> None:
        with self._lock:
            while True:
                if not self._deadlines:
                    self._wake.wait()
                    continue
                at, _, address, tracked, seconds = self._deadlines[0]
                left = at - self.clock()
                if left > 0:
                    self._wake.wait(left)
                    continue
                heapq.heappop(self._deadlines)
                if tracked not in self._calls.get(address, ()):
                    continue
                why = f"did not answer within {seconds:.3g}s"
                tracked.why = why
                self._lock.release()
                try:
                    tracked.call.cancel()
                    self.on_stall(address, why, seconds)
                except Exception:  # the watchdog must outlive any one report
                    log.exception("reporting %s stalled failed", address)
                finally:
                    self._lock.acquire()
