"""The figures of `pdserve bench serve`, computed from what a run recorded: pure functions.

Owns the per-level client figures (output tokens/s, TTFT and inter-token latency percentiles,
requests ok and failed), reading Prometheus text into sample totals and differencing two
scrapes, the per-hop breakdown of one token's time from those differences, and the comparison
rows (serving against the engine's own decode rate, pdserve against a baseline server).
Must not read a clock, open a socket or start anything: callers pass the recorded values in.

Definitions (those of vLLM's `benchmark_serving`): TTFT is the time from sending a request to
its first streamed chunk with text; ITL is the gap between two successive chunks with text of
one request; TPOT is a request's (end - first chunk) / (output tokens - 1). Output tokens/s
counts the tokens of the requests that completed, over the level's wall time (first request
sent to last one ended). A request completed when it ended without an error and with the
tokens it asked for.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from pdserve.core.stats import percentile  # noqa: F401 - re-exported


def _mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def completed(row: Mapping[str, Any]) -> bool:
    """A request that ended without an error and with every token it asked for."""
    return row["error"] is None and row["output_tokens"] == row["expected_tokens"]


def level_figures(rows: Sequence[Mapping[str, Any]], wall_s: float) -> dict[str, Any]:
    """One level's client-side figures from its request rows.

    Each row: `error` (None or text), `output_tokens` (tokens received), `expected_tokens`,
    `ttft_s` (None before a first chunk), `chunk_times_s` (arrival of every chunk with text,
    from the request's send), `e2e_s`."""
    if wall_s <= 0:
        raise ValueError(f"wall_s must be > 0, got {wall_s}")
    ok = [r for r in rows if completed(r)]
    ttft = [r["ttft_s"] for r in ok]
    gaps = [b - a for r in ok for a, b in zip(r["chunk_times_s"], r["chunk_times_s"][1:])]
    tpot = [(r["chunk_times_s"][-1] - r["chunk_times_s"][0]) / (r["output_tokens"] - 1)
            for r in ok if r["output_tokens"] > 1 and r["chunk_times_s"]]
    tokens = sum(r["output_tokens"] for r in ok)
    chunks = sum(len(r["chunk_times_s"]) for r in ok)
    errors: dict[str, int] = {}
    for r in rows:
        if not completed(r):
            why = r["error"] or f"{r['output_tokens']} of {r['expected_tokens']} tokens"
            errors[why] = errors.get(why, 0) + 1
    return {
        "requests": len(rows), "ok": len(ok), "failed": len(rows) - len(ok),
        "output_tokens": tokens, "wall_s": wall_s, "tokens_per_s": tokens / wall_s,
        "ttft_p50_s": percentile(ttft, 50), "ttft_p90_s": percentile(ttft, 90),
        "ttft_mean_s": _mean(ttft),
        "itl_p50_s": percentile(gaps, 50), "itl_p90_s": percentile(gaps, 90),
        "itl_mean_s": _mean(gaps), "tpot_mean_s": _mean(tpot),
        "tokens_per_chunk": tokens / chunks if chunks else None,
        "e2e_p50_s": percentile([r["e2e_s"] for r in ok], 50),
        "errors": [{"error": k, "count": v} for k, v in sorted(errors.items())],
    }


# ---- Prometheus scrapes ---------------------------------------------------------------------
def sample_totals(text: str) -> dict[str, float]:
    """Prometheus text -> {sample name: value summed over its labels} (histogram buckets
    dropped; `_sum`, `_count` and counters' `_total` kept as exposed)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.endswith("_bucket") or s.name.endswith("_created"):
                continue
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def diff(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """after - before per sample (a sample absent before counts from 0)."""
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def _ratio(num: float | None, den: float | None) -> float | None:
    if num is None or not den:
        return None
    return num / den


ROUTER_ITL = "pdserve:inter_token_latency_seconds"
ROUTER_TTFT = "pdserve:time_to_first_token_seconds"
ENGINE_BUSY = "pdserve:engine_busy_seconds_total"
ENGINE_STEP = "pdserve:decode_step_seconds"  # the workers' histogram of decode steps
WORKER_HOP = "pdserve:worker_to_router_seconds"  # the router's histogram of that hop
MISSING = {
    "engine_step": "the workers' /metrics have no decode-step metric (only "
                   "pdserve:engine_busy_seconds_total over all steps): the mean step comes from "
                   "GetStats' decode_steps and decode_step_seconds",
    "worker_to_router": "no metric times a token's trip from the decode worker to the router "
                        "(the messages carry no send time): this hop is the router's mean "
                        "inter-token gap minus the engine's mean decode step",
    "router_to_client": "the router's HTTP layer keeps no metric (its ITL histogram is "
                        "observed in the gRPC service, before the HTTP layer renders its "
                        "chunk): this hop is the client's mean TPOT minus the router's mean "
                        "inter-token gap",
}


def hop_breakdown(router: Mapping[str, float], workers: Sequence[Mapping[str, Any]],
                  client: Mapping[str, Any]) -> dict[str, Any]:
    """One token's time, in seconds, split into hops from one level's metric differences.

    `router`: the router's /metrics difference; `workers`: per worker `{"role", "metrics"
    (its /metrics difference), "stats" (GetStats difference: decode_steps,
    decode_step_seconds) or None}`; `client`: this level's `level_figures`. A hop no metric
    measures is None, with the reason in `missing`."""
    missing: list[str] = []
    step_s = source = None
    hist_n = sum(w["metrics"].get(ENGINE_STEP + "_count", 0.0) for w in workers)
    if hist_n > 0:
        step_s = sum(w["metrics"].get(ENGINE_STEP + "_sum", 0.0) for w in workers) / hist_n
        source = f"/metrics {ENGINE_STEP}"
    else:
        steps = sum((w["stats"] or {}).get("decode_steps", 0) for w in workers)
        if steps > 0:
            step_s = sum((w["stats"] or {}).get("decode_step_seconds", 0.0)
                         for w in workers) / steps
            source = "GetStats decode_step_seconds / decode_steps"
        missing.append(MISSING["engine_step"])
    decode = [w for w in workers if w["role"] == "decode"]
    busy = sum(w["metrics"].get(ENGINE_BUSY, 0.0) for w in decode)
    router_itl = _ratio(router.get(ROUTER_ITL + "_sum"), router.get(ROUTER_ITL + "_count"))
    router_ttft = _ratio(router.get(ROUTER_TTFT + "_sum"), router.get(ROUTER_TTFT + "_count"))
    client_tpot = client.get("tpot_mean_s")

    def minus(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else a - b

    hop_s = _ratio(router.get(WORKER_HOP + "_sum"), router.get(WORKER_HOP + "_count"))
    if hop_s is not None:
        hop = {"hop": "worker -> router", "seconds": hop_s, "source": f"/metrics {WORKER_HOP}"}
    else:
        missing.append(MISSING["worker_to_router"])
        hop = {"hop": "worker -> router", "seconds": minus(router_itl, step_s),
               "source": "router ITL mean - engine step"}
    missing.append(MISSING["router_to_client"])
    hops = [
        {"hop": "engine step", "seconds": step_s, "source": source},
        hop,
        {"hop": "router -> client", "seconds": minus(client_tpot, router_itl),
         "source": "client TPOT mean - router ITL mean"},
    ]
    return {
        "hops": hops, "engine_step_s": step_s, "router_itl_mean_s": router_itl,
        "client_tpot_mean_s": client_tpot, "router_ttft_mean_s": router_ttft,
        "client_ttft_mean_s": client.get("ttft_mean_s"),
        "decode_engine_busy_s": busy,
        "decode_engine_busy_fraction": _ratio(busy, client["wall_s"] * max(1, len(decode))),
        "missing": missing,
    }


# ---- comparisons ----------------------------------------------------------------------------
def engine_rate(batch_size: int, new_tokens: int, decode_s: Iterable[float]) -> dict[str, Any]:
    """The engine's decode figures at one batch size from repeated timed runs (median)."""
    times = sorted(decode_s)
    if not times or times[0] <= 0:
        raise ValueError(f"decode_s must be positive times, got {times}")
    med = percentile(times, 50)
    return {"batch_size": batch_size, "decode_s": times, "median_s": med,
            "tokens_per_s": batch_size * new_tokens / med, "step_s": med / new_tokens}


def comparison(levels: Sequence[Mapping[str, Any]], engine: Mapping[int, Mapping[str, Any]],
               baselines: Mapping[str, Sequence[Mapping[str, Any]]]) -> list[dict[str, Any]]:
    """Per pdserve level: its tokens/s next to the engine's at the same batch size (serving /
    engine), its ITL p50 over the engine's step, and each baseline's tokens/s (pdserve / it)."""
    rows = []
    for lv in levels:
        c = lv["concurrency"]
        e = engine.get(lv.get("batch_size", c))
        row: dict[str, Any] = {
            "concurrency": c, "pdserve_tokens_per_s": lv["tokens_per_s"],
            "engine_tokens_per_s": e["tokens_per_s"] if e else None,
            "serving_over_engine": _ratio(lv["tokens_per_s"], e["tokens_per_s"] if e else None),
            "itl_p50_over_engine_step": _ratio(lv["itl_p50_s"], e["step_s"] if e else None),
        }
        for name, blevels in baselines.items():
            b = next((x for x in blevels if x["concurrency"] == c), None)
            row[f"{name}_tokens_per_s"] = b["tokens_per_s"] if b else None
            row[f"pdserve_over_{name}"] = _ratio(lv["tokens_per_s"],
                                                 b["tokens_per_s"] if b else None)
        rows.append(row)
    return rows
