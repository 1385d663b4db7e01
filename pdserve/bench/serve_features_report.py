"""`pdserve bench serve --workload structured|tools|n4` as tables on a console, and as
summary.json + bench_serve_<workload>.png.

Owns the presentation only: per concurrency each variant's output tokens/s and TTFT (means over
their passes), the ratio with/without and the TTFT difference with their spread over the pairs
of passes; every pass's own figures; the aims beside the figures they judge; for several
choices the workers' prompt tokens per request and the KV figures derived from them; the
notes. The plot: bars of output tokens/s per level with and without (each pass a dot), TTFT at
each level, and for several choices the prompt tokens computed per request on each role.
Must not compute figures: the result document carries them all.
"""

from __future__ import annotations

import os
from typing import Any

from pdserve.output import write_json

WITHOUT, WITH = "without", "with"  # serve_features_summary's variants


def _f(x: float | None, fmt: str = "{:.1f}", scale: float = 1.0) -> str:
    return "-" if x is None else fmt.format(x * scale)


def _ms(x: float | None) -> str:
    return _f(x, "{:.1f}", 1000.0)


def _each(sp: dict[str, Any], fmt: str, scale: float = 1.0) -> str:
    """Every pair's value of a spread, in pass order."""
    return ", ".join(_f(x, fmt, scale) for x in sp["each"]) or "-"


def _value(aim: dict[str, Any]) -> str:
    v = aim["value"]
    if v is None:
        return "-"
    return f"{v * 1000:+.1f} ms" if aim["unit"] == "s" else f"{v:.3f}x"


