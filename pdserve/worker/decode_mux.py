"""DecodeMany, the worker's side: many decode requests over one stream.

Owns one stream's requests and its outbox. Each request started on the stream runs exactly as a
Decode call does (admission, then the decode role's chunks) on a thread of its own, which puts
its chunks, or its error as a status, in the stream's one outbox; the sender sends everything
queued there as one message. So the tokens one engine step made for a whole batch cross the hop
in one message, and a request's thread hands its tokens over without waiting for the network
(the engine loop's hand-off to its readers ends as soon as each has queued its chunk).
Cancelling one request ends only it, as a client leaving a Decode stream does; the caller
closing its side ends the stream once every request ended; the caller leaving ends them all.
Must not touch the engine (the decode role does, on the engine thread) or block a request's
thread on the network.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable, Iterator

import grpc

from pdserve.proto import worker_pb2 as pb

log = logging.getLogger(__name__)

# Requests running at once on one stream; past it a start is refused (RESOURCE_EXHAUSTED). The
# engine's own queue bound refuses sooner; this bounds the threads if it were set higher.
MAX_REQUESTS_PER_STREAM = 1024
_POLL_S = 0.5  # how often an idle sender looks whether its caller left
_HANDOFF_WAIT_S = 0.01  # the longest a chunk waits for the rest of its step's chunks
_WAKE = object()  # queued when a request or the reader ended, so the sender looks again


class _RequestContext:
    """`is_active` for one request of the stream: its caller is there and did not cancel it."""

    def __init__(self, stream_context, cancelled: threading.Event) -> None:
        self._stream = stream_context
        self._cancelled = cancelled

    def is_active(self) -> bool:
        return not self._cancelled.is_set() and self._stream.is_active()


def serve(request_iterator, context, run_request: Callable, status_of: Callable,
          handed_off: Callable[[float], None] = lambda timeout: None,
          ) -> Iterator[pb.DecodeManyResponse]:
    """The DecodeMany handler. `run_request(request, ctx)` is the Decode call's body (admission
    and chunks, as DecodeResponse messages); `status_of(error)` maps its errors to statuses;
    `handed_off(timeout)` returns once the engine step being handed to its readers has been
    (`EngineLoop.wait_handed_off`), so one message carries that step's chunks for every request
    of the stream."""
    outbox: queue.Queue = queue.Queue()
    running: dict[str, threading.Event] = {}  # by request id, until its thread is done with it
    live = [0]  # request threads not yet ended; the sender ends only once none is left
    lock = threading.Lock()
    reading = threading.Event()
    reading.set()

    def run_one(request, cancelled: threading.Event) -> None:
        rid = request.request_id
        last = None  # the request's end, sent after its id is free again
        chunks = run_request(request, _RequestContext(context, cancelled))
        try:
            for chunk in chunks:
                if cancelled.is_set() or not context.is_active():
                    break  # closing the chunks aborts it in the engine, as a Decode caller leaving
                event = pb.DecodeEvent(request_id=rid, chunk=chunk)
                if chunk.finish_reason:
                    last = event  # its chunks end here by themselves
                else:
                    outbox.put(event)
            else:
                if last is None and not cancelled.is_set():
                    # Its chunks stopped without a finish reason: say so, as a Decode stream's end.
                    last = pb.DecodeEvent(request_id=rid)
        except Exception as e:
            code, details = status_of(e)
            last = pb.DecodeEvent(request_id=rid, status_code=code.value[0],
                                  status_details=details)
        finally:
            chunks.close()
            with lock:
                # The id is free before its end is sent: the caller may start it again at once
                # (a retry on this worker) without being told it is still running.
                running.pop(rid, None)
            if last is not None:
                outbox.put(last)
            with lock:  # after its last event: the sender ends only with the outbox empty
                live[0] -= 1
            outbox.put(_WAKE)

    def start(request) -> None:
        rid = request.request_id
        refusal = None
        with lock:
            if not rid:
                refusal = (grpc.StatusCode.INVALID_ARGUMENT, "start.request_id: must be set")
            elif rid in running:
                refusal = (grpc.StatusCode.INVALID_ARGUMENT,
                           f"start.request_id: {rid!r} is already running on this stream")
            elif len(running) >= MAX_REQUESTS_PER_STREAM:
                refusal = (grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"{MAX_REQUESTS_PER_STREAM} requests already run on this stream; "
                           f"retry after 1s")
            else:
                cancelled = threading.Event()
                running[rid] = cancelled
                live[0] += 1
        if refusal is not None:
            outbox.put(pb.DecodeEvent(request_id=rid, status_code=refusal[0].value[0],
                                      status_details=refusal[1]))
            return
        threading.Thread(target=run_one, args=(request, cancelled), daemon=True,
                         name=f"decode-{rid[:24]}").start()

    def read() -> None:
        try:
            for message in request_iterator:
                op = message.WhichOneof("op")
                if op == "start":
                    start(message.start)
                elif op == "cancel_request_id":
                    with lock:
                        cancelled = running.get(message.cancel_request_id)
                    if cancelled is not None:
                        cancelled.set()
        except Exception as e:  # the caller left, or its stream broke: its requests end below
            log.debug("DecodeMany reader ended: %r", e)
        finally:
            reading.clear()
            outbox.put(_WAKE)

    threading.Thread(target=read, daemon=True, name="decode-many-reader").start()
    while True:
        try:
            item = outbox.get(timeout=_POLL_S)
        except queue.Empty:
            item = _WAKE
        events = [] if item is _WAKE else [item]
        if events:
            handed_off(_HANDOFF_WAIT_S)
        while True:
            try:
                item = outbox.get_nowait()
            except queue.Empty:
                break
            if item is not _WAKE:
                events.append(item)
        if events:
            yield pb.DecodeManyResponse(events=events)
        if not context.is_active():
            with lock:
                for cancelled in running.values():
                    cancelled.set()
            return
        if not reading.is_set():
            with lock:
                idle = live[0] == 0
            if idle and outbox.empty():
                return
