"""The engine's one thread: runs commands between steps and fans step outputs out to streams.

Owns the only thread that touches the engine. RPC handlers never call the engine directly; they
`call()` a function onto this thread (between two steps) or read their request's `RequestStream`.
Prefill-only requests have their KV copied out here, on the engine thread, the moment their first
token is sampled, so their blocks go back to the pool before the next step. It also times the
steps (busy seconds; decode steps, their seconds and a histogram of them), the worker's own
measure of its speed, and stamps each output with the wall-clock end of its step.
After a step it lets the readers of that step's outputs send them before the next step starts
(`handoff_s`, 5 ms at most): a reader that sends during the step takes the GIL from the engine
thread between every pair of ops, which slowed batch-8 decode steps by 10-20 % under load
(`docs/benchmarks.md`); sending first costs the step only the readers' own work. A reader still
sending the previous step's tokens (a slow client) is not waited for, and a queued command
ends the wait.
With `threads` (`worker/cores.py`) each step first claims its compute threads from the host's
ledger (its own share, more while the host's other workers idle) and releases them after;
between the step's layers a borrowing step gives lent cores back when their owner claims them.
A command whose caller stops waiting (`call` past its timeout, while a long step holds the
thread) is cancelled before it runs and the caller gets `EngineBusy`; one already running is
waited for, so its effect (a request added, blocks taken) is never lost to its caller. `post`
queues a command nobody waits for (aborting a request whose caller left).
It must not do network I/O: the roles do that on their own threads.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Callable

from pdserve.engine.engine_core import EngineCore, ParkedKV, StepOutput
from pdserve.metrics import BucketCounts
from pdserve.worker.cores import StepThreads

log = logging.getLogger(__name__)


class EngineBusy(TimeoutError):
    """The engine thread did not take a command within the caller's timeout (a step ran long);
    the command was cancelled and never ran."""


def _log_failure(fut: Future) -> None:
    if fut.exception() is not None:
        log.warning("posted engine command failed: %r", fut.exception())


@dataclass
class StreamItem:
    output: StepOutput | None = None
    kv: ParkedKV | None = None
    error: BaseException | None = None
    made_s: float = 0.0  # wall clock (time.time) when the step that made `output` ended


class RequestStream:
    """One request's outputs. Bounded by construction: a request yields at most max_tokens items."""

    def __init__(self, idle: threading.Condition | None = None) -> None:
        self.q: queue.Queue[StreamItem] = queue.Queue()
        # Set by the engine thread before it queues an output; cleared by the reader when it
        # comes back for more with nothing queued (it has sent what it took).
        self.busy = False
        self._idle = idle

    def get(self, timeout: float | None = None) -> StreamItem:
        if self._idle is not None and self.busy and self.q.empty():
            with self._idle:
                self.busy = False
                self._idle.notify_all()
        return self.q.get(timeout=timeout)


