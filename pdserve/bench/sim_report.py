"""What `pdserve bench sim` shows: a table, the JSON, and a plot of the simulator's pace.

Owns the presentation of a `run_bench` result: the tables (one row per case; then the wall
seconds one simulated second took in each quarter of the run), `sim_bench.json`, and
`sim_bench.png`: wall seconds per simulated second along the run, per case, against the pace
the case's aim allows (the hour of 1,000 workers in 600 s; 100,000 requests in 60 s). Must not
measure: it reads the result.
"""

from __future__ import annotations

import os
from typing import Any

from pdserve.output import write_json
from pdserve.bench.sim import HOUR_S
# What each case's aim allows: the hour of 1,000 workers in 600 s of wall time; 100,000
# requests in 60 s.
HOUR_AIM_S, REQUESTS_AIM_S = 600.0, 60.0


def aim_pace(row: dict[str, Any]) -> float | None:
    """Wall seconds per simulated second the case's aim allows (the `100k` case's scaled to
    its number of requests), or None: no aim (`1000w` at another size than 1,000 workers)."""
    if row["case"] == "1000w" and row["workers"] == 1000:
        return HOUR_AIM_S / HOUR_S
    if row["case"] == "100k" and row["simulated_s"] > 0:
        return REQUESTS_AIM_S * row["requests"] / 100_000 / row["simulated_s"]
    return None


def pace_segments(pace: list[list[float]]) -> list[tuple[float, float, float]]:
    """(simulated start, simulated end, wall s per simulated s) between consecutive samples
    of `pace` ([simulated s, wall s, requests done], in order), skipping empty spans."""
    out = []
    prev_sim, prev_wall = 0.0, 0.0
    for sim_s, wall_s, _ in pace:
        if sim_s > prev_sim:
            out.append((prev_sim, sim_s, (wall_s - prev_wall) / (sim_s - prev_sim)))
            prev_sim, prev_wall = sim_s, wall_s
    return out


def print_tables(result: dict[str, Any], console) -> None:
    from rich.table import Table

    t = Table(title=f"pdserve bench sim ({result['profile']}, "
                    f"{result['machine']['cpus']} CPUs, "
                    f"{result['compiled_modules']} hot modules compiled)")
    for col in ("case", "requests", "workers", "simulated s", "wall s", "CPU s", "events",
                "steps", "events/s", "requests/s", "hour wall s (projected)"):
        t.add_column(col, justify="right")
    for r in result["rows"]:
        proj = r.get("projected_hour_wall_s")
        t.add_row(r["case"], f"{r['requests']:,}", str(r["workers"]),
                  f"{r['simulated_s']:.0f}", f"{r['wall_s']:.1f}", f"{r['cpu_s']:.1f}",
                  f"{r['events']:,}", f"{r['steps']:,}", f"{r['events_per_s']:,.0f}",
                  f"{r['requests_per_s']:,.0f}", "-" if proj is None else f"{proj:,.0f}")
    console.print(t)
    p = Table(title="pace: wall seconds per simulated second")
    for col in ("case", "1st quarter", "2nd", "3rd", "4th", "whole run", "the aim's"):
        p.add_column(col, justify="right")
    for r in result["rows"]:
        aim = aim_pace(r)
        p.add_row(r["case"], *(f"{q:.3f}" for q in r["quarters_wall_per_sim_s"]),
                  f"{r['wall_s'] / max(r['simulated_s'], 1e-9):.3f}",
                  "-" if aim is None else f"{aim:.3f}")
    console.print(p)
    ran, of = (int(x) for x in result["compiled_modules"].split("/"))
    if ran < of:
        console.print(f"{of - ran} of the {of} hot modules ran interpreted: `bash "
                      f"scripts/compile.sh` compiles them (the same decisions, faster; the "
                      f"aims were measured compiled).")


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, axes = plt.subplots(len(rows), 1, figsize=(9, 3.2 * len(rows)), squeeze=False)
    for ax, r in zip(axes[:, 0], rows):
        segs = pace_segments(r["pace"])
        if segs:
            xs = [s[0] for s in segs] + [segs[-1][1]]
            ys = [s[2] for s in segs] + [segs[-1][2]]
            ax.step(xs, ys, where="post", label="wall s per simulated s")
        ax.axhline(r["wall_s"] / max(r["simulated_s"], 1e-9), color="black", linestyle="--",
                   label=f"mean ({r['wall_s']:.0f} s wall for {r['simulated_s']:.0f} s)")
        aim = aim_pace(r)
        if aim is not None:
            what = (f"aim: the hour in {HOUR_AIM_S:.0f} s" if r["case"] == "1000w"
                    else f"aim: 100,000 requests in {REQUESTS_AIM_S:.0f} s")
            ax.axhline(aim, color="green", linestyle=":", label=what)
        ax.set_ylim(bottom=0)
        ax.set_title(f"{r['case']}: {r['requests']:,} requests, {r['workers']} workers, "
                     f"{r['events_per_s']:,.0f} events/s", fontsize=10)
        ax.set_ylabel("wall s / simulated s")
        ax.legend(fontsize=8, loc="lower right")
    axes[-1, 0].set_xlabel("simulated seconds")
    fig.suptitle(f"bench sim: the simulator's pace ({result['machine']['cpus']} CPUs, "
                 f"{result['compiled_modules']} hot modules compiled)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(result: dict[str, Any], out_dir: str) -> list[str]:
    j, png = write_json(result, out_dir, "sim_bench.json"), os.path.join(out_dir, "sim_bench.png")
    plot(result, png)
    return [j, png]
