"""Cores shared between the workers of one host: a worker computes with the cores the others idle.

Owns the decision of how many compute threads a worker's next step uses and whether it waits
first, and whether a step gives back or takes up cores midway (`step_threads`, `must_wait`,
`yields`, `gives_back`, `takes_up`, `turn_waits`, pure), the host's shared ledger the
workers of one local cluster read and write it from (`CoreLedger`: a small file mapped into
each worker, one slot per worker holding its pid, the threads its step in progress uses (0
between steps), its own share, since when it waits, for a turn or for another's step, and the
requests its engine holds and how many of them have no first token yet), and the engine
thread's side
(`StepThreads`: claim before a step, set torch's thread count when it changed, look again
between layers, release after).

Two ways to share (`StepThreads(turns=...)`):
- Turns (`--core-sharing turns`): a step runs on all the cores a worker may use, and a
  worker about to step while another computes waits for that step to end, first come first
  served (`turn_waits`; at most `max_wait_s`, then it steps on its own share beside it, and
  waits again before its next step; a stopped process is not waited for). Its steps are kept
  short (`TURN_STEP_TOKENS`), so a turn is a fraction of a second. On a
  small host this keeps a burst of prompts fast: with side-by-side steps a prefill of a whole
  wave ran on one core for seconds while the decode worker spent the other on steps of a few
  requests that each cost nearly a full batch's weight reads; taking turns ran the same
  wave's prefill twice as fast and the decode steps at full batches. But under steady traffic
  every decode step waits out a prefill turn, and the inter-token gap grows several times
  (`docs/benchmarks.md`, bench serve on a CPU without AVX-512), so it is not the default.
- Lending (the default): a step runs on its own share plus the cores no other worker computes
  on, side by side with the others' steps. A worker about to step while another's step runs on
  borrowed cores (more threads than its share) first claims its own share, marked as waiting,
  which the borrower's next step sees, and waits for the borrowed step to end (`must_wait`; at
  most `max_wait_s`). Past the bound it steps on its own share, and the borrower, which looks
  at the ledger between the layers of its step (`StepThreads.between_layers`, the engine's
  hook), drops to its own share for the rest of the step (`gives_back`): a borrowed step
  shorter than the bound (a wave's prefill on both cores) ends undisturbed, a longer one
  shares the host's cores from then on instead of oversubscribing them. A borrowed step that
  outlasts a whole wait without giving back (a stalled process) is not waited for again
  until it ends. A worker also yields to another's step that computes when that worker's
  requests without a first token outnumber all of its own (`yields`): a few requests decoding
  wait (at most YIELD_WAIT_S) for a wave of prompts, whose steps take up the yielded cores
  between layers (`takes_up`), so the wave is prefilled on the whole host; a decode batch never
  yields to the prompt or two of steady traffic, and nobody yields while the own shares of the
  steps computing fill the host.
Either way two steps never run on more threads than cores while the bound holds: OpenMP
threads spin at every op's barrier for a core the other holds, and such steps slow each other
many times over.
Must not lock around a step: a slot is written and the others read with no lock, so two
workers starting a step at the same moment may both take the cores for that one step, and the
next step corrects it. A dead worker's slot is not counted (its pid is gone), and the slot is
reused.

Why: `pdserve serve` splits a host's cores evenly between its prefill and decode workers, and
a disaggregated cluster's roles are rarely busy at the same time on one host: during a wave of
decode the prefill worker's cores idle, during a burst of prompts the decode worker's. A step
of the SmolLM2 engine on 2 threads instead of 1 takes 0.6-0.8 of the time (batch 8 to 32), a
prefill about half.
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
# pid, threads in use (0: not computing), the worker's own share, since when (CLOCK_MONOTONIC,
# one clock for every process of the host, in microseconds) it waits for a turn or for a
# borrowed step (0: it does not)
# ... and, as of its last claim, how many requests its engine holds (running and waiting) and
# how many of those still wait for their first token (their prompts not yet computed)
_SLOT = struct.Struct("<iiiqii")
_ALL = struct.Struct("<" + "iiiqii" * SLOTS)
SIZE = _ALL.size
TURN_WAIT_S = 2.0  # the most a worker taking turns waits for the others' steps
LEND_WAIT_S = 0.2  # the most a lending worker waits for a borrowed step
# The most a worker yields its cores to another's step (`yields`): a wave of prompts
YIELD_WAIT_S = 2.0
# How often a borrowing step looks at the ledger between its layers: a read costs some
# microseconds, a batch-1 layer well under a millisecond.
GIVE_BACK_CHECK_S = 0.002
# A CPU worker taking turns runs at most this many tokens a step (`worker/server.py`): about
# 0.9 s of SmolLM2 prefill on 2 cores here, what a decode step waits for at most.
TURN_STEP_TOKENS = 512


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


def yields(held: int, their_fresh: int) -> bool:
    """Whether a worker whose engine holds `held` requests lets another whose engine holds
    `their_fresh` requests still waiting for a first token compute on its cores first: those
    outnumber its own. A wave of prompts then gets the host's cores before the few requests
    already decoding; a steady stream of decodes never yields to the prompt or two beside it,
    nor a prefill worker to requests that all have their first token."""
    return their_fresh > held


def takes_up(current: int, most: int, cores: int, others: int, fresh: int,
             their_held: list[int]) -> int:
    """Threads a worker's step in progress on `current` threads, its engine holding `fresh`
    requests without a first token, runs on from its next layer: more, up to `most`, when
    beside the other workers' steps computing (`others` threads) the host has idle cores and
    every other worker holding requests (`their_held`) yields to it; else `current`."""
    if current >= most or not all(yields(h, fresh) for h in their_held if h > 0):
        return current
    return max(current, min(most, cores - others))


def gives_back(current: int, own: int, cores: int, others: int) -> bool:
    """Whether a worker whose step in progress runs on `current` threads, `own` of them its
    share, drops to its share now: it borrows, and beside the other workers' steps computing
    (`others` threads; a lender still waiting within its bound does not count) the host's
    cores are oversubscribed."""
    return current > own and others + current > cores


def turn_waits(slot: int, since_us: int, computing: int,
               waiting: list[tuple[int, int]]) -> bool:
    """Whether a worker taking turns (in ledger slot `slot`, waiting since `since_us`, 0 if it
    does not wait yet) waits before its step: `computing` other steps are in progress, or
    another worker waits for a turn since before it (`waiting`: (since, slot) per waiter; a
    worker not yet waiting comes after every waiter, a tie goes to the lower slot)."""
    if computing:
        return True
    return any(not since_us or (s, i) < (since_us, slot) for s, i in waiting)


def _steps(claims: list[tuple[int, int, int, bool, int, int]]) -> list[tuple[int, int, int]]:
    """(pid, threads, own share) of the steps in progress among the ledger's `claims()`."""
    return [(pid, n, own) for pid, n, own, *_ in claims if n > 0]


