"""The figures of `pdserve bench serve --workload structured|tools|n4`: pure functions.

Owns the order of the passes (without the feature, with it, with, without, ...: pairs whose
order flips each time, so a drift of the shared machine hits both alike), the workers' counters
of one level read from two scrapes, the comparison per concurrency (each variant's output
tokens/s and TTFT over its passes; per pair the tokens/s ratio with/without and the TTFT
difference; their mean and spread), the several-choices figures (prompt tokens computed per
request on each role, the followers' share of the prompt, and the KV blocks the choices hold
for the prompt part against one sequence's), and each workload's aims judged on those.
Must not read a clock, open a socket or start anything: callers pass the recorded values in.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

WITHOUT, WITH = "without", "with"
COMPUTED = "pdserve:prompt_tokens_computed_total"  # a worker's, per its /metrics
HITS = "pdserve:prefix_cache_hits_total"
QUERIES = "pdserve:prefix_cache_queries_total"
COUNTERS = {COMPUTED: "prompt_tokens_computed", HITS: "prefix_cache_hits",
            QUERIES: "prefix_cache_queries"}
ROLES = ("prefill", "decode")

AIM_TOKENS_RATIO = 0.90  # structured outputs cost at most 10% of output tokens/s ...
AIM_TOKENS_CONCURRENCY = 32  # ... at concurrency 32
AIM_TTFT_DIFF_S = 0.005  # and at most 5 ms of TTFT for a cached schema (at concurrency 1)
AIM_PREFILL_RATIO = 1.0  # one prefill per request, whatever n (the followers add none)
PREFILL_TOLERANCE = 0.01
AIM_BLOCK_RATIO = 1.3  # the choices' prompt-part KV blocks over one sequence's


def pass_order(pairs: int) -> list[str]:
    """The variant of each pass: without, with, with, without, ... (`pairs` pairs)."""
    if pairs < 1:
        raise ValueError(f"pairs must be >= 1, got {pairs}")
    out: list[str] = []
    for i in range(pairs):
        out += [WITHOUT, WITH] if i % 2 == 0 else [WITH, WITHOUT]
    return out


def _mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def spread(xs: Sequence[float], geometric: bool = False) -> dict[str, Any]:
    """Mean (geometric for ratios: a pair at half and one at double average to 1), each
    value, smallest, largest and sample standard deviation (None below two values)."""
    mean = _mean(xs)
    if geometric and xs:
        mean = statistics.geometric_mean(xs) if min(xs) > 0 else None
    return {"mean": mean, "kind": "geometric" if geometric else "arithmetic", "each": list(xs),
            "min": min(xs) if xs else None, "max": max(xs) if xs else None,
            "stdev": statistics.stdev(xs) if len(xs) > 1 else None}


def worker_counters(before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, Any]:
    """Per role, the workers' prompt tokens computed and prefix-cache hits and queries between
    two `serve_probe.scrape`s (the role each worker had at the second), and whether any worker
    changed role in between (then the split by role is not the level's)."""
    old = {w["address"]: w for w in before["workers"]}
    out: dict[str, Any] = {r: {name: 0.0 for name in COUNTERS.values()} for r in ROLES}
    changed = []
    for w in after["workers"]:
        b = old.get(w["address"], {"metrics": {}, "role": None})
        if b["role"] != w["role"]:
            changed.append(w["address"])
        if w["role"] not in out:
            continue
        for metric, name in COUNTERS.items():
            out[w["role"]][name] += w["metrics"].get(metric, 0.0) - b["metrics"].get(metric, 0.0)
    out["roles_changed"] = changed
    return out


def _level(passes: Sequence[Mapping[str, Any]], i: int, c: int) -> Mapping[str, Any] | None:
    return next((lv for lv in passes[i]["levels"] if lv["concurrency"] == c), None)


def _variant(levels: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    def each(key: str) -> list[float]:
        return [lv[key] for lv in levels if lv.get(key) is not None]
    prompts = [p for lv in levels for p in lv.get("prompt_tokens_each") or ()]
    return {"passes": len(levels), "tokens_per_s": _mean(each("tokens_per_s")),
            "tokens_per_s_each": each("tokens_per_s"),
            "ttft_p50_s": _mean(each("ttft_p50_s")), "ttft_p50_s_each": each("ttft_p50_s"),
            "ttft_mean_s": _mean(each("ttft_mean_s")),
            "failed": sum(lv["failed"] for lv in levels),
            "prompt_tokens_mean": _mean(prompts)}


def compare(passes: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per concurrency: each variant's mean figures over its passes; per pair of passes (1-2,
    3-4, ...) the output tokens/s ratio with/without and the TTFT differences with - without
    (p50 and mean, seconds); and their spread over the pairs (the ratios' geometric mean)."""
    levels = [lv["concurrency"] for lv in passes[0]["levels"]]
    rows = []
    for c in levels:
        at = {v: [lv for i, p in enumerate(passes) if p["variant"] == v
                  for lv in [_level(passes, i, c)] if lv is not None] for v in (WITHOUT, WITH)}
        ratios, p50, mean = [], [], []
        for i in range(0, len(passes) - 1, 2):
            by = {passes[j]["variant"]: _level(passes, j, c) for j in (i, i + 1)}
            w, wo = by.get(WITH), by.get(WITHOUT)
            if not w or not wo:
                continue
            if wo["tokens_per_s"]:
                ratios.append(w["tokens_per_s"] / wo["tokens_per_s"])
            if w["ttft_p50_s"] is not None and wo["ttft_p50_s"] is not None:
                p50.append(w["ttft_p50_s"] - wo["ttft_p50_s"])
            if w["ttft_mean_s"] is not None and wo["ttft_mean_s"] is not None:
                mean.append(w["ttft_mean_s"] - wo["ttft_mean_s"])
        rows.append({"concurrency": c, WITHOUT: _variant(at[WITHOUT]), WITH: _variant(at[WITH]),
                     "tokens_ratio": spread(ratios, geometric=True),
                     "ttft_p50_diff_s": spread(p50),
                     "ttft_mean_diff_s": spread(mean)})
    return rows


def _at(rows: Sequence[Mapping[str, Any]], c: int, pick) -> tuple[Mapping[str, Any], str | None]:
    """The row at concurrency `c`, else `pick(rows)` with a note saying which was used."""
    row = next((r for r in rows if r["concurrency"] == c), None)
    if row is not None:
        return row, None
    row = pick(rows)
    return row, f"no concurrency {c} level: judged at {row['concurrency']}"


def _aim(figure: str, value: float | None, unit: str, aim: str, met: bool | None,
         **more: Any) -> dict[str, Any]:
    return {"figure": figure, "value": value, "unit": unit, "aim": aim, "met": met, **more}


def speed_aims(rows: Sequence[Mapping[str, Any]], what: str) -> list[dict[str, Any]]:
    """Output tokens/s with/without at c32 >= 0.90 (geometric mean over the pairs) and the
    TTFT p50 difference at c1 <= 5 ms (mean over the pairs); each pair's value kept beside;
    each at the nearest level there is."""
    hi, hi_note = _at(rows, AIM_TOKENS_CONCURRENCY, lambda rs: rs[-1])
    lo, lo_note = _at(rows, 1, lambda rs: rs[0])
    ratio = hi["tokens_ratio"]["mean"]
    diff = lo["ttft_p50_diff_s"]["mean"]
    return [
        _aim(f"output tokens/s {what} / without, c{hi['concurrency']}", ratio, "x",
             f">= {AIM_TOKENS_RATIO:.2f}", None if ratio is None else ratio >= AIM_TOKENS_RATIO,
             concurrency=hi["concurrency"], each=hi["tokens_ratio"]["each"], note=hi_note),
        _aim(f"TTFT p50 {what} - without, c{lo['concurrency']}", diff, "s",
             f"<= {AIM_TTFT_DIFF_S * 1000:.0f} ms",
             None if diff is None else diff <= AIM_TTFT_DIFF_S,
             concurrency=lo["concurrency"], each=lo["ttft_p50_diff_s"]["each"], note=lo_note),
    ]


def _role_sum(levels: Sequence[Mapping[str, Any]], role: str, name: str) -> float:
    return sum(lv["counters"][role][name] for lv in levels)


def choices_kv(passes: Sequence[Mapping[str, Any]], n: int,
               block_size: int) -> dict[str, Any]:
    """Several choices' prefill and KV figures, from the workers' counters over every level of
    every pass (each request sent with a fresh cache salt, so nothing was cached before it).

    Per request and variant: prompt tokens computed on the prefill role (`prefill`), on the
    decode role (`decode`) and on both (`computed`), and prefix-cache hit tokens on the decode
    role (`hits`). One prefill per request: `prefill` with n choices is at most `prefill`
    with one (less when the controller moved part of a prompt's prefill onto a decode
    worker: those tokens are then in `decode`). The n - 1 followers each compute
    `tail = (computed[n] - computed[1]) / (n - 1)` prompt tokens (both roles, so a prefill
    moved between roles cancels) and take `shared = (hits[n] - hits[1]) / (n - 1)` from the
    decode worker's prefix cache (the leader's full prompt blocks, held by reference). The
    prompt-part KV blocks the choices hold, over one sequence's, per request of prompt length
    L (the usage's) and block size B: (ceil(L / B) + (n - 1) * ceil(tail / B)) / ceil(L / B);
    `block_ratio` is its mean over the requests, `block_ratio_pooled` the same with every
    request's blocks summed first. `expected_*`: the same when each follower computes only
    the prompt's last partial block (the tokens after the last full block before the last
    prompt token: a follower computes at least one token to sample from)."""
    if n < 2 or block_size < 1:
        raise ValueError(f"n must be >= 2 and block_size >= 1, got {n}, {block_size}")
    per: dict[str, dict[str, Any]] = {}
    for v in (WITHOUT, WITH):
        levels = [lv for p in passes if p["variant"] == v for lv in p["levels"]]
        reqs = sum(lv["requests"] for lv in levels)
        per[v] = {"requests": reqs,
                  "roles_changed": sorted({a for lv in levels
                                           for a in lv["counters"]["roles_changed"]})}
        for key, role, name in (("prefill", "prefill", "prompt_tokens_computed"),
                                ("decode", "decode", "prompt_tokens_computed"),
                                ("hits", "decode", "prefix_cache_hits")):
            per[v][key] = _role_sum(levels, role, name) / reqs if reqs else None
        per[v]["computed"] = per[v]["prefill"] + per[v]["decode"] if reqs else None
    w, wo = per[WITH], per[WITHOUT]
    out: dict[str, Any] = {"n": n, "block_size_tokens": block_size, WITHOUT: wo, WITH: w,
                           "prefill_ratio": None, "tail_tokens": None, "shared_tokens": None,
                           "block_ratio": None, "block_ratio_pooled": None}
    if wo["prefill"]:
        out["prefill_ratio"] = w["prefill"] / wo["prefill"]
    if w["requests"] and wo["requests"]:
        out["tail_tokens"] = max(0.0, (w["computed"] - wo["computed"]) / (n - 1))
        out["shared_tokens"] = (w["hits"] - wo["hits"]) / (n - 1)
    lengths = [p for pa in passes if pa["variant"] == WITH for lv in pa["levels"]
               for p in lv.get("prompt_tokens_each") or ()]
    out["prompt_tokens_mean"] = _mean(lengths)
    if not lengths:
        return out
    blocks = [math.ceil(L / block_size) for L in lengths]
    out["expected_tail_tokens"] = _mean([L - block_size * ((L - 1) // block_size)
                                         for L in lengths])
    # Such a tail is 1 to B tokens: one block per follower.
    out["expected_block_ratio"] = _mean([1 + (n - 1) / b for b in blocks])
    out["expected_block_ratio_pooled"] = 1 + (n - 1) * len(blocks) / sum(blocks)
    if out["tail_tokens"] is not None:
        tail_blocks = math.ceil(out["tail_tokens"] / block_size)
        out["block_ratio"] = _mean([1 + (n - 1) * tail_blocks / b for b in blocks])
        out["block_ratio_pooled"] = 1 + (n - 1) * tail_blocks * len(blocks) / sum(blocks)
    return out


def choices_aims(kv: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One prefill per request (prefill-role prompt tokens per request with n choices at most
    those with one, within 1%) and the choices' prompt-part KV blocks (mean over the
    requests) at most 1.3x one sequence's."""
    pr, br = kv["prefill_ratio"], kv["block_ratio"]
    return [
        _aim(f"prefill-worker prompt tokens per request, n={kv['n']} / n=1", pr, "x",
             f"<= {AIM_PREFILL_RATIO:.2f}",
             None if pr is None else pr <= AIM_PREFILL_RATIO + PREFILL_TOLERANCE),
        _aim(f"prompt-part KV blocks of {kv['n']} choices / one sequence's", br, "x",
             f"<= {AIM_BLOCK_RATIO}", None if br is None else br <= AIM_BLOCK_RATIO),
    ]
