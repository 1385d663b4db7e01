"""Tables and PNGs of `pdserve bench fluid`: attainment per configuration with its spread over
the runs, the gains of the controller configurations, and their roles over time.

Owns presentation only (the arithmetic is `fluid_summary`'s). Must not measure anything.
"""

from __future__ import annotations

import os
from typing import Any

from rich.table import Table

from pdserve.output import write_json


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _att(st: dict[str, Any]) -> str:
    """Mean and min..max of an attainment stat."""
    if st["mean"] is None:
        return "-"
    if st["n"] < 2:
        return _pct(st["mean"])
    return f"{_pct(st['mean'])} ({100 * st['min']:.0f}..{100 * st['max']:.0f})"


def _num(st: dict[str, Any], unit: str = "") -> str:
    if st["mean"] is None:
        return "-"
    if st["n"] < 2 or st["spread"] == 0:
        return f"{st['mean']:.1f}{unit}"
    return f"{st['mean']:.1f}{unit} ({st['min']:.1f}..{st['max']:.1f})"


def _gain(g: dict[str, Any] | None) -> str:
    if g is None or g["points"] is None:
        return "-"
    note = {True: ", within spread", False: "", None: ", 1 run"}[g["within_spread"]]
    return f"{g['points']:+.1f} vs {g['against']}{note}"


def _parts(result: dict[str, Any]) -> list[str]:
    return ["overall", *[p["name"] for p in result["workload"]["phases"]]]


def _cluster(s: dict[str, Any]) -> str:
    if s.get("emulated"):
        slow = f" x{s['slowdown']:g}" if s["slowdown"] != 1 else ""
        return f"{s['emulated']} emulated workers, profile {s['profile'] or 'default'}{slow}"
    return f"{s.get('workers', 4)} workers, cpu quota per worker: {s['cpu_quota']}"


def print_tables(result: dict[str, Any], console: Any) -> None:
    s, w, sm = result["settings"], result["workload"], result["summary"]
    parts = _parts(result)
    reqs = ", ".join(f"{p} {n}" for p, n in w["requests"].items())
    t = Table(title=f"bench fluid, {w['kind']} workload ({reqs} requests); SLO TTFT "
                    f"{s['ttft_slo_ms']:.0f} ms, ITL {s['itl_slo_ms']:.0f} ms; {s['runs']} "
                    f"run{'s' * (s['runs'] != 1)} each, mean (min..max); {_cluster(s)}")
    for col in ("config", *(f"{p}: SLO met" for p in parts), "goodput r/s", "flips",
                "decodes moved", "flip back s", "token mismatches"):
        t.add_column(col)
    for name, v in sm["per_config"].items():
        fb = v["flip_back_delay_s"]
        t.add_row(name, *(_att(v["attainment"][p]) for p in parts), _num(v["goodput_rps"]),
                  _num(v["flips"]), _num(v["decodes_moved"]),
                  "-" if w["decode_from_s"] is None or name not in sm["gains"] else
                  f"{_num(fb)} in {fb['n']} of {v['runs']}",
                  f"{v['token_mismatches']} of {v['tokens_compared']}"
                  if v["tokens_compared"] else "baseline")
    console.print(t)
    console.print("best static split in hindsight: " + ", ".join(
        f"{p} {sm['best_static'][p]}" for p in parts))
    g = Table(title="controller gains in attainment points (mean minus mean; within spread: "
                    "no larger than the larger min..max range)")
    g.add_column("config")
    g.add_column("against")
    for p in parts:
        g.add_column(p)
    for name, gains in sm["gains"].items():
        for which in ("vs_best_static", "vs_default"):
            g.add_row(name if which == "vs_best_static" else "",
                      "best static" if which == "vs_best_static" else "default split",
                      *(_gain(gains[p][which]) for p in parts))
    console.print(g)
    console.print(f"tokens: {sm['token_mismatches']} of {sm['tokens_compared']} requests differ "
                  f"from the baseline run's; engine check: {result['engine_mismatches']} of "
                  f"{result['engine_checked']} differ from the in-process engine; runs kept "
                  f"from an earlier stop: {result['runs_kept_from_earlier']}")
    if result.get("sim_plan"):
        console.print(f"the simulator on the same arrivals: {result['sim_plan']}")


