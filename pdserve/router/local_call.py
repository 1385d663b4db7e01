"""The router's `Generate` called in process, as the HTTP layer's gRPC client would call it.

Owns the seam between the OpenAI HTTP layer (an asyncio loop) and the gRPC servicer method
(a sync generator run on a thread): `LocalGeneration.Generate(request, timeout=, metadata=)`
returns a `LocalCall` that behaves as a `grpc.aio` unary-stream call does for its reader
(`await read()` gives each message, then `grpc.aio.EOF`; `async for`; `cancel()`; errors
raised as `grpc.aio.AioRpcError` with the code, details and trailing metadata the servicer
ended with), and the servicer gets a `LocalContext` with the parts of `grpc.ServicerContext`
it uses: invocation metadata, the deadline, `is_active`, `add_callback`, trailing metadata and
`abort`. So HTTP requests run the same service code as gRPC ones (validation, admission,
routing, retries, the same tokens), without serializing every token into a loopback HTTP/2
stream and parsing it back: at most one wake-up of the event loop per message instead, and
one for all the messages the servicer yielded while the loop was busy; the reader takes what
is already there without waiting (`read_ready`). A servicer may also send a message from
another thread (`LocalContext.emit`: the router's decode relay, run where the worker's tokens
arrive), and the messages for every call of one event loop share its wake-ups.
Semantics kept from gRPC: the callbacks run once when the call ends, however it ends (done,
aborted, cancelled, past its deadline); a cancelled or expired call stops pulling messages;
an exception escaping the servicer ends the call with UNKNOWN; calls beyond the thread pool
wait for a thread, as on a gRPC server's pool.
Must not decide anything about the request: the servicer does.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator

import grpc

log = logging.getLogger(__name__)

Handler = Callable[[Any, "LocalContext"], Iterator[Any]]


class LocalRpcError(grpc.aio.AioRpcError):
    """How a local call ends with a status: what a `grpc.aio` call would raise."""

    def __init__(self, code: grpc.StatusCode, details: str, trailers=()) -> None:
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailers), details)


class _Aborted(Exception):
    """Raised by `LocalContext.abort` to end the servicer's generator (as gRPC's abort does)."""


class LocalContext:
    """The servicer's side of one local call."""

    def __init__(self, metadata, timeout_s: float | None) -> None:
        self._metadata = tuple(metadata or ())
        self._deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], Any]] = []
        self._active = True
        self.trailers: tuple = ()
        self.code: grpc.StatusCode | None = None
        self.details = ""
        # Send a message from any thread, in order with what the servicer yields (set by the
        # call: its stream to the reader).
        self.emit: Callable[[Any], None] = lambda message: None

    # ---- what the servicer calls ----------------------------------------------------------------
    def invocation_metadata(self):
        return self._metadata

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def is_active(self) -> bool:
        return self._active and (self._deadline is None or time.monotonic() < self._deadline)

    def add_callback(self, callback: Callable[[], Any]) -> bool:
        """Run `callback` when the call ends; False (and never run) if it already ended."""
        with self._lock:
            if not self._active:
                return False
            self._callbacks.append(callback)
            return True

    def set_trailing_metadata(self, metadata) -> None:
        self.trailers = tuple(metadata)

    def abort(self, code: grpc.StatusCode, details: str):
        self.code, self.details = code, details
        raise _Aborted(details)

    # ---- the call's end ---------------------------------------------------------------------
    def end(self) -> bool:
        """Mark the call ended and run its callbacks once; False if it had already ended."""
        with self._lock:
            if not self._active:
                return False
            self._active = False
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            try:
                callback()
            except Exception:  # as gRPC: a callback's failure is logged, the others still run
                log.exception("a call's end callback failed")
        return True


