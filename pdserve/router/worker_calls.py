"""The router's calls in flight to each worker, and why one was ended by the router.

Owns the registry of unary worker calls (futures) per worker address, and their ending when the
router gives up on that worker (it stopped answering its health polls, or its channel is made
anew): each is cancelled with the reason kept, so the caller tells a call the router ended
(re-route it, in pdserve's words) from one that failed. A worker that stops without dying (a
paused VM, a starved core) never answers; without this its calls wait for the request's
deadline. Must not decide what a request does next (`route.after_failure` does) or poll.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any


class Tracked:
    """One call in flight; `why` says why the router ended it (None: it did not)."""

    __slots__ = ("call", "why")

    def __init__(self, call: Any) -> None:
        self.call, self.why = call, None


class WorkerCalls:
    """Thread-safe; bounded by the calls in flight (each leaves when it ends)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: dict[str, set[Tracked]] = {}

    @contextlib.contextmanager
    def tracking(self, address: str, call: Any) -> Iterator[Tracked]:
        """Within the block, `end(address, ...)` cancels `call` and sets the handle's `why`
        (kept after the block)."""
        tracked = Tracked(call)
        with self._lock:
            self._calls.setdefault(address, set()).add(tracked)
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
