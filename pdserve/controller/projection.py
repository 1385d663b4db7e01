"""Pressure seen ahead of time, as a pure core: the decode step each decode worker will run once
the requests now being prefilled reach it, and the SLO attainment an action would leave.

Owns:
- `StepModel`: one decode step's time from its batch and the KV it reads. Either a step profile's
  decode terms (`pdserve sim calibrate`, the shipped ones) scaled by one factor fitted online from
  the workers' own step times (the same shape on a host that is faster or slower), or, with no
  profile, a line in the batch fitted from those step times alone (`fit_step_model`).
- `arriving`: of the requests in flight at the prefill workers, those that reach the decode
  workers within the horizon: a backlog's tail reaches them only as fast as prefill lets it.
- `project`: each decode worker's batch once the requests arriving from the prefill workers
  join it (the router sends each to the least loaded decode worker: water-filling), or the batch
  the admitted decode work settles at when that is larger (`steady_batch`), and the step it
  will then take.
- `steady_batch`: the batch a decode worker settles at under a stream of decode work (W output
  tokens a second): a batch B emits B tokens a step, so it settles where B = W x step(B); for a
  line a + b x B that is B = W a / (1 - W b), and with W b >= 1 it never settles (the batch,
  and the step, grow while the work lasts). It rises the moment long answers are admitted, not
  once they have piled up, so the flip they call for starts seconds into a decode-heavy
  stretch.
- `attainment`: of the requests a set of batches and a prefill queue hold, the share a step time
  under the ITL SLO and a queue under the TTFT share would serve in time. The policy compares
  candidate actions (nothing, a flip, a migration) by it.

Must not do I/O, read a clock, draw random numbers or import torch, grpc or a service: the
controller's view and the simulator feed it the same samples and get the same projection.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from pdserve.core.step_profile import StepProfile

# Decode steps seen (batch, KV blocks in use, step seconds) kept for the online fit.
FIT_SAMPLES = 64
# Without a profile, a line needs this many samples over at least this spread of batch sizes.
FIT_MIN_SAMPLES = 4
FIT_MIN_SPREAD = 2
# The largest batch `steady_batch` looks at: decode work that no batch up to it keeps up with
# never settles, and the step is projected at this batch (far past any ITL SLO).
MAX_STEADY_BATCH = 512


@dataclass(frozen=True)
class StepModel:
    """`step_s(batch, kv_blocks)`: with `profile`, scale x its decode-only step; without,
    fixed_s + seq_s x batch + block_s x kv_blocks."""

    origin: str
    fixed_s: float = 0.0
    seq_s: float = 0.0
    block_s: float = 0.0
    profile: StepProfile | None = None
    block_tokens: int = 16  # tokens one KV block holds (the engine's block size)
    scale: float = 1.0

    def step_s(self, batch: float, kv_blocks: float = 0.0) -> float:
        if batch <= 0:
            return 0.0
        if self.profile is not None:
            ctx = int(max(0.0, kv_blocks) * self.block_tokens)
            return self.scale * self.profile.step_s(decode_batch=max(1, round(batch)),
                                                    decode_ctx=ctx, kv_read_tokens=ctx)
        return self.fixed_s + self.seq_s * batch + self.block_s * max(0.0, kv_blocks)


def fit_step_model(samples: Sequence[tuple[float, float, float]],
                   prior: StepModel | None = None) -> StepModel | None:
    """The model the `(batch, kv_blocks, step_s)` samples support, or None when they support
    none yet.

    - With a profile prior: its shape, scaled by the median of measured / predicted (one robust
      factor: a host, a core quota or a thread count that shifts every step alike).
    - Without: the least-squares line step = a + b x batch (a, b >= 0), once the samples span
      at least FIT_MIN_SPREAD batch sizes; KV blocks are not fitted (they move with the batch
      and would make the fit ill-posed on few samples).
    """
    good = [(b, k, s) for b, k, s in samples
            if b >= 1 and s > 0 and math.isfinite(s) and math.isfinite(b)]
    if prior is not None and prior.profile is not None:
        ratios = sorted(s / p for b, k, s in good
                        if (p := StepModel("", profile=prior.profile,
                                           block_tokens=prior.block_tokens).step_s(b, k)) > 0)
        if not ratios:
            return prior
        mid = len(ratios) // 2
        scale = ratios[mid] if len(ratios) % 2 else (ratios[mid - 1] + ratios[mid]) / 2
        return StepModel(f"{prior.origin}, scaled {scale:.2f} by {len(ratios)} steps",
                         profile=prior.profile, block_tokens=prior.block_tokens, scale=scale)
    if len(good) < FIT_MIN_SAMPLES:
        return prior
    xs = [b for b, _, _ in good]
    if max(xs) - min(xs) < FIT_MIN_SPREAD:
        return prior
    n = len(good)
    mx = sum(xs) / n
    my = sum(s for _, _, s in good) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = max(0.0, sum((x - mx) * (s - my) for x, (_, _, s) in zip(xs, good)) / sxx)
    fixed = max(0.0, my - slope * mx)
    return StepModel(f"fitted to {n} steps", fixed_s=fixed, seq_s=slope)


def spread_incoming(batches: Sequence[int], incoming: int) -> list[int]:
    """`batches` after `incoming` requests each joined the least loaded one (ties: the first),
    as the router's decode choice places them."""
    out = list(batches)
    if not out:
        return out
    for _ in range(max(0, incoming)):
        i = min(range(len(out)), key=lambda j: (out[j], j))
        out[i] += 1
    return out