class LocalCall:
    """The reader's side of one local call; made and read on the event loop's thread."""

    def __init__(self, pool: "LocalGeneration", handler: Handler, request, timeout_s: float | None,
                 metadata) -> None:
        self._loop = asyncio.get_running_loop()
        self._pool = pool
        # Bounded by the request: one item per message the servicer yields (a token or a few),
        # at most the request's max_tokens plus its first and last messages.
        self._q: asyncio.Queue = asyncio.Queue()
        self._inbox = pool._inbox(self._loop)
        self._ended: BaseException | object | None = None  # what every later read gets
        self.context = LocalContext(metadata, timeout_s)
        self.context.emit = self._emit
        self._timer = (None if timeout_s is None
                       else self._loop.call_later(timeout_s, self._expire))
        pool._started(self)
        pool.executor.submit(self._run, handler, request)

    # ---- the servicer's thread --------------------------------------------------------------
    def _run(self, handler: Handler, request) -> None:
        ctx = self.context
        end: object = grpc.aio.EOF
        gen = None
        try:
            if ctx.is_active():  # cancelled or expired while waiting for a thread: never start
                gen = handler(request, ctx)
                for message in gen:
                    if not ctx.is_active():
                        break  # cancelled or past the deadline: stop pulling, as gRPC does
                    self._put(message)
        except _Aborted:
            end = LocalRpcError(ctx.code or grpc.StatusCode.UNKNOWN, ctx.details, ctx.trailers)
        except Exception as e:
            log.exception("local Generate failed")
            end = LocalRpcError(grpc.StatusCode.UNKNOWN,
                                f"Exception iterating responses: {e}")
        finally:
            if gen is not None:
                gen.close()
            ctx.end()
            self._put(end)
            self._pool._ended(self)

    def _put(self, item) -> None:
        self._inbox.put(self, item)

    def _emit(self, message) -> None:
        """A message the servicer sends from another thread than its own (`LocalContext.emit`),
        in order with those it yields; dropped once the call ended."""
        if self.context.is_active():
            self._inbox.put(self, message)

    # ---- the event loop's thread ------------------------------------------------------------
    def _expire(self) -> None:
        if self.context.end():
            self._finish(LocalRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))

    def _finish(self, end) -> None:
        if self._ended is None:
            self._ended = end
            self._q.put_nowait(end)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    async def read(self):
        if self._ended is not None and self._q.empty():
            return self._raise_or(self._ended)
        item = await self._q.get()
        if isinstance(item, LocalRpcError) or item is grpc.aio.EOF:
            self._finish(item)
            return self._raise_or(self._ended)
        if self._ended is not None:  # cancelled or expired: what is still queued is dropped
            return self._raise_or(self._ended)
        return item

    def read_ready(self):
        """The next message if it is already here, else None (then `read`): a reader that
        fell behind takes what queued up in one pass. Never the call's end."""
        self._inbox.take()
        if self._ended is not None or self._q.empty():
            return None
        item = self._q.get_nowait()
        if isinstance(item, LocalRpcError) or item is grpc.aio.EOF:
            self._finish(item)  # the next `read` gives it
            return None
        return item

    @staticmethod
    def _raise_or(end):
        if isinstance(end, BaseException):
            raise end
        return end

    def __aiter__(self):
        return self._messages()

    async def _messages(self):
        while True:
            message = await self.read()
            if message is grpc.aio.EOF:
                return
            yield message

    def cancel(self) -> bool:
        """End the call for the servicer (its callbacks run: the worker's decode is cancelled);
        False if it had already ended."""
        if not self.context.end():
            return False
        self._finish(LocalRpcError(grpc.StatusCode.CANCELLED, "Locally cancelled by application!"))
        return True


class _Inbox:
    """What the servicers' threads handed to the calls of one event loop since it last took
    them: one wake-up of the loop for all of them, whichever calls they are for."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._items: collections.deque = collections.deque()  # (call, item); bounded by theirs
        self._wake_due = False
        self._closed = False  # the loop closed (the HTTP server stopped): nobody reads

    def put(self, call: LocalCall, item) -> None:
        with self._lock:
            if self._closed:
                return
            self._items.append((call, item))
            if self._wake_due:
                return  # the wake-up already scheduled takes it too
            self._wake_due = True
        try:
            self._loop.call_soon_threadsafe(self.take)
        except RuntimeError:
            with self._lock:
                self._closed = True
                self._items.clear()

    def take(self) -> None:
        """On the loop: each item to its call's queue."""
        with self._lock:
            items, self._items = self._items, collections.deque()
            self._wake_due = False
        for call, item in items:
            call._q.put_nowait(item)


class LocalGeneration:
    """A `GenerationStub` look-alike for `Generate` that runs `handler` on a bounded pool."""

    def __init__(self, handler: Handler, max_workers: int) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self._handler = handler
        self.executor = ThreadPoolExecutor(max_workers=max_workers,
                                           thread_name_prefix="http-generate")
        self._lock = threading.Lock()
        self._live: set[LocalCall] = set()
        self._inboxes: dict[asyncio.AbstractEventLoop, _Inbox] = {}  # one per loop reading calls

    def _inbox(self, loop: asyncio.AbstractEventLoop) -> _Inbox:
        with self._lock:
            inbox = self._inboxes.get(loop)
            if inbox is None:
                for old in [lp for lp in self._inboxes if lp.is_closed()]:
                    del self._inboxes[old]
                inbox = self._inboxes[loop] = _Inbox(loop)
            return inbox

    def Generate(self, request, timeout: float | None = None, metadata=()) -> LocalCall:
        return LocalCall(self, self._handler, request, timeout, metadata)

    def _started(self, call: LocalCall) -> None:
        with self._lock:
            self._live.add(call)

    def _ended(self, call: LocalCall) -> None:
        with self._lock:
            self._live.discard(call)

    def close(self) -> None:
        """End every call still running (their callbacks cancel the worker calls) and let the
        threads go; calls queued for a thread never start."""
        with self._lock:
            live = list(self._live)
        for call in live:
            if call.context.end():
                call._put(LocalRpcError(grpc.StatusCode.UNAVAILABLE, "router shutting down"))
        self.executor.shutdown(wait=False, cancel_futures=True)
