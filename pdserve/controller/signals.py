"""Pressure signals for the controller: raw counters in, ratios against the SLO out.

Owns the SLO (`Slo`), the two pressure indices the policy compares (`PrefillPressure`,
`DecodePressure`: 1.0 means "at the limit the SLO allows"), the percentile and SLO attainment
arithmetic. Measured rates come from `pdserve.core.rates.RateMeter`.

Must not do I/O, read a clock, draw random numbers or import torch, grpc or a service: the
controller's service and the simulator both feed it numbers and get numbers back, so the two
measure pressure the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from pdserve.core.stats import percentile  # noqa: F401 - re-exported


@dataclass(frozen=True)
class Slo:
    """Latency targets. Defaults are sized for SmolLM2-135M in fp32 on a 2-core CPU."""

    ttft_s: float = 2.0  # time to first token
    itl_s: float = 0.2  # inter-token latency (TPOT)
    # Share of the TTFT SLO the prefill queue may take before the prefill role counts as
    # pressured: the rest is left for the prefill itself and the KV hand-off.
    ttft_share: float = 0.5

    def __post_init__(self) -> None:
        for name in ("ttft_s", "itl_s"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number > 0, got {value}")
        if not 0 < self.ttft_share <= 1:
            raise ValueError(f"ttft_share must be in (0, 1], got {self.ttft_share}")

    @property
    def queue_budget_s(self) -> float:
        """The seconds the prefill queue may take: `ttft_share` of the TTFT SLO."""
        return self.ttft_share * self.ttft_s


@dataclass(frozen=True)
class PrefillPressure:
    work_s: float  # queued uncached prompt tokens / prefill tokens per second
    ratio: float  # work_s / (ttft_share x ttft_s): 1.0 = the queue takes its whole SLO share
    queued_tokens: float
    tokens_per_s: float  # the rate used: measured, or the fallback when none was measured
    measured: bool = True  # False when tokens_per_s is the fallback guess
    queue_ratio: float = 0.0  # work_s against the TTFT share
    ttft_ratio: float = 0.0  # recent TTFT p90 / TTFT SLO (0 with no recent samples)


@dataclass(frozen=True)
class DecodePressure:
    ratio: float  # max of the three parts below
    kv_occupancy: float  # used / total KV blocks over serving decode workers (0..1)
    kv_ratio: float  # kv_occupancy / kv_high_water
    itl_ratio: float  # windowed ITL p90 / ITL SLO (0 when no samples)
    waiting_ratio: float  # waiting / max(running, waiting_floor) (0 when none waiting)
    # The worst decode worker's projected step (once the requests prefilling now arrived) /
    # ITL SLO (0 without a projection).
    projected_ratio: float = 0.0


def prefill_pressure(queued_tokens: float, tokens_per_s: float | None, slo: Slo,
                     fallback_tokens_per_s: float = 1000.0,
                     ttft_p90_s: float | None = None) -> PrefillPressure:
    """How long the queued prefill work takes at the measured rate, against the TTFT share;
    or, when worse, the recent TTFT p90 against the TTFT SLO.

    The queue term sees a burst before any request of it finishes; the TTFT term sees what the
    queue term cannot: time a request spends outside the engine's prefill steps (the hop, the
    store writes, queueing in front of the worker), which dominates for small models.
    With no usable measurement (None, zero or negative: nothing prefilled yet) the rate is
    `fallback_tokens_per_s`, and the result says so (`measured=False`).
    """
    if not fallback_tokens_per_s > 0:
        raise ValueError(f"fallback_tokens_per_s must be > 0, got {fallback_tokens_per_s}")
    # The router's in-flight estimate is a float sum of adds and subtracts: it can drift a hair
    # below zero when the queue empties. There is no negative work.
    queued = max(0.0, float(queued_tokens))
    measured = tokens_per_s is not None and tokens_per_s > 0
    rate = float(tokens_per_s) if measured else float(fallback_tokens_per_s)
    work_s = queued / rate
    queue_ratio = work_s / slo.queue_budget_s
    ttft_ratio = max(0.0, ttft_p90_s) / slo.ttft_s if ttft_p90_s is not None else 0.0
    return PrefillPressure(work_s, max(queue_ratio, ttft_ratio), queued, rate, measured,
                           queue_ratio, ttft_ratio)


def decode_pressure(kv_used_blocks: int, kv_total_blocks: int, itl_p90_s: float | None,
                    waiting: int, running: int, slo: Slo,
                    kv_high_water: float = 0.9, waiting_floor: int = 4,
                    projected_step_s: float | None = None) -> DecodePressure:
    """The decode role's pressure: the worst of KV occupancy, ITL, the admission queue and the
    projected step.

    - KV: occupancy over `kv_high_water`; past the high water a decode worker soon has to
      preempt or refuse, so 1.0 is set there rather than at a full pool.
    - ITL: the windowed p90 over the ITL SLO (0 with no samples: nothing is decoding).
    - waiting: `waiting / max(running, waiting_floor)`. At 1.0 as many requests wait for
      admission as run, so a newly queued one waits about one whole generation of the running
      batch before its first decode step: TTFT is then set by the decode pool, not the prefill
      pool. The floor keeps a request or two that arrived between two steps of a small batch
      (they wait one step, not a generation) from reading as pressure.
    - projected: the worst decode worker's step once the requests prefilling now joined it,
      over the ITL SLO: the ITL a burst of answers will meet, seen before it is measured.
    """
    if not 0 < kv_high_water <= 1:
        raise ValueError(f"kv_high_water must be in (0, 1], got {kv_high_water}")
    occupancy = min(1.0, max(0, kv_used_blocks) / kv_total_blocks) if kv_total_blocks > 0 else 0.0
    kv_ratio = occupancy / kv_high_water
    itl_ratio = max(0.0, itl_p90_s) / slo.itl_s if itl_p90_s is not None else 0.0
    if waiting_floor < 1:
        raise ValueError(f"waiting_floor must be >= 1, got {waiting_floor}")
    waiting_ratio = max(0, waiting) / max(running, waiting_floor) if waiting > 0 else 0.0
    projected = max(0.0, projected_step_s) / slo.itl_s if projected_step_s is not None else 0.0
    return DecodePressure(max(kv_ratio, itl_ratio, waiting_ratio, projected), occupancy,
                          kv_ratio, itl_ratio, waiting_ratio, projected)


def attainment(samples: Sequence[tuple[float, float]], slo: Slo) -> float | None:
    """Share of (ttft_s, tpot_s) samples meeting both SLOs (goodput's numerator, as in
    DistServe), or None for no samples."""
    if not samples:
        return None
    met = sum(1 for ttft_s, tpot_s in samples if ttft_s <= slo.ttft_s and tpot_s <= slo.itl_s)
    return met / len(samples)


