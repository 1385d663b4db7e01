"""What a simulation produced: per-request times, roles over time, counts, and the summary a
capacity planner reads.

Owns `SimReport`: per-request records (arrival, time to first token, end, tokens, workers,
status), held as columns (arrays of numbers, lists of shared strings; the ids are read from the
trace when written), so a run of a million requests keeps tens of bytes for each; the role
timeline, counts (flips, seconds spent draining and switching, running decodes moved with
their KV and the bytes that took, events, steps, rejections), each moved decode's stall,
`summary()` (mean/p50/p90/p99 of TTFT, ITL per request as AIPerf defines it: (e2e - ttft) /
(output tokens - 1), and e2e; SLO attainment; goodput; worker-hours) and `to_json()`,
byte-identical for the same inputs (wall time is kept apart, in `wall_s`, and never written by
`to_json`). Must not simulate.
"""

from __future__ import annotations

import json
import math
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pdserve.core.stats import percentile

OK = "ok"
NONE = math.nan  # in `ttft_s` and `end_s`: no first token, did not finish


def _dist(values: Sequence[float]) -> dict:
    if not values:
        return {"n": 0, "mean": None, "p50": None, "p90": None, "p99": None}
    return {"n": len(values), "mean": sum(values) / len(values),
            "p50": percentile(values, 50), "p90": percentile(values, 90),
            "p99": percentile(values, 99)}


def _none_for_nan(values: array) -> list[float | None]:
    return [None if x != x else x for x in values]


@dataclass
class SimReport:
    config: dict
    profile: str
    requests: Sequence[Any] = ()  # the trace: request ids are read from it by `to_dict`
    arrival_s: array = field(default_factory=lambda: array("d"))
    prompt_tokens: array = field(default_factory=lambda: array("q"))
    output_tokens: array = field(default_factory=lambda: array("q"))
    ttft_s: array = field(default_factory=lambda: array("d"))  # NONE: no first token
    end_s: array = field(default_factory=lambda: array("d"))  # NONE: did not finish
    status: list[str] = field(default_factory=list)  # "ok", "rejected: <reason>", "unfinished"
    prefill_worker: list[str] = field(default_factory=list)  # "" when none
    decode_worker: list[str] = field(default_factory=list)
    roles: list[tuple[float, int, int, int]] = field(default_factory=list)  # t, P, D, flipping
    counts: dict = field(default_factory=dict)
    # Each moved request's stall: its last token on one decode worker to its first on the next.
    migration_stall_s: array = field(default_factory=lambda: array("d"))
    slo_ttft_s: float = 2.0
    slo_itl_s: float = 0.2
    workers: int = 0
    wall_s: float = 0.0  # not part of to_json: it differs run to run

    def itl_s(self, i: int) -> float | None:
        """AIPerf's inter-token latency of request i: (e2e - ttft) / (output tokens - 1)."""
        ttft, end, out = self.ttft_s[i], self.end_s[i], self.output_tokens[i]
        if ttft != ttft or end != end or out < 2:
            return None
        return (end - self.arrival_s[i] - ttft) / (out - 1)

    def done(self) -> list[int]:
        """Indices of the requests that finished."""
        return [i for i, s in enumerate(self.status) if s == OK]

    def summary(self) -> dict:
        done = self.done()
        ttft = array("d", (self.ttft_s[i] for i in done))
        e2e = array("d", (self.end_s[i] - self.arrival_s[i] for i in done))
        itl, met = array("d"), 0
        for i, first in zip(done, ttft):
            x = self.itl_s(i)
            if x is not None:
                itl.append(x)
            met += first <= self.slo_ttft_s and (x is None or x <= self.slo_itl_s)
        n = len(self.status)
        first_s = min(self.arrival_s, default=0.0)
        last = max([e for e in self.end_s if e == e] or [first_s])
        span = max(1e-9, last - first_s)
        return {
            "requests": n, "finished": len(done),
            "rejected": sum(1 for s in self.status if s.startswith("rejected")),
            "ttft_s": _dist(ttft), "itl_s": _dist(itl), "e2e_s": _dist(e2e),
            "slo": {"ttft_s": self.slo_ttft_s, "itl_s": self.slo_itl_s},
            "slo_attainment": met / n if n else None,
            "goodput_rps": met / span, "throughput_rps": len(done) / span,
            "duration_s": span, "workers": self.workers,
            "worker_hours": self.workers * span / 3600.0,
            "migration_stall_s": _dist(self.migration_stall_s),
            **{k: self.counts[k] for k in sorted(self.counts)},
        }

    def to_dict(self, requests: bool = True) -> dict:
        out = {"config": self.config, "profile": self.profile, "summary": self.summary(),
               "roles": [list(r) for r in self.roles]}
        if requests:
            out["requests"] = {
                "id": [r.request_id for r in self.requests],
                "arrival_s": self.arrival_s.tolist(),
                "prompt_tokens": self.prompt_tokens.tolist(),
                "output_tokens": self.output_tokens.tolist(),
                "ttft_s": _none_for_nan(self.ttft_s), "end_s": _none_for_nan(self.end_s),
                "status": self.status, "prefill_worker": self.prefill_worker,
                "decode_worker": self.decode_worker}
        return out

    def to_json(self, requests: bool = True) -> str:
        return json.dumps(self.to_dict(requests), sort_keys=True, separators=(",", ":"))
