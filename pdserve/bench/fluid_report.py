"""Tables and the PNG of `pdserve bench fluid` (attainment and roles over time per config).

Owns presentation only. Must not measure anything.
"""

from __future__ import annotations

import os
from typing import Any

from rich.table import Table

from pdserve.output import write_json


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1000 * x:.0f}"


def print_tables(result: dict[str, Any], console: Any) -> None:
    s = result["settings"]
    t = Table(title=f"bench fluid: {result['requests']['prefill']} prefill-heavy then "
                    f"{result['requests']['decode']} decode-heavy requests; SLO TTFT "
                    f"{s['ttft_slo_ms']:.0f} ms, ITL {s['itl_slo_ms']:.0f} ms; "
                    f"cpu quota per worker: {s['cpu_quota']}")
    for col in ("config", "phase", "SLO met", "goodput r/s", "TTFT p50/p90 ms",
                "ITL p50/p90 ms", "errors", "flips", "drain s"):
        t.add_column(col)
    for name, r in result["runs"].items():
        for part in ("prefill", "decode", "overall"):
            f = r[part]
            t.add_row(name if part == "prefill" else "", part, _pct(f["slo_attainment"]),
                      "-" if f["goodput_rps"] is None else f"{f['goodput_rps']:.2f}",
                      f"{_ms(f['ttft_p50_s'])}/{_ms(f['ttft_p90_s'])}",
                      f"{_ms(f['itl_p50_s'])}/{_ms(f['itl_p90_s'])}", str(f["errors"]),
                      str(r["flips"]) if part == "overall" else "",
                      f"{r['drain_seconds']:.1f}" if part == "overall" else "")
    console.print(t)
    console.print(f"aims: {result['aims']}")
    console.print(f"engine check: {result['engine_mismatches']} of {result['engine_checked']} "
                  "differ from the in-process engine")


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    bin_s = max(5.0, result["settings"]["phase_s"] / 6)
    for name, r in result["runs"].items():
        tl = r["timeline"]
        if tl:
            a2.step([x[0] for x in tl], [x[1] for x in tl], where="post", label=name)
        bins: dict[int, list[bool]] = {}
        for t, met in r["met_by_arrival"]:
            bins.setdefault(int(t // bin_s), []).append(met)
        xs = sorted(bins)
        a1.plot([(k + 0.5) * bin_s for k in xs],
                [100 * sum(bins[k]) / len(bins[k]) for k in xs], marker="o", label=name)
    a1.set_ylabel(f"SLO attainment (%), by arrival, {bin_s:.0f} s bins")
    a1.axvline(result["settings"]["phase_s"], color="grey", linestyle=":")
    a1.legend(fontsize=8)
    a2.axvline(result["settings"]["phase_s"], color="grey", linestyle=":")
    a2.set_xlabel("seconds (dotted: prefill-heavy -> decode-heavy)")
    a2.set_ylabel("prefill workers serving")
    a2.legend(fontsize=8)
    fig.suptitle("bench fluid: static splits vs the controller")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(result: dict[str, Any], out_dir: str) -> list[str]:
    j, png = write_json(result, out_dir, "fluid.json"), os.path.join(out_dir, "fluid.png")
    plot(result, png)
    return [j, png]
