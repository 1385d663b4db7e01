"""Cores lent between the workers of one host: a worker computes with the cores the others idle.

Owns the decision of how many compute threads a worker's next step uses (`step_threads`, pure),
the host's shared ledger the workers of one local cluster read and write it from (`CoreLedger`:
a small file mapped into each worker, one slot per worker holding its pid and the threads its
step in progress uses, 0 between steps), and the engine thread's side (`StepThreads`: claim
before a step, set torch's thread count when it changed, release after).
A worker about to step while another's step in progress runs on borrowed cores (more threads
than its own share) first claims its own share, which the borrower sees before its next step,
and waits for the borrowed step to end (`must_wait`; at most `max_wait_s`): two steps on more
threads than cores slow each other many times over (OpenMP threads spin at every op's barrier
for a core the other holds), so a newcomer pays at most one step of the borrower instead. A
borrowed step that outlasts a whole wait (a stalled process) is not waited for again.
Must not lock around a step: a slot is written and the others read with no lock, so two
workers starting a step at the same moment may both borrow for that one step, and the next step
corrects it. A dead worker's slot is not counted (its pid is gone), and the slot is reused.

Why: `pdserve serve` splits a host's cores evenly between its prefill and decode workers, and
a disaggregated cluster's roles are rarely busy at the same time on one host: during a wave of
decode the prefill worker's cores idle, during a burst of prompts the decode worker's. A step
of the SmolLM2 engine on 2 threads instead of 1 takes 0.6-0.8 of the time (batch 8 to 32).
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import struct
import time
from typing import Callable

SLOTS = 64
_SLOT = struct.Struct("<iii")  # pid, threads in use (0: not computing), the worker's own share
_ALL = struct.Struct("<" + "iii" * SLOTS)
SIZE = _ALL.size


def step_threads(own: int, most: int, cores: int, others: int) -> int:
    """Threads for a worker's next step: its own share `own`, plus what the host's `cores` leave
    once the other workers' steps in progress (`others` threads) are counted, at most `most`."""
    return max(own, min(most, cores - others))


def must_wait(own: int, cores: int, others: list[tuple[int, int]]) -> bool:
    """Whether a worker whose step needs `own` threads waits before starting it: some other
    worker's step in progress borrows (`others`: (threads in use, own share) per worker
    computing), and with it the host's cores would be oversubscribed. Workers whose own shares
    alone exceed the cores never wait for each other: no step of theirs borrows."""
    return (any(n > o for n, o in others)
            and sum(n for n, _ in others) + own > cores)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


class CoreLedger:
    """One worker's view of the host's ledger file at `path` (created when missing)."""

    def __init__(self, path: str) -> None:
        self.pid = os.getpid()
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # only while taking a slot
            try:
                if os.fstat(fd).st_size < SIZE:
                    os.ftruncate(fd, SIZE)
                self._map = mmap.mmap(fd, SIZE)
                self.slot = self._take_slot()
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def _take_slot(self) -> int:
        for i in range(SLOTS):
            pid = _SLOT.unpack_from(self._map, i * _SLOT.size)[0]
            if pid == 0 or not _alive(pid):
                _SLOT.pack_into(self._map, i * _SLOT.size, self.pid, 0, 0)
                return i
        raise RuntimeError(f"the core ledger has no free slot: more than {SLOTS} workers on "
                           "this host share it")

    def steps(self) -> list[tuple[int, int, int]]:
        """(pid, threads in use, own share) of each other live worker's step in progress."""
        vals = _ALL.unpack_from(self._map, 0)
        out = []
        for i in range(SLOTS):
            pid, n, own = vals[3 * i], vals[3 * i + 1], vals[3 * i + 2]
            if n > 0 and i != self.slot and _alive(pid):
                out.append((pid, n, own))
        return out

    def set(self, threads: int, own: int = 0) -> None:
        """This worker's step now uses `threads` of which `own` are its share (0: no step)."""
        with contextlib.suppress(ValueError):  # closed at shutdown while a last step ended
            _SLOT.pack_into(self._map, self.slot * _SLOT.size, self.pid, threads, own)

    def close(self) -> None:
        with contextlib.suppress(ValueError, BufferError):  # already closed
            _SLOT.pack_into(self._map, self.slot * _SLOT.size, 0, 0, 0)
            self._map.close()


class StepThreads:
    """The engine thread's side: `begin()` before a step claims its threads and applies them
    through `apply` (torch.set_num_threads) when the count changed; `end()` after releases."""

    def __init__(self, ledger: CoreLedger, own: int, most: int, cores: int,
                 apply: Callable[[int], None], max_wait_s: float = 0.2) -> None:
        if not 1 <= own <= most:
            raise ValueError(f"need 1 <= own <= most threads, got {own} and {most}")
        self.ledger, self.own, self.most, self.cores = ledger, own, most, cores
        self._apply = apply
        self.max_wait_s = max_wait_s
        self.current = 0
        self.borrowed_steps = 0  # steps that ran on more threads than this worker's own
        self.waited_s = 0.0  # time spent waiting for a borrowed step to end
        # Borrowers whose step outlasted a whole wait (a stalled or stopped process): not
        # waited for again until they end that step.
        self._outlasted: set[int] = set()

    def _waited_for(self, steps: list[tuple[int, int, int]]) -> list[tuple[int, int]]:
        """The steps in progress a newcomer waits for: all but those that outlasted a wait."""
        if self._outlasted:
            self._outlasted &= {pid for pid, n, own in steps if n > own}
        return [(n, own) for pid, n, own in steps if pid not in self._outlasted]

    def begin(self) -> int:
        steps = self.ledger.steps()  # one read of the ledger on a step that does not wait
        if must_wait(self.own, self.cores, self._waited_for(steps)):
            self.ledger.set(self.own, self.own)  # the borrower's next step sees this claim
            t0 = time.monotonic()
            while must_wait(self.own, self.cores, self._waited_for(steps)):
                if time.monotonic() - t0 >= self.max_wait_s:
                    self._outlasted |= {pid for pid, n, own in steps if n > own}
                    break
                time.sleep(0.0005)
                steps = self.ledger.steps()
            self.waited_s += time.monotonic() - t0
        # Every step in progress counts for the threads, an outlasted one too.
        n = step_threads(self.own, self.most, self.cores, sum(n for _, n, _ in steps))
        self.ledger.set(n, self.own)
        if n != self.current:
            self._apply(n)
            self.current = n
        if n > self.own:
            self.borrowed_steps += 1
        return n

    def end(self) -> None:
        self.ledger.set(0, 0)
