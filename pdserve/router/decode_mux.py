"""The router's decode streams: one DecodeMany stream per decode worker, shared by its requests.

Owns, per worker, the stream (opened on the first request, replaced once it broke or the
worker's stub changed), its sender queue and its reader thread, which hands each event of a
message to the request it names. A request sees a `MuxCall`, which behaves as the gRPC response
stream of a Decode call does for the router's relay: iterating it gives DecodeResponse chunks
and ends after the one with a finish reason (or the one saying the request moved); a request's
error status, the stream breaking
(every request on it gets UNAVAILABLE, naming the stream's own status), its deadline passing
(DEADLINE_EXCEEDED, and the request is cancelled on the worker) or a `cancel()` (CANCELLED)
raise a `grpc.RpcError` with the status Decode would have ended with. So one engine step's
tokens for every request on a worker cross the hop in one message, and the relay, retry and
resume logic is Decode's. A relay that fell behind gets the chunks queued for it as one.
Or the relay runs where the chunks arrive (`MuxCall.relay`): the reader thread hands each chunk
to the request's own function, with no queue and no thread switch per chunk, and the request's
thread waits only for the end.
Must not decide retries or routing: the service does, on the statuses this raises.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from typing import Callable

import grpc

from pdserve.proto import worker_pb2 as wpb

log = logging.getLogger(__name__)

_CODES = {c.value[0]: c for c in grpc.StatusCode}
_CANCEL = object()  # queued to a call cancelled locally, so a reader blocked on it wakes


class MuxError(grpc.RpcError):
    """A request's end with a status, as a gRPC call's error gives it."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code = code
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self):
        return ()


def _broken(address: str, e: BaseException) -> MuxError:
    """What every request on a stream that broke gets: UNAVAILABLE (the connection to the worker
    is gone, whatever status gRPC gave the stream: UNKNOWN, INTERNAL, a reset), naming why."""
    if isinstance(e, grpc.RpcError) and hasattr(e, "code"):
        why = f"{e.code().name} {e.details() or ''}".strip()
    else:
        why = f"{type(e).__name__}: {e}"
    return MuxError(grpc.StatusCode.UNAVAILABLE, f"decode stream to {address} broke: {why}")


class MuxCall:
    """One request on a shared stream, iterated as a Decode response stream."""

    def __init__(self, mux: "_Mux", request_id: str, timeout: float | None) -> None:
        self._mux = mux
        self.request_id = request_id
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._q: queue.Queue = queue.Queue()  # bounded by the request: max_tokens chunks at most
        self._ended = False
        self._cancelled = False
        self._held = None  # an item taken while joining chunks, returned next
        # While relayed where the chunks arrive: the function each item goes to, the lock that
        # keeps them in order (re-entered by a cancel from within it), and how the relay ended.
        self._sink: Callable | None = None
        self._sink_lock = threading.RLock()
        self._over = threading.Event()
        self._outcome: bool | BaseException | None = None

    def __iter__(self) -> "MuxCall":
        return self

    def __next__(self) -> wpb.DecodeResponse:
        if self._ended:
            raise StopIteration
        if self._cancelled:
            raise MuxError(grpc.StatusCode.CANCELLED, "Locally cancelled by application!")
        item, self._held = self._held, None
        if item is None:
            timeout = (None if self._deadline is None
                       else max(0.0, self._deadline - time.monotonic()))
            try:
                item = self._q.get(timeout=timeout)
            except queue.Empty:
                self.cancel()
                raise MuxError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        if item is _CANCEL:
            raise MuxError(grpc.StatusCode.CANCELLED, "Locally cancelled by application!")
        if isinstance(item, MuxError):
            self._ended = True
            raise item
        if item.status_code:
            self._ended = True
            raise MuxError(_CODES.get(item.status_code, grpc.StatusCode.UNKNOWN),
                           item.status_details)
        if not item.HasField("chunk"):  # the worker's chunks stopped without a finish reason
            self._ended = True
            raise StopIteration
        if item.chunk.finish_reason or item.chunk.moved:
            self._ended = True
            return item.chunk
        return self._join_queued(item.chunk)

    def _join_queued(self, chunk: wpb.DecodeResponse) -> wpb.DecodeResponse:
        """Chunks already queued behind `chunk` join it, up to the first that is not a plain
        chunk (kept for the next call): a relay that fell behind under load sends one message
        for the steps it missed, not one per step."""
        merged = None
        while True:
            try:
                item = self._q.get_nowait()
            except queue.Empty:
                break
            if item is _CANCEL or isinstance(item, MuxError) or item.status_code \
                    or not item.HasField("chunk") or item.chunk.moved:
                self._held = item
                break
            if merged is None:
                merged = wpb.DecodeResponse()
                merged.CopyFrom(chunk)
            c = item.chunk
            merged.token_ids.extend(c.token_ids)
            merged.logprobs.extend(c.logprobs)
            merged.prompt_logprobs.extend(c.prompt_logprobs)
            if c.finish_reason:
                merged.finish_reason = c.finish_reason
                self._ended = True
                break
        return chunk if merged is None else merged

    def relay(self, on_chunk: Callable[[wpb.DecodeResponse], bool]) -> bool:
        """Relay the call where its chunks arrive instead of iterating it: each chunk (those
        already queued first, on this thread) goes to `on_chunk` on the stream's reader thread;
        True from it means the relay is done (a finish reason, or a stop string: then the worker
        is told to stop). Returns, once the call ended, True if `on_chunk` finished it and False
        if the worker's chunks stopped without a finish reason; raises what iterating would
        (the request's status, the stream broken, the deadline, a cancel), or what `on_chunk`
        raised (the call is then cancelled)."""
        with self._sink_lock:
            with self._mux.lock:
                backlog = [] if self._held is None else [self._held]
                self._held = None
                while True:
                    try:
                        backlog.append(self._q.get_nowait())
                    except queue.Empty:
                        break
                self._sink = functools.partial(self._deliver, on_chunk)
            for item in backlog:
                self._deliver(on_chunk, item)
        timeout = None if self._deadline is None else max(0.0, self._deadline - time.monotonic())
        if not self._over.wait(timeout):
            with self._sink_lock:
                expired = not self._over.is_set()
                self._end(MuxError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))
            if expired:
                self._stop_on_worker()
        outcome = self._outcome
        if isinstance(outcome, BaseException):
            raise outcome
        return bool(outcome)

    def _deliver(self, on_chunk: Callable[[wpb.DecodeResponse], bool], item) -> None:
        """One item of a relayed call, on the thread that has it (under `_sink_lock`)."""
        if self._over.is_set():
            return
        if item is _CANCEL:
            self._end(MuxError(grpc.StatusCode.CANCELLED, "Locally cancelled by application!"))
        elif isinstance(item, MuxError):
            self._end(item)
        elif item.status_code:
            self._end(MuxError(_CODES.get(item.status_code, grpc.StatusCode.UNKNOWN),
                               item.status_details))
        elif not item.HasField("chunk"):
            self._end(False)
        else:
            try:
                done = on_chunk(item.chunk)
            except Exception as e:
                self._end(e)
                self._stop_on_worker()
                return
            if done:
                self._end(True)
                if not (item.chunk.finish_reason or item.chunk.moved):  # a stop string
                    self._stop_on_worker()

    def _end(self, outcome: bool | BaseException) -> None:
        if not self._over.is_set():
            self._outcome = outcome
            self._ended = True
            self._over.set()

    def _stop_on_worker(self) -> None:
        """A relay that ended before the worker's last chunk: the worker stops decoding for
        nobody (the call already has its outcome)."""
        self._cancelled = True
        self._mux.cancel(self.request_id)

    def cancel(self) -> bool:
        """Cancel it on the worker (as a client leaving a Decode stream); False if it ended."""
        if self._ended or self._cancelled:
            return False
        self._cancelled = True
        self._mux.cancel(self.request_id)
        self._push(_CANCEL)
        return True

    def _push(self, item) -> None:
        with self._mux.lock:
            sink = self._sink
            if sink is None:
                self._q.put(item)
                return
        with self._sink_lock:
            sink(item)


