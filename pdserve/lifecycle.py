"""A child process of `pdserve serve` ends when its parent does, even after kill -9 of the parent.

The launcher sets PDSERVE_DIE_WITH_PARENT to its pid; each service's `main` calls
`die_with_parent_if_asked()` first, which asks Linux for SIGTERM on the parent's death (the
child's own handlers then shut it down cleanly). This runs in the child after exec, not in a
`preexec_fn` between fork and exec: forking a process whose gRPC threads are running ran gRPC's
fork handlers in the child, which aborted it now and then ("epoll_wait error: Bad file
descriptor"); without a preexec_fn, Python spawns with vfork/posix_spawn and no fork handlers run.

The clean shutdown is bounded: a watchdog thread notices the orphaning too (its parent pid
changes), sends the SIGTERM itself where the kernel cannot (not Linux), and ends the process with exit
code 1 if it is still alive `ORPHAN_EXIT_S` later, since a shutdown step waiting on a peer that
died with the launcher must not keep it alive.

Also `StopSignals`: SIGTERM and SIGINT turned into an `Event` by a handler that takes no lock,
for every process that stops on them.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

ENV = "PDSERVE_DIE_WITH_PARENT"
_PR_SET_PDEATHSIG = 1
ORPHAN_EXIT_S = 10.0  # how long an orphaned child may take to shut down cleanly
_POLL_S = 0.25


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a child that should die with this process."""
    out = dict(os.environ if env is None else env)
    out[ENV] = str(os.getpid())
    return out


def die_with_parent_if_asked() -> None:
    parent = os.environ.get(ENV)
    if not parent:
        return
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        kernel_signals = True
    except OSError:
        kernel_signals = False  # not Linux: the watchdog sends the SIGTERM
    threading.Thread(target=_watch_parent, args=(int(parent), not kernel_signals),
                     name="parent-watchdog", daemon=True).start()
    if kernel_signals and os.getppid() != int(parent):  # the parent died before we asked
        os.kill(os.getpid(), signal.SIGTERM)


def _watch_parent(parent: int, send_term: bool) -> None:
    while os.getppid() == parent:
        time.sleep(_POLL_S)
    if send_term:
        os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(ORPHAN_EXIT_S)
    print(f"pdserve: parent {parent} died and the clean shutdown took over {ORPHAN_EXIT_S:g}s; "
          "exiting now", file=sys.stderr, flush=True)
    os._exit(1)


class StopSignals:
    """SIGTERM and SIGINT set `event`, without taking a lock in the signal handler.

    `Event.set` takes its condition's lock. A second signal arriving while a handler holds it
    (Ctrl-C in a shell whose trap also sends SIGTERM, or Ctrl-C pressed twice) runs the handler
    again on the same thread, which then waits forever for the lock it holds: the process never
    stops. Here the handler only records the signal and writes a byte to a pipe; a thread of
    its own reads the byte and sets the event.

    The Python handler runs on the main thread, and only once that thread returns to the
    interpreter. The kernel may deliver the signal to any of the process's threads; a main
    thread asleep on a lock (an untimed `Event.wait`) is then never woken, and the handler
    never runs. So the pipe is also the interpreter's wakeup fd: its C-level handler writes the
    signal's number there at once, from whichever thread took it. Main thread only (signal
    handlers and the wakeup fd are); the last instance in a process owns both.
    """

    def __init__(self, event: threading.Event,
                 signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)) -> None:
        self.event = event
        self.signals = frozenset(int(s) for s in signals)
        self.received: list[int] = []  # by the handler (list.append takes no Python lock)
        self._woken: list[int] = []  # by the relay, from the wakeup fd
        self._r, self._w = os.pipe()
        os.set_blocking(self._w, False)
        threading.Thread(target=self._relay, name="stop-signals", daemon=True).start()
        for sig in signals:
            signal.signal(sig, self._on_signal)
        signal.set_wakeup_fd(self._w, warn_on_full_buffer=False)

    def _on_signal(self, signum: int, frame: object) -> None:
        self.received.append(signum)
        try:
            os.write(self._w, b"\0")
        except BlockingIOError:  # the pipe is full: bytes already wait to be read
            return

    def _relay(self) -> None:
        # 0: from the handler; else a signal's number from the wakeup fd, which every signal
        # with a Python handler writes (only the stop signals stop).
        while (b := os.read(self._r, 1)):
            if b[0] == 0 or b[0] in self.signals:
                if b[0]:
                    self._woken.append(b[0])
                self.event.set()

    @property
    def first(self) -> int | None:
        """The first stop signal taken (None before any): its handler may not have run yet."""
        return (self.received or self._woken or [None])[0]