def arriving(incoming: int, queue_s: float, horizon_s: float) -> int:
    """Of `incoming` requests at the prefill workers, whose queue clears in `queue_s` one after
    another, those that reach the decode workers within `horizon_s`: every one when the queue
    clears in time, else the share the pool gets through (rounded up). Counting a backlog whole
    would read a prefill bottleneck as decode pressure, and a prefill worker handed to decode
    for it would deepen the backlog that called for it."""
    if incoming <= 0:
        return 0
    if not queue_s > horizon_s:
        return incoming
    return min(incoming, math.ceil(incoming * max(0.0, horizon_s) / queue_s))


def steady_batch(tokens_per_s: float, model: StepModel, blocks_per_seq: float = 0.0) -> int:
    """The smallest batch B (1..MAX_STEADY_BATCH) that keeps up with `tokens_per_s` of decode
    work, B >= tokens_per_s x step(B), or MAX_STEADY_BATCH when none does; 0 with no work.
    A sequence holds `blocks_per_seq` KV blocks. Steps grow with the batch, so the first
    batch that keeps up is found by bisection."""
    if not tokens_per_s > 0:
        return 0

    def keeps_up(b: int) -> bool:
        return b >= tokens_per_s * model.step_s(b, b * blocks_per_seq)

    if not keeps_up(MAX_STEADY_BATCH):
        return MAX_STEADY_BATCH
    lo, hi = 1, MAX_STEADY_BATCH  # keeps_up(hi) holds
    while lo < hi:
        mid = (lo + hi) // 2
        if keeps_up(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


@dataclass(frozen=True)
class Projection:
    """Per decode worker (in the order given): its batch once the incoming requests arrived,
    and the step it will then take."""

    batches: tuple[int, ...]
    steps_s: tuple[float, ...]

    @property
    def worst_step_s(self) -> float:
        return max(self.steps_s, default=0.0)


def project(batches: Sequence[int], kv_blocks: Sequence[float], incoming: int,
            model: StepModel, tokens_per_s: float = 0.0) -> Projection:
    """The decode workers' steps once `incoming` requests (prefilling now) joined them, each
    batch raised to the one `tokens_per_s` of admitted decode work (shared evenly) settles at
    when that is larger. A worker's KV grows with its batch at its own blocks per sequence
    (the workers' mean for one with none running)."""
    after = spread_incoming(batches, incoming)
    running = sum(batches)
    mean_per_seq = sum(kv_blocks) / running if running else 0.0
    steady = (steady_batch(tokens_per_s / len(after), model, mean_per_seq)
              if after and tokens_per_s > 0 else 0)
    out, steps = [], []
    for b0, b1, kv in zip(batches, after, kv_blocks):
        per_seq = kv / b0 if b0 > 0 else mean_per_seq
        b = max(b1, steady)
        out.append(b)
        steps.append(model.step_s(b, kv + per_seq * (b - b0)))
    return Projection(tuple(out), tuple(steps))


def attainment(batches: Sequence[int], steps_s: Sequence[float], itl_s: float,
               queued_requests: int, queue_s: float, ttft_budget_s: float) -> float:
    """The share of requests served in time: those decoding on a worker whose step stays within
    `itl_s`, and of `queued_requests` waiting for prefill (the queue clears in `queue_s`, one
    request after another) those reached within `ttft_budget_s`. 1.0 with no request."""
    decoding = sum(batches)
    on_time = sum(b for b, s in zip(batches, steps_s) if s <= itl_s)
    queued = max(0, queued_requests)
    if queued:
        served = queued if queue_s <= ttft_budget_s else queued * ttft_budget_s / queue_s
        on_time += served
    total = decoding + queued
    return on_time / total if total else 1.0
