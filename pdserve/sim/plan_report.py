"""What `pdserve sim plan` shows: one row per candidate, a table, plan.json and plan.png.

Owns turning a `SimReport` into a plan row (SLO attainment overall and in each half of the trace,
goodput, worker-hours, flips, seconds draining, TTFT/ITL percentiles, the roles over time of a
controller run, thinned to at most `MAX_ROLE_POINTS`), the table (with each job's peak memory
and the jobs' estimate) and drawing them: attainment against the
prefill share of the static splits (each half's too, with the controller runs as lines), and
prefill workers over time for each controller setting. Must not simulate or rank.
"""

from __future__ import annotations

import json
import os
from typing import Any

MAX_ROLE_POINTS = 400


def _met(report, i: int) -> bool:
    if report.status[i] != "ok":
        return False
    itl = report.itl_s(i)
    return report.ttft_s[i] <= report.slo_ttft_s and (itl is None or itl <= report.slo_itl_s)


def half_attainment(report) -> tuple[float | None, float | None]:
    """SLO attainment of the requests arriving in the first and in the second half of the span."""
    if not report.arrival_s:
        return None, None
    mid = (min(report.arrival_s) + max(report.arrival_s)) / 2
    halves: tuple[list[bool], list[bool]] = ([], [])
    for i, t in enumerate(report.arrival_s):
        halves[t >= mid].append(_met(report, i))
    return tuple(sum(h) / len(h) if h else None for h in halves)  # type: ignore[return-value]


def _drain_s(summary: dict) -> float:
    return float(sum(v for k, v in summary.items() if "drain" in k and isinstance(v, (int, float))))


def _thin(roles: list, limit: int = MAX_ROLE_POINTS) -> list[list[float]]:
    step = max(1, -(-len(roles) // limit))
    out = [list(r) for r in roles[::step]]
    if roles and out[-1] != list(roles[-1]):
        out.append(list(roles[-1]))
    return out


def row_of(c, report, wall_s: float) -> dict[str, Any]:
    sm = report.summary()
    first, second = half_attainment(report)
    return {
        "name": c.name, "kind": c.kind, "prefill_workers": c.prefill_workers,
        "decode_workers": c.decode_workers, "prefill_policy": c.prefill_policy,
        "controller": c.controller, "policy": c.policy,
        "attainment": sm["slo_attainment"] or 0.0, "attainment_first_half": first,
        "attainment_second_half": second, "goodput_rps": sm["goodput_rps"],
        "throughput_rps": sm["throughput_rps"], "worker_hours": sm["worker_hours"],
        "flips": int(sm.get("flips", 0)), "failed_flips": int(sm.get("failed_flips", 0)),
        "drain_s": _drain_s(sm),
        "finished": sm["finished"], "rejected": sm["rejected"], "requests": sm["requests"],
        "ttft_p50_s": sm["ttft_s"]["p50"], "ttft_p90_s": sm["ttft_s"]["p90"],
        "itl_p50_s": sm["itl_s"]["p50"], "itl_p90_s": sm["itl_s"]["p90"],
        "events": sm.get("events", 0), "sim_wall_s": wall_s,
        "roles": _thin(report.roles) if c.controller else [],
    }


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.0f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _jobs_caption(j: dict | None) -> str | None:
    if not j:
        return None
    avail = "unknown" if j["available_bytes"] is None else f"{j['available_bytes'] / 1e9:.1f} GB"
    return (f"{j['jobs']} jobs at once; about {j['per_job_estimate_bytes'] / 1e9:.1f} GB per job "
            f"estimated, {avail} available; peak GB: each job's peak resident memory")


def _gb(x: int | None) -> str:
    return "-" if x is None else f"{x / 1e9:.2f}"


def print_table(doc: dict[str, Any], console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    s = doc["settings"]
    t = Table(title=(f"sim plan: {s['trace']} on {s['workers']} workers, "
                     f"SLO TTFT {s['ttft_slo_ms']:.0f} ms / ITL {s['itl_slo_ms']:.0f} ms; "
                     f"{doc['requests']} requests; profile {doc['profile_origin']}"),
              caption=_jobs_caption(doc.get("jobs")))
    for col in ("candidate", "attain", "1st half", "2nd half", "goodput r/s", "worker-h",
                "flips", "drain s", "TTFT p90 ms", "ITL p90 ms", "sim s", "peak GB"):
        t.add_column(col, justify="left" if col == "candidate" else "right")
    for r in doc["rows"]:
        mark = " *" if r["name"] == doc["best"] else ""
        t.add_row(r["name"] + mark, _pct(r["attainment"]), _pct(r["attainment_first_half"]),
                  _pct(r["attainment_second_half"]), f"{r['goodput_rps']:.2f}",
                  f"{r['worker_hours']:.1f}", str(r["flips"]), f"{r['drain_s']:.0f}",
                  _ms(r["ttft_p90_s"]), _ms(r["itl_p90_s"]), f"{r['sim_wall_s']:.1f}",
                  _gb(r.get("peak_rss_bytes")))
    (console or Console(width=160)).print(t)


def plot(doc: dict[str, Any], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc["rows"]
    static = sorted((r for r in rows if r["kind"] == "static"),
                    key=lambda r: r["prefill_workers"])
    ctl = [r for r in rows if r["kind"] == "controller"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 4.8))
    n = doc["settings"]["workers"]
    xs = [r["prefill_workers"] / n for r in static]
    a1.plot(xs, [r["attainment"] for r in static], "o-", label="static: whole trace")
    a1.plot(xs, [r["attainment_first_half"] for r in static], "s--", alpha=0.7,
            label="static: first half")
    a1.plot(xs, [r["attainment_second_half"] for r in static], "^--", alpha=0.7,
            label="static: second half")
    for i, r in enumerate(ctl):
        a1.axhline(r["attainment"], color=f"C{3 + i}", lw=1,
                   label=r["name"].split(" from ")[0])
    a1.set_xlabel("prefill share of workers (static split)")
    a1.set_ylabel("SLO attainment")
    a1.set_ylim(0, 1.02)
    a1.legend(fontsize=7)
    a1.set_title("attainment vs prefill:decode split", fontsize=9)
    for i, r in enumerate(ctl):
        if r["roles"]:
            a2.step([p[0] for p in r["roles"]], [p[1] for p in r["roles"]], where="post",
                    color=f"C{3 + i}", label=r["name"].split(" from ")[0])
    if static:
        best = max(static, key=lambda r: (r["attainment"], r["name"]))
        a2.axhline(best["prefill_workers"], color="C0", ls=":",
                   label=f"best static ({best['prefill_workers']} prefill)")
    a2.axvline(doc["trace_span_s"] / 2, color="grey", ls="--", lw=1, label="trace half way")
    a2.set_xlabel("simulated time (s)")
    a2.set_ylabel("prefill workers")
    a2.set_title("controller: prefill workers over time", fontsize=9)
    a2.legend(fontsize=7)
    s = doc["settings"]
    fig.suptitle(f"{s['trace']} on {n} workers, SLO TTFT {s['ttft_slo_ms']:.0f} ms / ITL "
                 f"{s['itl_slo_ms']:.0f} ms ({doc['profile_origin'][:70]})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(doc: dict[str, Any], out_dir: str) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    jpath, ppath = os.path.join(out_dir, "plan.json"), os.path.join(out_dir, "plan.png")
    with open(jpath, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
    plot(doc, ppath)
    return [jpath, ppath]