def print_tables(result: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    w = result["workload"]
    pairs = len(result["passes"]) // 2
    console.print(f"{result['model']}: {w['name']} ({w['feature']}) against without; "
                  f"{w['requests']} requests x {w['max_tokens']} tokens per level, passes "
                  f"{', '.join(w['order'])}", highlight=False)
    t = Table(title="output tokens/s")
    t.caption = (f"w/o: without the feature, a mean over its passes; with/w/o: the geometric "
                 f"mean over the {pairs} pair(s) of passes of each pair's ratio, and each "
                 f"pair's")
    for col in ("c", "w/o", "with", "with/w/o", "each pair", "failed w/o, with"):
        t.add_column(col, justify="right")
    for row in result["by_level"]:
        wo, wi = row[WITHOUT], row[WITH]
        t.add_row(str(row["concurrency"]), _f(wo["tokens_per_s"]), _f(wi["tokens_per_s"]),
                  _f(row["tokens_ratio"]["mean"], "{:.3f}"),
                  _each(row["tokens_ratio"], "{:.3f}"), f"{wo['failed']}, {wi['failed']}")
    console.print(t)
    t = Table(title="TTFT (ms)")
    t.caption = "p50 and mean of each pass, means over the passes; diff: with - w/o per pair"
    for col in ("c", "p50 w/o", "p50 with", "p50 diff", "each pair", "mean w/o",
                "mean with", "mean diff"):
        t.add_column(col, justify="right")
    for row in result["by_level"]:
        wo, wi = row[WITHOUT], row[WITH]
        t.add_row(str(row["concurrency"]), _ms(wo["ttft_p50_s"]), _ms(wi["ttft_p50_s"]),
                  _f(row["ttft_p50_diff_s"]["mean"], "{:+.1f}", 1000.0),
                  _each(row["ttft_p50_diff_s"], "{:+.1f}", 1000.0), _ms(wo["ttft_mean_s"]),
                  _ms(wi["ttft_mean_s"]), _f(row["ttft_mean_diff_s"]["mean"], "{:+.1f}",
                                             1000.0))
    console.print(t)
    per = Table(title="every pass (ms for latencies)")
    for col in ("pass", "variant", "c", "tok/s", "TTFT p50", "TTFT mean", "ok", "failed",
                "prompt tok", "load"):
        per.add_column(col, justify="right")
    for i, p in enumerate(result["passes"], 1):
        for lv in p["levels"]:
            prompts = lv["prompt_tokens_each"]
            per.add_row(str(i), p["variant"], str(lv["concurrency"]), _f(lv["tokens_per_s"]),
                        _ms(lv["ttft_p50_s"]), _ms(lv["ttft_mean_s"]), str(lv["ok"]),
                        str(lv["failed"]),
                        _f(sum(prompts) / len(prompts) if prompts else None),
                        _f(lv["loadavg_1m_start"], "{:.2f}"))
    console.print(per)
    if "choices" in result:
        print_choices(result["choices"], console)
    aims = Table(title="aims")
    for col in ("figure", "measured", "each pair", "aim", "met"):
        aims.add_column(col, justify="right" if col != "figure" else "left")
    for a in result["aims"]:
        met = "-" if a["met"] is None else ("[green]yes[/]" if a["met"] else "[red]no[/]")
        each = ", ".join(_value({**a, "value": x}) for x in a.get("each") or ()) or "-"
        aims.add_row(a["figure"], _value(a), each, a["aim"], met)
    console.print(aims)
    for a in result["aims"]:
        if a.get("note"):
            console.print(f"[yellow]{a['figure']}[/]: {a['note']}")
    for note in result["notes"]:
        console.print(f"note: {note}")
    for i, p in enumerate(result["passes"], 1):
        for lv in p["levels"]:
            for e in lv["errors"]:
                console.print(f"[red]pass {i} ({p['variant']}) c{lv['concurrency']}[/]: "
                              f"{e['count']} x {e['error']}")
    m, c = result["machine"], result["cluster"]
    console.print(f"{m['cpu_count']} cores ({m['platform']}); cluster ready in "
                  f"{c['start_s']:.1f} s, {c['rss_bytes'] / 2**30:.2f} GiB resident at the end; "
                  f"load average {m['loadavg_1m_start']:.2f} at the start, "
                  f"{m['loadavg_1m_end']:.2f} at the end; {result['seconds']:.0f} s")


def print_choices(kv: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    t = Table(title=f"n={kv['n']} against n=1: the workers' prompt tokens per request")
    t.caption = (f"tail: prompt tokens each follower computed ((both with n={kv['n']} - both "
                 f"with n=1) / {kv['n'] - 1}); shared: tokens it took from the decode worker's prefix "
                 f"cache; KV blocks (B = "
                 f"{kv['block_size_tokens']}): (ceil(L/B) + {kv['n'] - 1} x ceil(tail/B)) / "
                 f"ceil(L/B), mean over the requests' prompt lengths L")
    for col in ("", "requests", "prefill computed", "decode computed", "both",
                "decode cache hits"):
        t.add_column(col, justify="right")
    for v, label in ((WITHOUT, "n=1"), (WITH, f"n={kv['n']}")):
        x = kv[v]
        t.add_row(label, str(x["requests"]), _f(x["prefill"]), _f(x["decode"]),
                  _f(x["computed"]), _f(x["hits"]))
    console.print(t)
    console.print(
        f"per follower: tail {_f(kv['tail_tokens'])} tokens computed (expected "
        f"{_f(kv.get('expected_tail_tokens'))}), {_f(kv['shared_tokens'])} from the cache; "
        f"prompt {_f(kv['prompt_tokens_mean'])} tokens on average; prefill n={kv['n']} / n=1 "
        f"{_f(kv['prefill_ratio'], '{:.3f}')}; prompt-part KV blocks "
        f"{_f(kv['block_ratio'], '{:.3f}')}x one sequence's (expected "
        f"{_f(kv.get('expected_block_ratio'), '{:.3f}')}x; all requests' blocks summed: "
        f"{_f(kv['block_ratio_pooled'], '{:.3f}')}x, expected "
        f"{_f(kv.get('expected_block_ratio_pooled'), '{:.3f}')}x)", highlight=False)


def write_outputs(result: dict[str, Any], out_dir: str) -> list[str]:
    """summary.json and bench_serve_<workload>.png in `out_dir`; the paths written."""
    from matplotlib.figure import Figure

    json_path = write_json(result, out_dir, "summary.json")
    png_path = os.path.join(out_dir, f"bench_serve_{result['workload']['name']}.png")
    rows = result["by_level"]
    kv = result.get("choices")
    fig = Figure(figsize=(13 if kv else 9, 4.2), layout="constrained")
    axes = fig.subplots(1, 3 if kv else 2)
    tput, ttft = axes[0], axes[1]
    x = list(range(len(rows)))
    width = 0.38
    names = ({WITHOUT: "n=1", WITH: f"n={kv['n']}"} if kv else
             {WITHOUT: "without the feature", WITH: "with the feature"})
    for off, v, colour in ((-width / 2, WITHOUT, "tab:gray"), (width / 2, WITH, "tab:blue")):
        tput.bar([i + off for i in x], [r[v]["tokens_per_s"] or 0 for r in rows], width,
                 color=colour, label=f"{names[v]} (mean)")
        ttft.bar([i + off for i in x], [(r[v]["ttft_p50_s"] or 0) * 1000 for r in rows], width,
                 color=colour, label=f"{names[v]} (mean of the passes' p50)")
        for i, r in enumerate(rows):  # each pass's own figure, so a slowed pass shows
            tput.plot([i + off] * len(r[v]["tokens_per_s_each"]), r[v]["tokens_per_s_each"],
                      "k.", markersize=5)
            ttft.plot([i + off] * len(r[v]["ttft_p50_s_each"]),
                      [t * 1000 for t in r[v]["ttft_p50_s_each"]], "k.", markersize=5)
    for i, r in enumerate(rows):  # the ratio over each level's pair of bars
        top = max(r[v]["tokens_per_s"] or 0 for v in (WITHOUT, WITH))
        tput.annotate(_f(r["tokens_ratio"]["mean"], "{:.2f}x"), (i, top), xytext=(0, 4),
                      textcoords="offset points", ha="center", fontsize=8)
    for ax, title, ylabel in ((tput, "output tokens/s (dots: each pass)", "tokens/s"),
                              (ttft, "TTFT p50 (dots: each pass)", "ms")):
        ax.set_xticks(x, [str(r["concurrency"]) for r in rows])
        ax.set_xlabel("concurrency")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, axis="y", alpha=0.3)
        ax.margins(y=0.15)
        ax.legend(fontsize=8)
    if kv:
        ax = axes[2]
        keys = ("prefill", "decode", "hits")
        xs = list(range(len(keys)))
        for off, v, colour, label in ((-width / 2, WITHOUT, "tab:gray", "n=1"),
                                      (width / 2, WITH, "tab:blue", f"n={kv['n']}")):
            ax.bar([i + off for i in xs], [kv[v][k] or 0 for k in keys], width, color=colour,
                   label=label)
        ax.set_xticks(xs, ["prefill\ncomputed", "decode\ncomputed", "decode\ncache hits"])
        ax.set_ylabel("prompt tokens per request")
        ax.set_title(f"KV blocks {_f(kv['block_ratio'], '{:.2f}')}x one sequence's")
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    m = result["machine"]
    aims = "; ".join(f"{a['figure']}: {_value(a)} (aim {a['aim']})" for a in result["aims"])
    fig.suptitle(f"pdserve bench serve --workload {result['workload']['name']}: "
                 f"{result['model']}, {m['cpu_count']} cores\n{aims}", fontsize=9)
    fig.savefig(png_path, dpi=110)
    return [json_path, png_path]