def _now_us() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000


def _stopped(pid: int) -> bool:
    """Whether process `pid` is stopped (state T or t in /proc), not merely slow."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state in (b"T", b"t")


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
                _SLOT.pack_into(self._map, i * _SLOT.size, self.pid, 0, 0, 0, 0, 0)
                return i
        raise RuntimeError(f"the core ledger has no free slot: more than {SLOTS} workers on "
                           "this host share it")

    def _others(self, holding: bool = False) -> list[tuple[int, ...]]:
        """(slot, pid, threads in use, own share, waiting since, requests held, requests
        without a first token) of each other live worker that computes or waits (`holding`:
        or holds requests)."""
        vals = _ALL.unpack_from(self._map, 0)
        out = []
        for i in range(SLOTS):
            pid, n, own, since, held, fresh = vals[6 * i:6 * i + 6]
            if ((n > 0 or since or (holding and held > 0)) and i != self.slot
                    and _alive(pid)):
                out.append((i, pid, n, own, since, held, fresh))
        return out

    def steps(self) -> list[tuple[int, int, int]]:
        """(pid, threads in use, own share) of each other live worker's step in progress."""
        return [(pid, n, own) for _, pid, n, own, *_ in self._others() if n > 0]

    def claims(self) -> list[tuple[int, int, int, bool, int, int]]:
        """(pid, threads claimed, own share, whether it still waits, requests held, requests
        without a first token) of each other live worker that computes, waits, or holds
        requests."""
        return [(pid, n, own, bool(since) and n > 0, held, fresh)
                for _, pid, n, own, since, held, fresh in self._others(holding=True)]

    def computing(self) -> list[tuple[int, int, int]]:
        """(pid, threads in use, own share) of each other live worker's step that computes:
        `steps()` less the claims of lenders still waiting for a borrowed step."""
        return [(pid, n, own) for _, pid, n, own, since, *_ in self._others()
                if n > 0 and not since]

    def turns(self) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
        """The other workers' steps in progress, as `steps()`, and (since, slot, pid) of each
        other worker waiting for a turn."""
        others = self._others()
        return ([(pid, n, own) for _, pid, n, own, *_ in others if n > 0],
                [(since, i, pid) for i, pid, n, _, since, *_ in others if since and n <= 0])

    def set(self, threads: int, own: int = 0, waiting_since_us: int = 0, held: int = 0,
            fresh: int = 0) -> None:
        """This worker's step now uses `threads` of which `own` are its share (0: no step);
        or it waits since `waiting_since_us`: for a turn (with `threads` 0), or, lending, for
        another's step with its share claimed (`threads` = `own`). Its engine holds `held`
        requests, `fresh` of them without a first token."""
        with contextlib.suppress(ValueError):  # closed at shutdown while a last step ended
            _SLOT.pack_into(self._map, self.slot * _SLOT.size, self.pid, threads, own,
                            waiting_since_us, held, fresh)

    def close(self) -> None:
        with contextlib.suppress(ValueError, BufferError):  # already closed
            _SLOT.pack_into(self._map, self.slot * _SLOT.size, 0, 0, 0, 0, 0, 0)
            self._map.close()


