"""The arithmetic of `pdserve bench fluid`'s report across repeated runs.

Owns, from each configuration's run records: the mean and spread (min..max) of SLO attainment
overall and per phase, the best static split in hindsight (overall and per phase), each
controller configuration's gain over that split and over the default split with "within
spread" where the gain does not exceed the spread, the flip-back delay, and the token check's
totals. Pure: records in, a summary out. Must not run anything or read files.

Spread of a comparison: the larger of the two configurations' min..max ranges; a gain whose
size is no more than that is "within spread" (host noise could make it). One run has no spread:
every gain is reported as it is and `within_spread` is None.
"""

from __future__ import annotations

from typing import Any


def stats(values: list[float | None]) -> dict[str, Any]:
    """Mean, min, max and spread (max - min) of the values given (None left out), and how
    many there were; all None when none."""
    xs = [x for x in values if x is not None]
    if not xs:
        return {"mean": None, "min": None, "max": None, "spread": None, "n": 0}
    return {"mean": sum(xs) / len(xs), "min": min(xs), "max": max(xs),
            "spread": max(xs) - min(xs), "n": len(xs)}


def flip_back_delay(flips: list[dict[str, Any]], decode_from_s: float | None) -> float | None:
    """Seconds from `decode_from_s` (the decode-heavy stretch's start) to the start of the first
    successful flip toward decode at or after it; None where there is no such edge or flip."""
    if decode_from_s is None:
        return None
    starts = [f["start_s"] for f in flips
              if f["ok"] and f["to"] == "decode" and f["start_s"] >= decode_from_s]
    return min(starts) - decode_from_s if starts else None


def compare(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Configuration `a`'s attainment stats against `b`'s: the gain in points (mean minus
    mean), the comparison's spread in points, and whether the gain is within it."""
    if a["mean"] is None or b["mean"] is None:
        return {"points": None, "spread_points": None, "within_spread": None}
    gain, spread = a["mean"] - b["mean"], max(a["spread"], b["spread"])
    one_run = a["n"] < 2 and b["n"] < 2
    return {"points": round(100 * gain, 1), "spread_points": round(100 * spread, 1),
            "within_spread": None if one_run else abs(gain) <= spread + 1e-9}


def _best(per_config: dict[str, Any], names: list[str], part: str) -> str | None:
    """The name among `names` with the highest mean attainment in `part` (the first on ties)."""
    scored = [(per_config[n]["attainment"][part]["mean"], -i, n) for i, n in enumerate(names)
              if per_config[n]["attainment"][part]["mean"] is not None]
    return max(scored)[2] if scored else None


def summarize(runs: dict[str, list[dict[str, Any]]], phases: list[str], *,
              static: list[str], default: str, decode_from_s: float | None) -> dict[str, Any]:
    """`runs`: per configuration its run records (each with `overall`, `phases`, `flips`,
    `decodes_moved`, `flip_log` and `tokens`); `static` names the configurations without a
    controller; `default` is the split the controller configurations start from."""
    parts = ["overall", *phases]
    per: dict[str, Any] = {}
    for name, recs in runs.items():
        per[name] = {
            "runs": len(recs),
            "attainment": {p: stats([(r["overall"] if p == "overall" else r["phases"][p])
                                     ["slo_attainment"] for r in recs]) for p in parts},
            "goodput_rps": stats([r["overall"]["goodput_rps"] for r in recs]),
            "flips": stats([r["flips"] for r in recs]),
            "decodes_moved": stats([r["decodes_moved"] for r in recs]),
            "flip_back_delay_s": stats([flip_back_delay(r["flip_log"], decode_from_s)
                                        for r in recs]),
            "token_mismatches": sum(r["tokens"]["mismatches"] for r in recs),
            "tokens_compared": sum(r["tokens"]["compared"] for r in recs),
        }
    statics = [n for n in runs if n in static]
    best = {p: _best(per, statics, p) for p in parts}
    gains: dict[str, Any] = {}
    for name in runs:
        if name in static:
            continue
        g: dict[str, Any] = {}
        for p in parts:
            mine = per[name]["attainment"][p]
            g[p] = {"vs_best_static": None if best[p] is None else {
                        "against": best[p], **compare(mine, per[best[p]]["attainment"][p])},
                    "vs_default": None if default not in per else {
                        "against": default, **compare(mine, per[default]["attainment"][p])}}
        gains[name] = g
    return {"per_config": per, "best_static": best, "gains": gains,
            "decode_from_s": decode_from_s,
            "token_mismatches": sum(v["token_mismatches"] for v in per.values()),
            "tokens_compared": sum(v["tokens_compared"] for v in per.values())}
