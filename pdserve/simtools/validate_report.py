"""What `pdserve sim validate` shows: the error table, validate.json and validate.png.

Owns the presentation: per run (a configuration, with a routing policy where several were run)
and metric (TTFT, ITL per request, e2e), real and simulated mean/p50/p90/p99 and the relative
error, with the scale factors in the title; with several runs, their ranking on both sides; the
plot draws both distributions (CDFs) per run and metric. Must not measure.
"""

from __future__ import annotations

import json
import os
from typing import Any

from pdserve.simtools.validate_compare import METRICS, STATS

LABELS = {"ttft_s": "TTFT", "itl_s": "ITL (per request)", "e2e_s": "e2e latency"}


def scale_text(doc: dict[str, Any]) -> str:
    sc = doc["scale"]
    return (f"scale: prompts / {sc['token_scale']} (mean {sc['mean_prompt_tokens']:.0f} tokens), "
            f"arrivals x{sc['arrival_speedup']:.3g} ({sc['rate_rps']} req/s), outputs <= "
            f"{sc['max_tokens']}, {sc['requests']} requests{_emulated_text(doc)}")


def _emulated_text(doc: dict[str, Any]) -> str:
    st = doc.get("settings", {})
    if st.get("engine") != "emulated":
        return ""
    slow = st.get("slowdown", 1.0)
    return (f"; emulated {st['profile']}" + (f", every step x{slow:g}" if slow != 1 else "")
            + f", KV x{st['kv_scale']:.3g}")


def _f(x: float | None, pct: bool = False) -> str:
    if x is None:
        return "-"
    return f"{100 * x:+.0f}%" if pct else f"{x * 1e3:.0f}"


def print_table(doc: dict[str, Any], console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    con = console or Console(width=120)
    for run in doc["runs"]:
        real = run["real"]
        t = Table(title=(f"sim validate {_label(run)}: real cluster vs simulator (ms); "
                         f"{scale_text(doc)}; load avg {real['loadavg_1m_start']:.2f}"))
        for col in ("metric", "stat", "real ms", "sim ms", "error"):
            t.add_column(col, justify="left" if col in ("metric", "stat") else "right")
        for m in METRICS:
            c = run["compare"][m]
            for k in STATS:
                t.add_row(LABELS[m] if k == "mean" else "", k, _f(c[k]["real"]),
                          _f(c[k]["sim"]), _f(c[k]["error"], pct=True))
        con.print(t)
        given = run.get("compare_given")
        if given:
            con.print(f"{_label(run)} with the profile's own step constants: mean error " +
                      ", ".join(f"{LABELS[m]} {_f(given[m]['mean']['error'], pct=True)}"
                                for m in METRICS))
    print_rankings(doc, con)
    con.print(f"profile: {doc['profile_origin']}")


def _label(run: dict[str, Any]) -> str:
    return run.get("label", run["config"])


def print_rankings(doc: dict[str, Any], con) -> None:
    from rich.table import Table

    ranks = doc.get("rankings") or {}
    if not ranks:
        return
    t = Table(title=(f"ranking, best first (pairs the real cluster separates by more than "
                     f"{100 * ranks['tie']:.0f}%)"))
    for col in ("metric", "real", "simulator", "pairs", "ordered otherwise"):
        t.add_column(col)
    for key, r in ranks.items():
        if key == "tie":
            continue
        m, k = key.split(".")
        t.add_row(f"{LABELS[m]} {k}", " < ".join(r["real"]), " < ".join(r["sim"]),
                  str(r["pairs"]), "; ".join(" < ".join(w) for w in r["wrong"]) or "none")
    con.print(t)


def plot(doc: dict[str, Any], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = doc["runs"]
    fig, axes = plt.subplots(len(runs), len(METRICS), figsize=(4.2 * len(METRICS),
                                                                 3.2 * len(runs)), squeeze=False)
    for row, run in zip(axes, runs):
        for ax, m in zip(row, METRICS):
            for side, style in (("real", "-"), ("sim", "--")):
                xs = sorted(run[side][m])
                if xs:
                    ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], style, where="post",
                            label=side)
            err = run["compare"][m]["mean"]["error"]
            ax.set_title(f"{_label(run)} {LABELS[m]}: mean error "
                         f"{_f(err, pct=True)}", fontsize=9)
            ax.set_xlabel("seconds")
            ax.set_ylabel("CDF")
            ax.legend(fontsize=8)
    fig.suptitle(scale_text(doc), fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.3 / (3.2 * len(runs))))  # room for the title
    fig.savefig(path, dpi=80 if len(runs) > 4 else 110)
    plt.close(fig)


def write_outputs(doc: dict[str, Any], out_dir: str) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    jpath, ppath = (os.path.join(out_dir, "validate.json"),
                    os.path.join(out_dir, "validate.png"))
    with open(jpath, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
    plot(doc, ppath)
    return [jpath, ppath]