class StepThreads:
    """The engine thread's side: `begin()` before a step claims its threads and applies them
    through `apply` (torch.set_num_threads) when the count changed; `end()` after releases.
    `turns`: take turns on all the cores, else lend idle ones (the module's docstring);
    `max_wait_s` defaults to TURN_WAIT_S or LEND_WAIT_S."""

    def __init__(self, ledger: CoreLedger, own: int, most: int, cores: int,
                 apply: Callable[[int], None], max_wait_s: float | None = None,
                 turns: bool = False) -> None:
        if not 1 <= own <= most:
            raise ValueError(f"need 1 <= own <= most threads, got {own} and {most}")
        self.ledger, self.own, self.most, self.cores = ledger, own, most, cores
        self._apply = apply
        self.turns = turns
        self.max_wait_s = (max_wait_s if max_wait_s is not None
                           else TURN_WAIT_S if turns else LEND_WAIT_S)
        self.current = 0
        self.borrowed_steps = 0  # steps that ran on more threads than this worker's own
        self.waited_s = 0.0  # time spent waiting for a borrowed step to end
        self.given_back = 0  # borrowed steps that gave their borrowed threads back midway
        self.taken_up = 0  # steps that took up cores freed midway (their workers idle or yield)
        # Requests this worker's engine holds, and those without a first token, as of its last
        # claim.
        self.held = self.fresh = 0
        self._checked = 0.0  # when `between_layers` last read the ledger
        # Borrowers whose step outlasted a whole wait (a stalled or stopped process): not
        # waited for again until they end that step.
        self._outlasted: set[int] = set()

    def _waited_for(self, steps: list[tuple[int, int, int]]) -> list[tuple[int, int]]:
        """The steps in progress a newcomer waits for: all but those that outlasted a wait."""
        if self._outlasted:
            self._outlasted &= {pid for pid, n, own in steps if n > own}
        return [(n, own) for pid, n, own in steps if pid not in self._outlasted]

    def _take_turn(self) -> list[tuple[int, int, int]]:
        """Wait until no other step runs and no earlier waiter is ahead, at most `max_wait_s`
        (a long step is waited for again before each step of this worker, so a worker
        beside it steps at most once a wait); the steps still in progress after that. A
        stopped process (SIGSTOP, a debugger) is not waited for: its step makes no progress."""
        steps, waiting = self.ledger.turns()

        def blocked() -> bool:
            return turn_waits(self.ledger.slot, since,
                              sum(1 for pid, _, _ in steps if not _stopped(pid)),
                              [(s, i) for s, i, pid in waiting if not _stopped(pid)])

        since = 0
        if blocked():
            since = _now_us()
            self.ledger.set(0, self.own, since)  # waiters after this one see it ahead
            t0 = time.monotonic()
            while blocked() and time.monotonic() - t0 < self.max_wait_s:
                time.sleep(0.0005)
                steps, waiting = self.ledger.turns()
            self.waited_s += time.monotonic() - t0
        return steps

    def begin(self, held: int = 0, fresh: int = 0) -> int:
        """Claim the threads of the next step of an engine holding `held` requests, `fresh` of
        them without a first token."""
        self.held, self.fresh = held, fresh
        if self.turns:
            steps = self._take_turn()
            n = step_threads(self.own, self.most, self.cores, sum(n for _, n, _ in steps))
            return self._claim(n)
        claims = self.ledger.claims()  # one read of the ledger on a step that does not wait
        yielding = self._yielding(claims)
        if yielding or must_wait(self.own, self.cores, self._waited_for(_steps(claims))):
            # The others see this claim: a borrower's step in progress gives back only once
            # this worker computes (past the bound); a worker it yields to takes up its cores.
            bound = YIELD_WAIT_S if yielding else self.max_wait_s
            self.ledger.set(self.own, self.own, _now_us(), held, fresh)
            t0 = time.monotonic()
            while (self._yielding(claims)
                   or must_wait(self.own, self.cores, self._waited_for(_steps(claims)))):
                if time.monotonic() - t0 >= bound:
                    self._outlasted |= {pid for pid, n, own in _steps(claims) if n > own}
                    break
                time.sleep(0.0005)
                claims = self.ledger.claims()
            self.waited_s += time.monotonic() - t0
        # Every step in progress counts for the threads, an outlasted one too; the claim of a
        # worker that waits and yields to this one does not.
        n = step_threads(self.own, self.most, self.cores,
                         sum(c[1] for c in claims if c[1] > 0
                             and not (c[3] and yields(c[4], fresh))))
        return self._claim(n)

    def _yields_to(self, claim: tuple[int, int, int, bool, int, int]) -> bool:
        """Whether this worker yields to the worker of `claim` (the ledger's `claims()`)."""
        return yields(self.held, claim[5])

    def _yielding(self, claims: list[tuple[int, int, int, bool, int, int]]) -> bool:
        """Whether this worker waits before its step for another worker's step that computes
        and to which it yields (`yields`), while the own shares of the steps computing leave a
        core of the host for it to take up (when the workers' own shares fill the host, a
        yielded core would only idle). A stopped process (SIGSTOP, a debugger) is not yielded
        to: its step makes no progress."""
        if sum(min(c[1], c[2]) for c in claims if c[1] > 0 and not c[3]) >= self.cores:
            return False
        return any(c[1] > 0 and not c[3] and self._yields_to(c) and not _stopped(c[0])
                   for c in claims)

    def between_layers(self, _layer: int = 0) -> None:
        """The engine's hook between a step's layers: a step on borrowed threads beside which
        its lender now computes (it waited out its bound) drops to its own share for the rest
        of the step (`gives_back`); a step on fewer threads than it may use takes up the cores
        that came free when every other worker holding requests yields to it (`takes_up`).
        Either says so in the ledger. Reads the ledger at most every GIVE_BACK_CHECK_S, and
        never on a step at its most that does not borrow."""
        if self.turns or self.current == 0 or self.own >= self.current >= self.most:
            return
        now = time.monotonic()
        if now - self._checked < GIVE_BACK_CHECK_S:
            return
        self._checked = now
        try:
            claims = self.ledger.claims()
        except ValueError:  # the ledger was closed at shutdown while this step ran
            return
        others = sum(c[1] for c in claims if c[1] > 0 and not c[3])
        if self.current > self.own:
            if gives_back(self.current, self.own, self.cores, others):
                self._set(self.own)
                self.given_back += 1
            return
        n = takes_up(self.current, self.most, self.cores, others, self.fresh,
                     [c[4] for c in claims])
        if n > self.current:
            self._set(n)
            self.taken_up += 1

    def _set(self, n: int) -> None:
        """The step in progress runs on `n` threads from now."""
        self._apply(n)
        self.current = n
        self.ledger.set(n, self.own, 0, self.held, self.fresh)

    def _claim(self, n: int) -> int:
        self.ledger.set(n, self.own, 0, self.held, self.fresh)
        if n != self.current:
            self._apply(n)
            self.current = n
        if n > self.own:
            self.borrowed_steps += 1
        return n

    def end(self, held: int = 0, fresh: int = 0) -> None:
        """The step ended; the engine now holds `held` requests, `fresh` without a first
        token."""
        self.held, self.fresh = held, fresh
        self.ledger.set(0, 0, 0, held, fresh)
