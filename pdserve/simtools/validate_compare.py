"""How far the simulator is from a measured cluster (pure): per run, the relative error of each
metric's statistics; across runs (static splits, routing policies), whether both sides rank them
the same way.

Owns the statistics compared (mean, p50, p90, p99 of TTFT, ITL per request and end-to-end
latency), the error (simulated - real) / real, and the ranking check: for every pair of runs
whose real values differ by more than a tie margin, does the simulator order them the same way
(a pair the real cluster cannot tell apart is a tie, and either order is right). Must not
measure, simulate or present.
"""

from __future__ import annotations

import itertools
from typing import Any

from pdserve.core.stats import percentile

METRICS = ("ttft_s", "itl_s", "e2e_s")
STATS = ("mean", "p50", "p90", "p99")
RANKED = ("mean", "p90")  # the statistics whose ranking across runs is checked
RANK_TIE = 0.05  # real values closer than this (relative to the larger) are a tie


def stats(values: list[float]) -> dict[str, float | None]:
    if not values:
        return dict.fromkeys(STATS)
    return {"mean": sum(values) / len(values), "p50": percentile(values, 50),
            "p90": percentile(values, 90), "p99": percentile(values, 99)}


def compare(real: dict[str, list], sim: dict[str, list]) -> dict[str, dict[str, Any]]:
    """Per metric and statistic: real, simulated and (sim - real) / real."""
    out: dict[str, dict[str, Any]] = {}
    for m in METRICS:
        r, s = stats(real[m]), stats(sim[m])
        out[m] = {k: {"real": r[k], "sim": s[k],
                      "error": None if not r[k] or s[k] is None else (s[k] - r[k]) / r[k]}
                  for k in STATS}
    return out


def ranking(values: dict[str, tuple[float, float]], tie: float = RANK_TIE) -> dict[str, Any]:
    """`values`: run label -> (real, simulated), lower is better. Both orders (best first), the
    pairs the real side separates by more than `tie`, and those the simulator orders the other
    way (or calls equal)."""
    real_order = sorted(values, key=lambda k: values[k][0])
    sim_order = sorted(values, key=lambda k: values[k][1])
    pairs, wrong = 0, []
    for a, b in itertools.combinations(values, 2):
        (ra, sa), (rb, sb) = values[a], values[b]
        if abs(ra - rb) <= tie * max(ra, rb):
            continue
        pairs += 1
        if (ra < rb) != (sa < sb) or sa == sb:
            wrong.append([a, b] if ra < rb else [b, a])  # [better, worse] as measured
    return {"real": real_order, "sim": sim_order, "pairs": pairs, "wrong": wrong,
            "same": not wrong}


def rankings(runs: list[dict[str, Any]], tie: float = RANK_TIE) -> dict[str, Any]:
    """The ranking of the runs (their `label`s) per metric and ranked statistic; {} with fewer
    than two runs."""
    if len(runs) < 2:
        return {}
    out: dict[str, Any] = {"tie": tie}
    for m in METRICS:
        for k in RANKED:
            vals = {r["label"]: (r["compare"][m][k]["real"], r["compare"][m][k]["sim"])
                    for r in runs}
            if all(None not in v for v in vals.values()):
                out[f"{m}.{k}"] = ranking(vals, tie)
    return out
