"""The controller's view of the cluster: the router's signals turned into the policy's input.

Owns the conversion (no I/O, no clock reads: `now` and the router's answer come in): each
member becomes a `WorkerView` (state, load, KV use, measured prefill rate and decode step time
from the deltas of its cumulative counters), the step model fitted to the decode steps seen
(`projection.fit_step_model`, on a profile's shape when one is given), the admitted decode work
a second (`decode_work`) and each decode worker's projected step, the pool-wide pressures, and
the windowed SLO figures (TTFT and ITL p90, attainment). Must not call anything or decide
anything.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, replace

from pdserve.controller.policy import WorkerView
from pdserve.controller.projection import (FIT_SAMPLES, StepModel, arriving, fit_step_model,
                                          project)
from pdserve.core.roles import DECODE, DRAINING, FAILED, GONE, PREFILL, SERVING, SWITCHING
from pdserve.core.finish import COMPLETED
from pdserve.core.rates import RateMeter
from pdserve.controller.signals import (DecodePressure, PrefillPressure, Slo,
                                        attainment, decode_pressure, percentile,
                                        prefill_pressure)
from pdserve.proto import router_pb2 as rpb
from pdserve.wire import role_from_proto

_STATE_OF = {rpb.MEMBER_STATE_ACTIVE: SERVING, rpb.MEMBER_STATE_DRAINING: DRAINING,
             rpb.MEMBER_STATE_FAILED: FAILED, rpb.MEMBER_STATE_GONE: GONE}


@dataclass(frozen=True)
class Window:
    """Finished requests of the last window: SLO figures for people and the decode pressure."""

    requests: int
    attainment: float | None
    ttft_p90_s: float | None
    itl_p90_s: float | None


@dataclass(frozen=True)
class ClusterView:
    workers: tuple[WorkerView, ...]
    prefill: PrefillPressure
    decode: DecodePressure
    window: Window  # the status window (attainment, p90s for people)
    recent: Window  # the pressure window: short, so pressure ends soon after a burst does
    members: tuple  # the router's WorkerMember messages, by address order
    step_model: StepModel | None = None  # decode step time from batch and KV, when known
    decode_tokens_per_s: float = 0.0  # admitted decode work (`decode_work`)


class Meters:
    """Per-worker measured rates from cumulative counters (stateful, pure)."""

    def __init__(self) -> None:
        self.prefill = RateMeter()  # prompt tokens computed per busy second
        self.steps = RateMeter()  # decode steps per second of decode steps
        # (batch, KV blocks, mean step s) of decode workers' recent intervals, for the fit.
        self.step_samples: deque[tuple[float, float, float]] = deque(maxlen=FIT_SAMPLES)
        self._seen: dict[str, int] = {}  # decode steps counted at the last sample
        # (now, the routers' cumulative admitted max_tokens) at each view, for the work rate.
        self.admitted: deque[tuple[float, int]] = deque(maxlen=FIT_SAMPLES)
        self.work: tuple[float, float] | None = None  # (now, decode work) at the last view

    def admitted_rate(self, now: float, total: int, window_s: float) -> float:
        """max_tokens admitted a second over the last `window_s` (over what is seen when it is
        shorter; 0 before a second view). A total that fell (a router restarted) starts the
        count afresh."""
        if self.admitted and total < self.admitted[-1][1]:
            self.admitted.clear()
            self.work = None
        self.admitted.append((now, total))
        while len(self.admitted) > 2 and now - self.admitted[1][0] >= window_s:
            self.admitted.popleft()
        t0, c0 = self.admitted[0]
        return (total - c0) / (now - t0) if now > t0 else 0.0

    def observe(self, m) -> tuple[float | None, float | None]:
        if not m.HasField("stats"):
            return self.prefill.rate(m.address), None
        s = m.stats
        tps = self.prefill.observe(m.address, s.prompt_tokens_computed, s.busy_seconds)
        steps_per_s = self.steps.observe(m.address, s.decode_steps, s.decode_step_seconds)
        step_s = 1.0 / steps_per_s if steps_per_s else None
        # A sample per interval with new decode steps, at the batch the worker reports now.
        if step_s is not None and s.num_running > 0 and s.decode_steps > self._seen.get(
                m.address, 0):
            self.step_samples.append((float(s.num_running),
                                      float(s.num_total_blocks - s.num_free_blocks), step_s))
        self._seen[m.address] = s.decode_steps
        return tps, step_s


# ITL percentiles come from requests with at least this many tokens: a short request's one or
# two gaps are mostly the prefill -> decode hand-over, not the pace of a running decode.
ITL_MIN_TOKENS = 8


def used_share(samples) -> float:
    """Of the max_tokens recent completed requests were allowed, the share they used (1.0 with
    none to go by): answers that stop early decode less than their admission promised."""
    done = [s for s in samples if s.finish in COMPLETED and s.max_tokens > 0]
    allowed = sum(s.max_tokens for s in done)
    return min(1.0, sum(s.output_tokens for s in done) / allowed) if allowed else 1.0


def decode_work(signals: rpb.RouterSignals, meters: Meters, now: float,
                window_s: float) -> float:
    """Output tokens a second the admitted requests will decode: their max_tokens a second
    over the last `window_s`, times the share of max_tokens recent requests used; falling, no
    faster than by half each `window_s` (answers admitted before the window are still
    decoding, and a few arrivals a window make the windowed rate jump)."""
    rate = meters.admitted_rate(now, signals.admitted_output_tokens_total, window_s)
    work = rate * used_share(signals.samples) if rate > 0 else 0.0
    if meters.work is not None and now > meters.work[0]:
        t, held = meters.work
        work = max(work, held * 0.5 ** ((now - t) / window_s))
    meters.work = (now, work)
    return work


def window_of(samples, slo: Slo) -> Window:
    good = [s.finish in COMPLETED for s in samples]
    ok = [s for s, g in zip(samples, good) if g]
    # A request that failed met no SLO.
    pairs = [(s.ttft_s, s.tpot_s) if g else (math.inf, math.inf) for s, g in zip(samples, good)]
    tpots = [s.tpot_s for s in ok if s.output_tokens >= ITL_MIN_TOKENS]
    return Window(len(samples), attainment(pairs, slo),
                  percentile([s.ttft_s for s in ok], 90), percentile(tpots, 90))


def cluster_view(signals: rpb.RouterSignals, meters: Meters, slo: Slo, *,
                 pinned: frozenset[str] = frozenset(), switching: dict[str, str] | None = None,
                 last_flip_s: dict[str, float] | None = None,
                 pressure_window_s: float = 5.0,
                 step_prior: StepModel | None = None, now: float | None = None) -> ClusterView:
    """`now` (the controller's clock) times the admitted decode work; without it none is
    counted."""
    last_flip_s, switching = last_flip_s or {}, switching or {}
    members = tuple(sorted(signals.workers, key=lambda m: m.address))
    views = []
    for m in members:
        tps, step_s = meters.observe(m)
        state = _STATE_OF.get(m.state, GONE)
        if m.address in switching:
            state = SWITCHING
        s = m.stats if m.HasField("stats") else None
        views.append(WorkerView(
            address=m.address, role=role_from_proto(m.role) or PREFILL, state=state,
            to_role=switching.get(m.address),
            pinned=m.address in pinned, last_flip_s=last_flip_s.get(m.address),
            running=s.num_running if s else 0, waiting=s.num_waiting if s else 0,
            kv_used_blocks=(s.num_total_blocks - s.num_free_blocks) if s else 0,
            kv_total_blocks=s.num_total_blocks if s else 0,
            queued_prompt_tokens=m.in_flight_tokens, prefill_tokens_per_s=tps,
            decode_step_s=step_s, in_flight=m.in_flight))
    # A decode worker's own rate is of prompt tokens per second of decoding, not its prefill
    # speed: it is the same machine as a prefill worker, so it gets the prefill workers' mean.
    pre_rates = [v.prefill_tokens_per_s for v in views
                 if v.role == PREFILL and v.prefill_tokens_per_s]
    mean_rate = sum(pre_rates) / len(pre_rates) if pre_rates else None
    views = [v if v.role == PREFILL else replace(v, prefill_tokens_per_s=mean_rate)
             for v in views]
    window = window_of(list(signals.samples), slo)
    recent = window_of([x for x in signals.samples if x.age_s <= pressure_window_s], slo)
    live = [v for v in views if v.state in (SERVING, DRAINING, SWITCHING)]
    pre = [v for v in live if v.role == PREFILL]
    rates = [v.prefill_tokens_per_s for v in pre if v.prefill_tokens_per_s]
    # The pool's throughput is the sum of its workers' (each measured while busy).
    tps = sum(rates) * len(pre) / len(rates) if rates else None
    prefill = prefill_pressure(sum(v.queued_prompt_tokens for v in pre), tps, slo,
                               ttft_p90_s=recent.ttft_p90_s)
    dec = [v for v in live if v.role == DECODE and v.state == SERVING]
    # ITL now: finished requests report theirs only at the end (a long answer, a minute
    # later), so the busiest decode worker's measured step time counts too.
    steps = [v.decode_step_s for v in dec if v.decode_step_s and v.running > 0]
    itl_s = max([x for x in (recent.itl_p90_s, max(steps, default=None)) if x is not None],
                default=None)
    model = fit_step_model(list(meters.step_samples), step_prior)
    work = decode_work(signals, meters, now, pressure_window_s) if now is not None else 0.0
    projected_s = None
    if model is not None and dec:
        # The requests prefilling now (on prefill workers still serving) that the pool gets
        # through within the queue's SLO share join the decode workers: the step each will
        # then take.
        incoming = arriving(sum(v.in_flight for v in pre if v.state == SERVING),
                            prefill.work_s, slo.queue_budget_s)
        proj = project([v.running + v.waiting for v in dec],
                       [float(v.kv_used_blocks) for v in dec], incoming, model, work)
        by_address = dict(zip((v.address for v in dec), proj.steps_s))
        views = [replace(v, projected_step_s=by_address[v.address]) if v.address in by_address
                 else v for v in views]
        projected_s = proj.worst_step_s
    decode = decode_pressure(sum(v.kv_used_blocks for v in dec),
                             sum(v.kv_total_blocks for v in dec), itl_s,
                             sum(v.waiting for v in dec), sum(v.running for v in dec), slo,
                             projected_step_s=projected_s)
    return ClusterView(tuple(views), prefill, decode, window, recent, members, model, work)
