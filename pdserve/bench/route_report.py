"""What a person sees of `pdserve bench route`: a rich table, and the JSON + PNG files of --out.

Owns the layout: one row per policy (own-cache hit rate, with store hits, share of the ideal,
TTFT mean and p90 and mean vs round-robin, requests per worker, errors), then the ideal hit
rate and exact-LRU references, and the scale; the plot `route.png` (hit rates per policy beside
the ideal and the LRU references as lines, TTFT mean and p90 per policy). Must not compute figures: it reads the result document.
"""

from __future__ import annotations

import os
from typing import Any

from pdserve.output import write_json


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def _ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 1000:,.0f}"


def print_tables(result: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    ideal = result["ideal"]["hit_rate"]
    tr = result["trace"]
    t = Table(title=f"bench route: {tr['requests']} requests of the Mooncake conversation trace; "
                    f"{result['scale']['statement']}; "
                    f"{result['settings']['prefill_workers']} prefill workers x "
                    f"{result['settings']['num_blocks']} KV blocks")
    for col in ("policy", "own hit", "+store", "own/ideal", "TTFT ms", "p90 ms", "vs RR",
                "per worker", "err"):
        t.add_column(col, justify="left" if col == "policy" else "right")
    for name, r in result["policies"].items():
        vs = r.get("ttft_mean_vs_round_robin")
        t.add_row(name, _pct(r["local_hit_rate"]), _pct(r["total_hit_rate"]),
                  _pct(r.get("local_vs_ideal")), _ms(r["ttft_mean_s"]), _ms(r["ttft_p90_s"]),
                  "n/a" if vs is None else f"{vs:.2f}x",
                  "/".join(str(n) for n in r["requests_per_worker"]), str(r["errors"]))
    t.add_row("ideal", _pct(ideal), _pct(ideal), "100%", "", "", "", "", "")
    for blocks, rate in result["ideal"].get("lru_hit_rate_by_capacity_blocks", {}).items():
        t.add_row(f"one LRU, {int(blocks):,} blocks", _pct(rate), "", _pct(rate / ideal)
                  if ideal else "n/a", "", "", "", "", "")
    t.caption = (f"hit rate = prompt tokens reused / prompt tokens. own: from the worker's "
                 f"prefix cache; +store: also blocks fetched from the shared store; ideal: one "
                 f"unbounded cache; one LRU: an exact LRU cache of that many blocks (one worker's, all "
                 f"workers' together); TTFT mean and p90, mean vs round_robin. "
                 f"model: {result['model']}. trace: {tr['attribution']}")
    console.print(t)
    aim = result["aim"]
    if aim["met"] is not None:
        console.print(f"aim: kv_aware own-cache hit rate >= {aim['kv_aware_local_vs_ideal_min']:.0%}"
                      f" of ideal: {'met' if aim['met'] else 'not met'} "
                      f"({aim['kv_aware_local_vs_ideal']:.1%})")


def plot(result: dict[str, Any], path: str) -> None:
    from matplotlib.figure import Figure

    names = list(result["policies"])
    rows = [result["policies"][n] for n in names]
    ideal = result["ideal"]["hit_rate"]
    x = list(range(len(names)))
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    ax = fig.add_subplot(1, 2, 1)
    w = 0.38
    ax.bar([i - w / 2 for i in x], [r["local_hit_rate"] for r in rows], w, label="own cache")
    ax.bar([i + w / 2 for i in x], [r["total_hit_rate"] for r in rows], w,
           label="with store fetches")
    ax.axhline(ideal, color="k", linestyle=":", label=f"ideal (unbounded) {ideal:.1%}")
    for (blocks, rate), style in zip(
            result["ideal"].get("lru_hit_rate_by_capacity_blocks", {}).items(), ("--", "-.")):
        ax.axhline(rate, color="grey", linestyle=style,
                   label=f"one LRU of {int(blocks):,} blocks {rate:.1%}")
    ax.set_xticks(x, names, fontsize=8)
    ax.set_ylabel("prefix-cache hit rate (tokens)")
    ax.set_ylim(0, max(0.05, ideal * 1.25))
    ax.set_title("hit rate per routing policy", fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7)
    ax = fig.add_subplot(1, 2, 2)
    ax.bar([i - w / 2 for i in x], [1000 * (r["ttft_mean_s"] or 0) for r in rows], w, label="mean")
    ax.bar([i + w / 2 for i in x], [1000 * (r["ttft_p90_s"] or 0) for r in rows], w, label="p90")
    ax.set_xticks(x, names, fontsize=8)
    ax.set_ylabel("TTFT (ms, CPU)")
    ax.set_title("time to first token", fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7)
    fig.suptitle(f"Mooncake conversation trace, {result['trace']['requests']} requests; "
                 f"{result['scale']['statement']}", fontsize=9)
    fig.savefig(path, dpi=120)


def write_outputs(result: dict[str, Any], out_dir: str) -> list[str]:
    paths = [write_json(result, out_dir, "route.json"), os.path.join(out_dir, "route.png")]
    plot(result, paths[1])
    return paths
