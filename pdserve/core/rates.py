"""Measured rates from cumulative counters (tokens per busy second), per worker and per pool.

Owns the rule that turns workers' cumulative counters into smoothed rates; the router's
admission and the controller's pressures both read prefill rates through it. Must not import
torch or any service, nor read a clock.
"""

from __future__ import annotations

from collections.abc import Iterable


class RateMeter:
    """Measured rates (tokens per busy second) from per-worker cumulative counters.

    Workers report totals, not rates, so a lost poll loses no work: each `observe` compares the
    totals with the last baseline. A delta is used only once it spans at least `min_busy_s` of
    busy time (until then the baseline stays put and the deltas add up), because a handful of
    tokens over a few milliseconds measures timer noise. Samples are smoothed with an EWMA
    (`alpha` = weight of the newest). A total that went down means the worker restarted: that
    key starts over (no rate until a fresh delta). Pure: no clock, like `router.policy`'s
    `RoundRobin` it only keeps state between calls.

    Each key also keeps its peak: the highest sample since it (re)started. The smoothed rate
    says what the worker has been doing; the peak, what it has shown it can do. They differ
    because a prefill step costs nearly as much for one short prompt as for a batch of them:
    under light load the smoothed rate is a fraction of what the same worker delivers once a
    queue lets it batch, so a bound on the predicted wait divides by the peak.
    """

    def __init__(self, alpha: float = 0.3, min_busy_s: float = 0.05) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        if not min_busy_s > 0:
            raise ValueError(f"min_busy_s must be > 0, got {min_busy_s}")
        self.alpha = alpha
        self.min_busy_s = min_busy_s
        self._base: dict[str, tuple[float, float]] = {}  # key -> (tokens_total, busy_s_total)
        self._rate: dict[str, float] = {}
        self._peak: dict[str, float] = {}

    def observe(self, key: str, tokens_total: float, busy_s_total: float) -> float | None:
        base = self._base.get(key)
        if base is None or tokens_total < base[0] or busy_s_total < base[1]:
            self._base[key] = (tokens_total, busy_s_total)
            self._rate.pop(key, None)
            self._peak.pop(key, None)
            return None
        d_tokens, d_busy_s = tokens_total - base[0], busy_s_total - base[1]
        if d_busy_s < self.min_busy_s:
            return self._rate.get(key)
        sample = d_tokens / d_busy_s
        old = self._rate.get(key)
        self._rate[key] = sample if old is None else self.alpha * sample + (1 - self.alpha) * old
        self._peak[key] = max(sample, self._peak.get(key, 0.0))
        self._base[key] = (tokens_total, busy_s_total)
        return self._rate[key]

    def rate(self, key: str) -> float | None:
        return self._rate.get(key)

    def forget(self, key: str) -> None:
        """Drop a worker that left (so a new one at the same address starts fresh)."""
        self._base.pop(key, None)
        self._rate.pop(key, None)
        self._peak.pop(key, None)

    def peak(self, key: str) -> float | None:
        return self._peak.get(key)

    def pool_rate(self, keys: Iterable[str], peak: bool = False) -> float | None:
        """The pool's throughput: its workers' rates (with `peak`, their peaks) summed, a worker
        not measured yet counted at the mean of those measured; None when none is."""
        keys = list(keys)
        rates = self._peak if peak else self._rate
        measured = [r for r in (rates.get(k) for k in keys) if r]
        if not measured:
            return None
        return sum(measured) / len(measured) * len(keys)