def plot_attainment(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts, per = _parts(result), result["summary"]["per_config"]
    names = list(per)
    fig, ax = plt.subplots(figsize=(max(8.0, 1.3 * len(names) * len(parts) / 3), 5))
    width = 0.8 / len(parts)
    for j, p in enumerate(parts):
        sts = [per[n]["attainment"][p] for n in names]
        means = [100 * (st["mean"] or 0) for st in sts]
        # Runs that all met the same share give a mean a rounding off their min and max.
        lo = [max(0.0, m - 100 * (st["min"] if st["min"] is not None else 0))
              for m, st in zip(means, sts)]
        hi = [max(0.0, 100 * (st["max"] if st["max"] is not None else 0) - m)
              for m, st in zip(means, sts)]
        xs = [i + (j - (len(parts) - 1) / 2) * width for i in range(len(names))]
        ax.bar(xs, means, width, yerr=[lo, hi], capsize=3, label=p)
        for x, m, h in zip(xs, means, hi):
            ax.text(x, m + h + 1, f"{m:.0f}", ha="center", fontsize=6)
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=25, ha="right", fontsize=8)
    ax.set_ylabel("SLO attainment (%), mean; bars: min..max over the runs")
    ax.set_ylim(0, 105)
    ax.legend(fontsize=8, title="requests arriving in", title_fontsize=8)
    w, s = result["workload"], result["settings"]
    ax.set_title(f"bench fluid: {w['kind']} workload, {s['runs']} run{'s' * (s['runs'] != 1)} "
                 "per configuration",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_roles(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ctl = [n for n, recs in result["runs"].items() if recs and recs[0]["controller"]]
    fig, axes = plt.subplots(max(1, len(ctl)), 1, figsize=(9, 1.8 + 1.6 * max(1, len(ctl))),
                             sharex=True, squeeze=False)
    phases = result["workload"]["phases"]
    for ax, name in zip(axes[:, 0], ctl):
        for k, rec in enumerate(result["runs"][name]):
            tl = rec["timeline"]
            if tl:
                ax.step([x[0] for x in tl], [x[1] for x in tl], where="post",
                        label=f"run {k + 1}", alpha=0.8)
        for ph in phases[1:]:
            ax.axvline(ph["start_s"], color="grey", linestyle=":")
        ax.axvline(phases[-1]["end_s"], color="black", linestyle="--", linewidth=0.8)
        ax.set_ylim(-0.2, result["settings"].get("workers", 4) + 0.2)
        ax.set_ylabel(f"{name}\nprefill workers", fontsize=8)
        ax.legend(fontsize=7, loc="upper right")
    if not ctl:
        axes[0, 0].text(0.5, 0.5, "no controller configuration in this run", ha="center",
                        transform=axes[0, 0].transAxes)
    for ph in phases:
        axes[0, 0].text((ph["start_s"] + ph["end_s"]) / 2, 4.25, ph["name"], ha="center",
                        va="bottom", fontsize=7)
    axes[-1, 0].set_xlabel("seconds from the replay's start (dotted: phase boundaries; "
                           "dashed: the last arrival's phase ends)")
    fig.suptitle("bench fluid: roles over time per controller configuration", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(result: dict[str, Any], out_dir: str) -> list[str]:
    j = write_json(result, out_dir, "fluid.json")
    att, roles = os.path.join(out_dir, "fluid.png"), os.path.join(out_dir, "fluid_roles.png")
    plot_attainment(result, att)
    plot_roles(result, roles)
    return [j, att, roles]
