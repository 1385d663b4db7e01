"""A gRPC server's bound on calls in progress, answered as the project's refusals are.

Owns `BoundedPool`, the handler pool `rpc.make_server` gives a bounded server, and
`refuse_if_busy`, which every handler registered through `rpc.add_servicer` runs first: a call
past the bound is answered RESOURCE_EXHAUSTED with a `retry-after` trailer and a message saying
so, where gRPC's own `maximum_concurrent_rpcs` answers the same code with no hint. Health and
reflection, registered directly, are answered even then. Must not know services or admission.
"""

from __future__ import annotations

import threading
from concurrent import futures
from typing import Callable

import grpc

BUSY_RETRY_AFTER_S = 1  # the hint of a call refused past a server's bound
_BUSY = threading.local()  # on the threads that answer calls past a server's bound: its bound


class BoundedPool(futures.Executor):
    """A server's handler pool with a bound on calls in progress (queued for a thread or
    running): `max_workers` threads, and past `bound` calls submitted and not finished, a call
    runs on one of `_BUSY_THREADS` threads where `refuse_if_busy` answers it
    RESOURCE_EXHAUSTED with a `retry-after` trailer at once."""

    _BUSY_THREADS = 2

    def __init__(self, max_workers: int, bound: int, on_busy: Callable[[], None]) -> None:
        def mark() -> None:
            _BUSY.bound, _BUSY.on_busy = bound, on_busy
        self._pool = futures.ThreadPoolExecutor(max_workers=max_workers)
        self._busy = futures.ThreadPoolExecutor(max_workers=self._BUSY_THREADS,
                                                thread_name_prefix="rpc-busy", initializer=mark)
        self._bound = bound
        self._lock = threading.Lock()
        self._in_progress = 0

    def submit(self, fn, /, *args, **kwargs) -> futures.Future:
        with self._lock:
            over = self._in_progress >= self._bound
            self._in_progress += not over
        if over:
            return self._busy.submit(fn, *args, **kwargs)
        future = self._pool.submit(fn, *args, **kwargs)
        future.add_done_callback(self._finished)
        return future

    def _finished(self, _future: futures.Future) -> None:
        with self._lock:
            self._in_progress -= 1

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._pool.shutdown(wait, cancel_futures=cancel_futures)
        self._busy.shutdown(wait, cancel_futures=cancel_futures)


def refuse_if_busy(method: str, context: grpc.ServicerContext) -> None:
    """On a thread answering past a server's bound: RESOURCE_EXHAUSTED with a retry hint."""
    bound = getattr(_BUSY, "bound", None)
    if bound is None:
        return
    _BUSY.on_busy()
    context.set_trailing_metadata((("retry-after", f"{BUSY_RETRY_AFTER_S}"),))
    context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                  f"{method}: the server holds {bound} calls at once; retry after "
                  f"{BUSY_RETRY_AFTER_S}s")
