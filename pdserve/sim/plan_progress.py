"""What a person sees while `pdserve sim plan` runs, on stderr (stdout stays the result's).

Owns the progress of each candidate: simulated seconds against the trace's span, wall time
and an estimate of the time left at the pace so far (`time_left_s`, pure), shown as a rich bar
per candidate running on a terminal, or else as a line per candidate when it starts, every
`every_s` of wall time and when it ends; and `say`, a line of the command's log printed above
the bars. Must not run or rank candidates.
"""

from __future__ import annotations

import time
from typing import Any, Callable


_CONSOLE: list[Any] = []


def stderr_console() -> Any:
    """The process's rich Console on stderr (lines are not wrapped), made on first use."""
    if not _CONSOLE:
        from rich.console import Console

        _CONSOLE.append(Console(stderr=True, soft_wrap=True))
    return _CONSOLE[0]


def time_left_s(sim_s: float, span_s: float, wall_s: float) -> float | None:
    """Wall seconds left to simulate up to `span_s`, at the pace of the first `sim_s` simulated
    seconds (which took `wall_s`); None before any simulated time has passed."""
    if sim_s <= 0 or wall_s < 0:
        return None
    return wall_s * max(0.0, span_s - sim_s) / sim_s


def duration(seconds: float | None) -> str:
    """`seconds` for a person: "45 s", "12 min", "3.4 h" ("?" for None)."""
    if seconds is None:
        return "?"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def progress_text(sim_s: float, span_s: float, wall_s: float) -> str:
    """"simulated 40/3600 s, 98 s wall, about 2.4 h left"."""
    left = time_left_s(sim_s, span_s, wall_s)
    return (f"simulated {min(sim_s, span_s):.0f}/{span_s:.0f} s, {duration(wall_s)} wall, "
            f"about {duration(left)} left")


class PlanProgress:
    """Candidates' progress on `console` (a rich Console on stderr): `live` draws bars, else
    lines go to `say` when a candidate starts, every `every_s` and when it ends. Use as a
    context manager around the runs; `clock` gives wall seconds."""

    def __init__(self, console: Any, span_s: float, say: Callable[[str], None], *,
                 live: bool, every_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.console, self.span_s, self._say = console, max(span_s, 1e-9), say
        self.live, self.every_s, self.clock = live, every_s, clock
        self._bar: Any = None
        self._tasks: dict[int, Any] = {}
        self._started: dict[int, float] = {}
        self._said: dict[int, float] = {}
        self._names: dict[int, str] = {}

    def __enter__(self) -> PlanProgress:
        if self.live:
            from rich.progress import BarColumn, Progress, TextColumn

            self._bar = Progress(TextColumn("{task.description}"), BarColumn(),
                                 TextColumn("{task.fields[text]}"), console=self.console,
                                 transient=True)
            self._bar.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def say(self, line: str) -> None:
        self._say(line)

    def start(self, k: int, name: str) -> None:
        now = self.clock()
        self._started[k] = self._said[k] = now
        self._names[k] = name
        if self._bar is not None:
            self._tasks[k] = self._bar.add_task(name, total=self.span_s,
                                                text=progress_text(0.0, self.span_s, 0.0))
        else:
            self._say(f"{name}: started")

    def tick(self, k: int, sim_s: float) -> None:
        if k not in self._started:
            return
        now = self.clock()
        text = progress_text(sim_s, self.span_s, now - self._started[k])
        if self._bar is not None:
            self._bar.update(self._tasks[k], completed=min(sim_s, self.span_s), text=text)
        elif now - self._said[k] >= self.every_s:
            self._said[k] = now
            self._say(f"{self._names[k]}: {text}")

    def end(self, k: int) -> float:
        """The candidate is done: its bar goes; the wall seconds it took."""
        wall = self.clock() - self._started.pop(k, self.clock())
        task = self._tasks.pop(k, None)
        if task is not None and self._bar is not None:
            self._bar.remove_task(task)
        return wall
