"""When the launcher restarts a dead child process, as a pure core.

Owns the restart rule for one child (store master, storage node, worker, router, controller):
exponential backoff between restarts (`backoff_s`, times `backoff_factor` per quick death in a
row, capped at `backoff_max_s`), reset once an incarnation stayed up `stable_s`; and the crash
loop bound: a restart that would be the `max_restarts + 1`-th within `window_s` is not made,
the child is given up on instead (the adapter reports it loudly). So a child that can never
start costs a bounded number of tries, spaced further and further apart, never a tight loop.

Must not do I/O, sleep, read a clock or know processes: the adapter (`supervision.py`) passes the
child's ended runs and `now_s`, and carries out the returned decision.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

RESTART = "restart"  # start it again now
WAIT = "wait"  # start it again at `at_s`, not before
GIVE_UP = "give_up"  # crash loop: leave it dead and say so


@dataclass(frozen=True)
class RestartPolicy:
    backoff_s: float = 0.5  # wait before the first restart in a row of quick deaths
    backoff_factor: float = 2.0  # each further quick death in a row waits this many times longer
    backoff_max_s: float = 30.0
    stable_s: float = 60.0  # an incarnation up this long died of something new: backoff resets
    max_restarts: int = 5  # at most this many restarts ...
    window_s: float = 120.0  # ... within any window this long; one more is a crash loop

    def __post_init__(self) -> None:
        # A zero backoff would let a child that dies at once be restarted in a tight loop.
        if not self.backoff_s > 0:
            raise ValueError(f"backoff_s must be > 0, got {self.backoff_s}")
        if not self.backoff_factor >= 1:
            raise ValueError(f"backoff_factor must be >= 1, got {self.backoff_factor}")
        if not self.backoff_max_s >= self.backoff_s:
            raise ValueError(f"backoff_max_s must be >= backoff_s ({self.backoff_s}), got "
                             f"{self.backoff_max_s}")
        if not self.stable_s > 0:
            raise ValueError(f"stable_s must be > 0, got {self.stable_s}")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if not self.window_s > 0:
            raise ValueError(f"window_s must be > 0, got {self.window_s}")

    def history_len(self) -> int:
        """How many of a child's latest runs a decision can depend on (the adapter keeps no
        more): the restarts that fit in one window, and the quick deaths in a row it takes the
        backoff to reach its cap."""
        steps = 1
        if self.backoff_factor > 1:
            steps += math.ceil(math.log(self.backoff_max_s / self.backoff_s)
                               / math.log(self.backoff_factor))
        return max(self.max_restarts, steps) + 1


@dataclass(frozen=True)
class Run:
    """One incarnation of a child, ended: when it started and when its exit was seen."""

    started_s: float
    ended_s: float
    exit_code: int
    restart: bool  # it was started by a restart (not the launcher's first start)


@dataclass(frozen=True)
class RestartDecision:
    action: str  # RESTART, WAIT or GIVE_UP
    at_s: float  # when the restart is due (RESTART: at or before now_s)
    backoff_s: float  # the wait after the last exit that this attempt needs
    reason: str  # why, for logs and tests


def decide(policy: RestartPolicy, runs: Sequence[Run], now_s: float) -> RestartDecision:
    """What to do about a child whose latest run, `runs[-1]`, has ended (oldest first)."""
    if not runs:
        raise ValueError("runs: a decision needs the run that ended")
    last = runs[-1]
    quick = 0  # quick deaths in a row, the last one included
    for run in reversed(runs):
        if run.ended_s - run.started_s >= policy.stable_s:
            break
        quick += 1
    backoff = min(policy.backoff_max_s,
                  policy.backoff_s * policy.backoff_factor ** max(0, quick - 1))
    at_s = last.ended_s + backoff
    recent = sum(1 for r in runs if r.restart and r.started_s > at_s - policy.window_s)
    if recent >= policy.max_restarts:
        return RestartDecision(GIVE_UP, at_s, backoff,
                               f"crash loop: {policy.max_restarts} restarts within "
                               f"{policy.window_s:g}s already (max_restarts)")
    if now_s >= at_s:
        return RestartDecision(RESTART, at_s, backoff,
                               f"exited with {last.exit_code}; backoff {backoff:g}s passed")
    return RestartDecision(WAIT, at_s, backoff,
                           f"exited with {last.exit_code}; backoff {backoff:g}s")
