"""How far admission's TTFT model is from what happens, learned from the requests it admitted.
Pure: the caller passes every time (`now_s`); no clock, no I/O, no lock (`Admission` holds one).

Owns the correction factor by which admission multiplies its raw prediction (queued prompt
tokens over the prefill pool's peak rate, `admission.predict_ttft`). The raw model is right in
shape and wrong in scale: a worker busy with decode steps, prompts prefilled by decode workers,
chunks offloaded, retries and prompts that turn out less cached than the index said all make the
cluster drain its queue slower (or faster) than its peak rates promise, by a factor that stays
about the same while the mix does. So the factor is measured, two ways:
- from requests that got their first token: the `quantile` (p99) of actual / raw over the last
  `window` samples younger than `max_age_s`;
- from requests still waiting: a request already older than its raw prediction says the factor
  is at least age / raw, now (the quantile hears of a stall only once the stalled requests
  finish; this hears of it at once, and forgets it as soon as they are answered);
- from the queue's drain while the oldest of them waits: the work that left the queue since it
  was admitted took `age` where the raw model says `raw_progress_s`. This hears of a slow
  drain a fraction of a wait after overload begins, before any promise is overdue; it counts
  once the drained work is at least `min_drained` of what was ahead of the request.
Only requests promised at least `near` of the limit count: admission's decision is made there,
and a tiny prediction (a short prompt, nothing queued) is dominated by fixed costs its ratio
would blow up. Without `min_samples` answered ones the quantile part is 1 (the raw model).
Must not know requests, workers or metrics: it sees (raw, promised, actual) numbers.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Iterable


@dataclass(frozen=True)
class CalibrationConfig:
    quantile: float = 0.99  # of answered requests' actual / raw: the promise is a p99
    window: int = 256  # answered samples kept
    max_age_s: float = 300.0  # older samples are forgotten: the mix changes
    min_samples: int = 16  # below it the answered part is 1
    near: float = 0.25  # only requests promised at least this fraction of the limit count
    min_drained: float = 0.1  # of the work ahead of the oldest waiting request
    min_factor: float = 0.5
    max_factor: float = 20.0

    def __post_init__(self) -> None:
        if not 0 < self.quantile <= 1:
            raise ValueError(f"quantile must be in (0, 1], got {self.quantile}")
        if self.window < 1 or self.min_samples < 1:
            raise ValueError("window and min_samples must be >= 1")
        if not 0 < self.min_factor <= 1 <= self.max_factor:
            raise ValueError("min_factor <= 1 <= max_factor, both > 0")


class TtftCalibration:
    def __init__(self, config: CalibrationConfig | None = None) -> None:
        self.config = config or CalibrationConfig()
        self._samples: deque[tuple[float, float]] = deque(maxlen=self.config.window)  # (at, r)
        self._answered: float | None = None  # the quantile part, cached until a sample changes

    def counts(self, promised_s: float, limit_s: float) -> bool:
        """Whether a request promised `promised_s` against the limit teaches the factor."""
        return limit_s > 0 and promised_s >= self.config.near * limit_s

    def observe(self, raw_s: float, actual_s: float, now_s: float) -> None:
        """A request admitted with raw prediction `raw_s` got its first token after
        `actual_s` (the caller checked `counts`)."""
        if raw_s > 0 and actual_s >= 0 and math.isfinite(actual_s):
            self._samples.append((now_s, actual_s / raw_s))
            self._answered = None

    def factor(self, now_s: float, waiting: Iterable[tuple[float, float]] = (),
               drain: tuple[float, float, float] | None = None) -> float:
        """The correction now; `waiting`: (raw_s, age_s) of requests that count and have no
        first token yet; `drain`: of the oldest of them, (age_s, raw_progress_s, share), the
        raw model's time for the work that left the queue since it was admitted, and that
        work's share of what was ahead of it."""
        c = self.config
        f = self._answered_part(now_s)
        for raw_s, age_s in waiting:
            if raw_s > 0 and age_s > raw_s * f:
                f = age_s / raw_s
        if drain is not None:
            age_s, raw_progress_s, share = drain
            if share >= c.min_drained and raw_progress_s > 0:
                f = max(f, age_s / raw_progress_s)
        return min(c.max_factor, max(c.min_factor, f))

    def _answered_part(self, now_s: float) -> float:
        c, s = self.config, self._samples
        while s and now_s - s[0][0] > c.max_age_s:
            s.popleft()
            self._answered = None
        if self._answered is None:
            if len(s) < c.min_samples:
                self._answered = 1.0
            else:
                ratios = sorted(r for _, r in s)
                self._answered = ratios[min(len(ratios) - 1,
                                            math.ceil(c.quantile * len(ratios)) - 1)]
        return self._answered

    def snapshot(self, now_s: float) -> dict:
        """For /debug: the answered part and how many samples back it."""
        return {"answered_factor": round(self._answered_part(now_s), 3),
                "samples": len(self._samples)}
