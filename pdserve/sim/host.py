"""Workers that share one host's CPU cores: how much slower a step runs while others compute.

Owns the contention factor (a pure function of the busy workers on a host, the threads each
uses, the host's cores and, where measured, the profile's slowdown table) and `HostShare`, the
per-run state behind it: which host each worker is on, which are computing, and the factor each
one's current step runs at. Where the profile measured one, a decode step has its own table
(`host_slowdown_decode`: a decode step beside computing prefills, which on a shared CPU hurt it
more than they hurt each other); a step with prefill tokens takes `host_slowdown`. The model is
processor sharing re-evaluated whenever a worker on the host starts or stops computing: a step
in progress keeps its remaining work and runs it at the new factor (its end moves); a run of
decode steps taken as one event ends with the step in progress, so that each later step is
timed with the factor at its start.

Only profiles measured on a shared CPU say `host_cores`; a GPU profile (each worker owns its
accelerator) and a cluster without `workers_per_host` never build a `HostShare`, so their
results are those of the per-worker step model. Must not decide anything or read the clock.
"""

from __future__ import annotations

from collections.abc import Sequence


def contention(busy_workers: int, threads_per_worker: int, host_cores: int,
               slowdown: Sequence[float] = (), background: float = 0.0) -> float:
    """How many times longer a step takes with `busy_workers` workers (this one included)
    computing on one host. With a measured `slowdown` table (the factor with 1, 2, ... workers of
    `threads_per_worker` threads busy) the table, extended past its end in proportion to the
    busy workers (its last entry's share per worker); else max(1, busy threads / cores).
    `background` threads of other work on the host (e.g. its load average before the cluster
    started) take their fair share of the cores: the factor is at least (busy threads +
    background) / cores."""
    if busy_workers < 1 or threads_per_worker < 1 or host_cores < 1 or background < 0:
        raise ValueError("busy_workers, threads_per_worker and host_cores must be >= 1 and "
                         f"background >= 0, got {busy_workers}, {threads_per_worker}, "
                         f"{host_cores}, {background}")
    threads = busy_workers * threads_per_worker
    share = max(1.0, (threads + background) / host_cores)
    if slowdown:
        if busy_workers <= len(slowdown):
            return max(share, float(slowdown[busy_workers - 1]))
        return max(share, slowdown[-1] * busy_workers / len(slowdown))
    return share


class Stretched:
    """A profile whose step times are stretched: a step with prefill tokens (`step_s`,
    `prefill_s`) `factor` times the wrapped one's, a decode step (`decode_s`) `decode_factor`
    times (what a worker's `start` reads)."""

    __slots__ = ("base", "factor", "decode_factor")

    def __init__(self, base, factor: float, decode_factor: float | None = None) -> None:
        self.base, self.factor = base, factor
        self.decode_factor = factor if decode_factor is None else decode_factor

    def step_s(self, **work) -> float:
        return self.base.step_s(**work) * self.factor

    def decode_s(self, batch: int, context_tokens: int) -> float:
        return self.base.decode_s(batch, context_tokens) * self.decode_factor

    def prefill_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        return self.base.prefill_s(new_tokens, cached_tokens) * self.factor

    def work_s(self, prefill_tokens: int, decode_batch: int, context_tokens: int,
               cached_tokens: int, pairs: float) -> float:
        if prefill_tokens:
            return self.base.work_s(prefill_tokens, decode_batch, context_tokens, cached_tokens,
                                    pairs) * self.factor
        return self.decode_s(decode_batch, context_tokens)


class HostShare:
    """Hosts of `workers_per_host` consecutive workers each, sharing `profile.host_cores`."""

    def __init__(self, profile, workers_per_host: int, addresses: Sequence[str],
                 background: float = 0.0) -> None:
        self.profile, self.background = profile, background
        self.cores = int(profile.host_cores)
        self.threads = int(profile.threads_per_worker)
        self.slowdown = tuple(profile.host_slowdown)
        # A decode step beside computing prefills slows by its own measured table, where the
        # profile has one (on a shared CPU it is hurt more than a prefill step is).
        self.slowdown_decode = tuple(getattr(profile, "host_slowdown_decode", ()))
        self.host_of = {a: i // workers_per_host for i, a in enumerate(addresses)}
        self.busy: dict[int, set[str]] = {}
        # The factors (prefill, decode) a computing worker's step runs at.
        self.factor_of: dict[str, tuple[float, float]] = {}

    @classmethod
    def of(cls, profile, workers_per_host: int | None, addresses: Sequence[str],
           background: float = 0.0) -> HostShare | None:
        """The host model when the profile is a shared-CPU one and the cluster says how many
        workers share a host; None otherwise (every worker owns its device)."""
        if not workers_per_host or getattr(profile, "host_cores", None) is None:
            return None
        return cls(profile, workers_per_host, addresses, background)

    def factor(self, host: int, extra: str | None = None) -> tuple[float, float]:
        """(a step with prefill tokens, a decode step): the factors on `host` now."""
        busy = self.busy.get(host, set())
        n = max(1, len(busy | {extra}) if extra is not None else len(busy))
        f = contention(n, self.threads, self.cores, self.slowdown, self.background)
        if not self.slowdown_decode:
            return f, f
        return f, contention(n, self.threads, self.cores, self.slowdown_decode, self.background)

    def profile_for(self, w):
        """The profile the step worker `w` starts now is timed with."""
        f = self.factor(self.host_of[w.address], w.address)
        self.factor_of[w.address] = f
        return self.profile if f == (1.0, 1.0) else Stretched(self.profile, *f)

    def sync(self, now: float, w, workers: dict) -> list[tuple[float, tuple[str, int]]]:
        """After `w` started or stopped computing: re-time the other computing workers on its
        host. Returns the step events to push, (time, (address, token)); older ones go stale."""
        host = self.host_of[w.address]
        busy = self.busy.setdefault(host, set())
        if w.busy == (w.address in busy):
            return []
        if w.busy:
            busy.add(w.address)
        else:
            busy.discard(w.address)
            self.factor_of.pop(w.address, None)
        new = self.factor(host)
        events = []
        for a in sorted(busy - {w.address}):
            o, old = workers[a], self.factor_of[a]
            if o.run is not None:
                end = o.cut_run(now)  # the next step is timed at its start
                if end is not None:
                    events.append((end, (a, o.token)))
                continue
            if new == old:
                continue
            kind = 1 if o.step is not None and o.step.prefill_tokens == 0 else 0
            o.step_end_s = now + (o.step_end_s - now) * new[kind] / old[kind]
            o.token += 1
            self.factor_of[a] = new
            events.append((o.step_end_s, (a, o.token)))
        return events
