"""The engine's one thread: runs commands between steps and fans step outputs out to streams.

Owns the only thread that touches the engine. RPC handlers never call the engine directly; they
`call()` a function onto this thread (between two steps) or read their request's `RequestStream`.
Prefill-only requests have their KV copied out here, on the engine thread, the moment their first
token is sampled, so their blocks go back to the pool before the next step. It also times the
steps (busy seconds; decode steps and theirs), the worker's own measure of its speed.
It must not do network I/O: the roles do that on their own threads.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable

from pdserve.engine.engine import LLMEngine, ParkedKV, StepOutput

log = logging.getLogger(__name__)


@dataclass
class StreamItem:
    output: StepOutput | None = None
    kv: ParkedKV | None = None
    error: BaseException | None = None


class RequestStream:
    """One request's outputs. Bounded by construction: a request yields at most max_tokens items."""

    def __init__(self) -> None:
        self.q: queue.Queue[StreamItem] = queue.Queue()

    def get(self, timeout: float | None = None) -> StreamItem:
        return self.q.get(timeout=timeout)


class EngineLoop:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._cmds: queue.Queue[tuple[Callable[[], Any], Future]] = queue.Queue()
        self._streams: dict[str, RequestStream] = {}
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.steps = 0
        # Written by the engine thread only; cumulative seconds inside engine.step(), and the
        # steps that decoded (some sequence past its prompt) with their seconds.
        self.busy_seconds = 0.0
        self.decode_steps = 0
        self.decode_step_seconds = 0.0

    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)

    def call(self, fn: Callable[[], Any], timeout: float | None = 60.0) -> Any:
        """Run fn on the engine thread between steps and return its result (or raise its error)."""
        fut: Future = Future()
        self._cmds.put((fn, fut))
        self._wake.set()
        return fut.result(timeout=timeout)

    def open_stream(self, request_id: str) -> RequestStream:
        """Register a stream; call inside the same `call()` that adds the request."""
        s = RequestStream()
        self._streams[request_id] = s
        return s

    def close_stream(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    def _run_commands(self) -> None:
        while True:
            try:
                fn, fut = self._cmds.get_nowait()
            except queue.Empty:
                return
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as e:  # handed to the caller, who maps it to a status
                fut.set_exception(e)

    def _run(self) -> None:
        while not self._stop:
            self._run_commands()
            if not self.engine.has_work():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                outputs = self._timed_step()
            except Exception as e:
                log.exception("engine step failed")
                self._fail_all(e)
                continue
            self.steps += 1
            for out in outputs:
                self._dispatch(out)

    def _timed_step(self) -> list[StepOutput]:
        t0 = time.perf_counter()
        try:
            return self.engine.step()
        finally:
            dt = time.perf_counter() - t0
            self.busy_seconds += dt
            if self.engine.last_step_decoded:
                self.decode_steps += 1
                self.decode_step_seconds += dt

    def _dispatch(self, out: StepOutput) -> None:
        s = self._streams.get(out.request_id)
        if out.prefill_done:
            kv = self.engine.take_parked_kv(out.request_id)
            if s is not None:
                s.q.put(StreamItem(output=out, kv=kv))
            return
        if s is None:
            return
        s.q.put(StreamItem(output=out))
        if out.finished:
            self._streams.pop(out.request_id, None)

    def _fail_all(self, err: BaseException) -> None:
        for rid, s in list(self._streams.items()):
            self.engine.abort(rid)
            s.q.put(StreamItem(error=err))
        self._streams.clear()