class _Mux:
    """One worker's DecodeMany stream."""

    def __init__(self, stub, address: str, on_broken) -> None:
        self.stub = stub
        self.address = address
        self._on_broken = on_broken
        self.lock = threading.Lock()
        self._calls: dict[str, MuxCall] = {}
        self._up: queue.Queue = queue.Queue()  # messages to the worker; None ends the stream
        self.broken: MuxError | None = None
        self._stream = stub.DecodeMany(self._upstream())
        threading.Thread(target=self._read, daemon=True, name=f"decode-mux-{address}").start()

    def _upstream(self):
        while True:
            message = self._up.get()
            if message is None:
                return
            yield message

    def start(self, request: wpb.DecodeRequest, timeout: float | None) -> MuxCall:
        call = MuxCall(self, request.request_id, timeout)
        with self.lock:
            broken = self.broken
            if broken is None:
                old = self._calls.get(request.request_id)
                self._calls[request.request_id] = call
        if broken is not None:
            call._push(broken)
            return call
        if old is not None:  # a call the router left without cancelling: it gets nothing more
            old._push(MuxError(grpc.StatusCode.CANCELLED, "replaced by a new call"))
        self._up.put(wpb.DecodeManyRequest(start=request))
        return call

    def cancel(self, request_id: str) -> None:
        with self.lock:
            known = self._calls.pop(request_id, None) is not None and self.broken is None
        if known:
            self._up.put(wpb.DecodeManyRequest(cancel_request_id=request_id))

    def _read(self) -> None:
        try:
            for message in self._stream:
                for event in message.events:
                    last = (event.status_code != 0 or not event.HasField("chunk")
                            or event.chunk.finish_reason != 0 or event.chunk.moved)
                    with self.lock:
                        call = (self._calls.pop(event.request_id, None) if last
                                else self._calls.get(event.request_id))
                    if call is not None:
                        call._push(event)
            error = MuxError(grpc.StatusCode.UNAVAILABLE,
                             f"decode stream to {self.address} ended without a finish reason")
        except Exception as e:  # the worker died, its channel closed, or the stream broke
            error = _broken(self.address, e)
        with self.lock:
            self.broken = error
            calls = list(self._calls.values())
            self._calls.clear()
        if calls:
            log.warning("%s: %d request(s) end with it", error.details(), len(calls))
        for call in calls:
            call._push(error)
        self._on_broken(self)

    def close(self) -> None:
        self._up.put(None)
        self._stream.cancel()


class DecodeMuxes:
    """The shared decode stream of each decode worker, opened on first use."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._muxes: dict[str, _Mux] = {}

    def start(self, address: str, stub, request: wpb.DecodeRequest,
              timeout: float | None) -> MuxCall:
        with self._lock:
            mux = self._muxes.get(address)
            if mux is None or mux.stub is not stub or mux.broken is not None:
                stale = mux
                mux = self._muxes[address] = _Mux(stub, address, self._drop)
            else:
                stale = None
        if stale is not None:
            stale.close()
        return mux.start(request, timeout)

    def _drop(self, mux: _Mux) -> None:
        with self._lock:
            if self._muxes.get(mux.address) is mux:
                del self._muxes[mux.address]

    def close(self) -> None:
        with self._lock:
            muxes = list(self._muxes.values())
            self._muxes.clear()
        for mux in muxes:
            mux.close()