class EngineLoop:
    def __init__(self, engine: EngineCore, call_timeout_s: float = 60.0,
                 handoff_s: float = 0.005, threads: StepThreads | None = None) -> None:
        if not call_timeout_s > 0:
            raise ValueError(f"call_timeout_s must be > 0, got {call_timeout_s!r}")
        if not handoff_s >= 0:
            raise ValueError(f"handoff_s must be >= 0, got {handoff_s!r}")
        self.engine = engine
        self.threads = threads  # the host's cores lent between its workers (None: fixed)
        if threads is not None:  # a borrowing step gives its lender's cores back midway
            engine.between_layers = threads.between_layers
        self.call_timeout_s = call_timeout_s
        self._cmds: queue.Queue[tuple[Callable[[], Any], Future]] = queue.Queue()
        self._streams: dict[str, RequestStream] = {}
        self._wake = threading.Event()
        self.handoff_s = handoff_s
        self._idle = threading.Condition() if handoff_s > 0 else None
        self._fresh: list[RequestStream] = []  # streams given an output by this step, idle before
        # True from a step's first output queued until its readers came back (or the wait ended).
        self.handing_off = False
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.steps = 0
        # Written by the engine thread only; cumulative seconds inside engine.step(), and the
        # steps that decoded (some sequence past its prompt) with their seconds.
        self.busy_seconds = 0.0
        self.decode_steps = 0
        self.decode_step_seconds = 0.0
        self.decode_step_histogram = BucketCounts()

    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)

    def call(self, fn: Callable[[], Any], timeout: float | None = None) -> Any:
        """Run fn on the engine thread between steps and return its result (or raise its error).

        Waits `timeout` (default `call_timeout_s`) for the thread to take it; past that the
        command is cancelled and EngineBusy raised, unless it already runs: then its result is
        awaited (commands are short), so nothing it did is left without its caller."""
        fut: Future = Future()
        self._cmds.put((fn, fut))
        self._wake_up()
        wait_s = self.call_timeout_s if timeout is None else timeout
        try:
            return fut.result(timeout=wait_s)
        except FutureTimeout:
            if fut.cancel():
                raise EngineBusy(f"worker busy: the engine did not take the command within "
                                 f"{wait_s:g}s (a step ran long); nothing was done") from None
            return fut.result()

    def post(self, fn: Callable[[], Any]) -> None:
        """Run fn on the engine thread between steps; nobody waits for it (its errors are
        logged)."""
        fut: Future = Future()
        fut.add_done_callback(_log_failure)
        self._cmds.put((fn, fut))
        self._wake_up()

    def _wake_up(self) -> None:
        """A command is queued: end an idle wait, or a hand-off (commands go first)."""
        self._wake.set()
        if self._idle is not None:
            with self._idle:
                self._idle.notify_all()

    def open_stream(self, request_id: str) -> RequestStream:
        """Register a stream; call inside the same `call()` that adds the request."""
        s = RequestStream(self._idle)
        self._streams[request_id] = s
        return s

    def close_stream(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def has_stream(self, request_id: str) -> bool:
        return request_id in self._streams

    def take_stream(self, request_id: str) -> RequestStream | None:
        """Unregister a stream and return it (None: none open), so that its reader gets nothing
        more from the engine, only what the caller puts in it."""
        return self._streams.pop(request_id, None)

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
            made_s = time.time()
            if self._idle is not None:
                self.handing_off = True
            for out in outputs:
                self._dispatch(out, made_s)
            if self._fresh:
                self._await_readers()
            if self._idle is not None:
                with self._idle:
                    self.handing_off = False
                    self._idle.notify_all()

    def wait_handed_off(self, timeout: float) -> None:
        """Wait (at most `timeout`) until the step whose outputs are being handed to their
        readers has been handed over: each of its readers came back for more, or the hand-off
        gave up. A reader of many streams (DecodeMany) sends their chunks together after it."""
        if self._idle is None:
            return
        with self._idle:
            self._idle.wait_for(lambda: not self.handing_off, timeout)

    def _await_readers(self) -> None:
        """Wait (at most `handoff_s`) until the readers given an output by this step have sent
        it and come back for more, or a command is queued."""
        fresh, self._fresh = self._fresh, []
        deadline = time.perf_counter() + self.handoff_s
        with self._idle:
            while any(s.busy for s in fresh) and self._cmds.empty():
                left = deadline - time.perf_counter()
                if left <= 0:
                    return
                self._idle.wait(left)

    def _timed_step(self) -> list[StepOutput]:
        if self.threads is not None:
            self.threads.begin(*self.engine.num_requests())
        t0 = time.perf_counter()
        try:
            return self.engine.step()
        finally:
            dt = time.perf_counter() - t0
            if self.threads is not None:
                self.threads.end(*self.engine.num_requests())
            self.busy_seconds += dt
            if self.engine.last_step_decoded:
                self.decode_steps += 1
                self.decode_step_seconds += dt
                self.decode_step_histogram.observe(dt)

    def _dispatch(self, out: StepOutput, made_s: float = 0.0) -> None:
        s = self._streams.get(out.request_id)
        if out.prefill_done:
            kv = self.engine.take_parked_kv(out.request_id)
            if s is not None:
                s.q.put(StreamItem(output=out, kv=kv))
            return
        if s is None:
            return
        if self._idle is not None:
            if not s.busy and not out.finished:  # a finished stream's reader does not come back
                self._fresh.append(s)
            s.busy = True  # before the put: a reader that takes it must find the flag to clear
        s.q.put(StreamItem(output=out, made_s=made_s))
        if out.finished:
            self._streams.pop(out.request_id, None)

    def _fail_all(self, err: BaseException) -> None:
        for rid, s in list(self._streams.items()):
            self.engine.abort(rid)
            s.q.put(StreamItem(error=err))
        self._streams.clear()
