"""Tables and the PNG of `pdserve bench migrate`: one row per move pass and one pooled, the
aims met or not, and the stalls in steps of the target worker against the aim.

Owns presentation only (the figures are `migrate.py`'s). Must not measure anything.
"""

from __future__ import annotations

from typing import Any

from rich.table import Table

from pdserve.output import write_report

COLUMNS = ("run", "moved (copied) / in flight", "token mismatches", "errors",
           "target step ms", "ordinary gap ms (steps)", "stall ms p50 / p90 / p99 / max",
           "stall in target steps p50 / p90 / p99 / max", "router stalls (mean ms)",
           "Migrate call s")
QUANTILES = ("p50", "p90", "p99", "max")


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1000 * x:.0f}"


def _steps(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _row(name: str, r: dict[str, Any]) -> list[str]:
    gap, step = r["ordinary_gap_s"], r["target_step_s"]
    gap_steps = gap / step if gap is not None and step else None
    router = str(r["router_stall_count"])
    if r.get("router_stall_mean_s") is not None:
        router += f" ({_ms(r['router_stall_mean_s'])})"
    call = r.get("migrate_call_s")
    return [name, f"{r['moved']} ({r['copied']}) / {r['in_flight_at_move']}",
            str(r["mismatches"]), str(r["errors"]), _ms(step),
            f"{_ms(gap)} ({_steps(gap_steps)})",
            " / ".join(_ms(r["stall"][q]) for q in QUANTILES),
            " / ".join(_steps(r["stall_in_steps"][q]) for q in QUANTILES), router,
            "-" if call is None else f"{call:.2f}"]


def rows(result: dict[str, Any]) -> list[list[str]]:
    out = [_row(str(r["run"]), r) for r in result["runs"]]
    if len(result["runs"]) > 1:
        out.append(_row("pooled", result["pooled"]))
    return out


def verdicts(result: dict[str, Any]) -> list[str]:
    p, v, aim = result["pooled"], result["verdict"], result["aim"]

    def met(ok: bool) -> str:
        return "met" if ok else "NOT met"
    return [f"stall p99 at most {aim['stall_p99_steps']:g} target steps: "
            f"{met(v['stall_p99_within_aim'])} ({_steps(p['stall_in_steps']['p99'])})",
            f"0 requests lost: {met(v['no_request_lost'])} ({p['errors']} errors)",
            f"tokens identical to the fault-free run: {met(v['tokens_identical'])} "
            f"({p['mismatches']} mismatches)",
            f"every running decode moved: {'yes' if v['every_decode_moved'] else 'no'}; "
            f"the router timed each one's stall: "
            f"{'yes' if v['router_counted_every_stall'] else 'no'}"]


def _title(result: dict[str, Any]) -> str:
    s, m = result["settings"], result["machine"]
    return (f"bench migrate: {s['requests']} running decodes moved after "
            f"{s['move_after_tokens']} of {s['max_tokens']} tokens ({s['sampling']}), "
            f"{s['runs']} run{'s' * (s['runs'] != 1)}, {result['model']}, {m['cpus']} cores, "
            f"load {m['loadavg_1m'][0]:.1f}-{m['loadavg_1m'][1]:.1f}")


def markdown(result: dict[str, Any]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(r) + " |" for r in rows(result)]
    return "\n".join([_title(result), "", *lines, "", *(f"- {v}" for v in verdicts(result))])


def print_tables(result: dict[str, Any], console: Any) -> None:
    t = Table(title=_title(result))
    for col in COLUMNS:
        t.add_column(col)
    for r in rows(result):
        t.add_row(*r)
    console.print(t)
    for v in verdicts(result):
        console.print(f"  {v}")


def plot(result: dict[str, Any], path: str) -> None:
    """A strip per run: each moved stream's stall in steps of its run's target, the aim as a
    line, the streams' ordinary gap as a tick."""
    import random

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    aim = result["aim"]["stall_p99_steps"]
    rng = random.Random(0)
    fig, ax = plt.subplots(figsize=(max(6.5, 1.6 * len(runs) + 2.5), 4.6))
    top = aim
    for i, r in enumerate(runs):
        ys = r["stall_steps"]
        ax.scatter([i + rng.uniform(-0.18, 0.18) for _ in ys], ys, s=18, alpha=0.75,
                   color="tab:blue", label="a moved stream's stall" if i == 0 else None)
        if r["ordinary_gap_s"] is not None and r["target_step_s"]:
            g = r["ordinary_gap_s"] / r["target_step_s"]
            ax.plot([i - 0.3, i + 0.3], [g, g], color="tab:gray", lw=2,
                    label="ordinary gap (fault-free)" if i == 0 else None)
            top = max(top, g)
        if r["stall_in_steps"]["p99"] is not None:
            ax.plot([i - 0.3, i + 0.3], [r["stall_in_steps"]["p99"]] * 2, color="tab:orange",
                    lw=1.5, ls=":", label="p99" if i == 0 else None)
        top = max([top, *ys])
    ax.axhline(aim, color="tab:red", ls="--", lw=1.2, label=f"aim: p99 at most {aim:g} steps")
    ax.set_xticks(range(len(runs)))
    ax.set_xticklabels([f"run {r['run']}\n{_ms(r['target_step_s'])} ms/step" for r in runs])
    ax.set_xlim(-0.6, len(runs) - 0.4)
    ax.set_ylim(0, top * 1.15 + 0.1)
    ax.set_ylabel("stall, in the target worker's mean decode steps")
    s = result["settings"]
    ax.set_title(f"Live migration: {s['requests']} decodes moved at once after "
                 f"{s['move_after_tokens']} tokens ({result['model']})", fontsize=9)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(result: dict[str, Any], out_dir: str) -> list[str]:
    return write_report(result, out_dir, "migrate", plot, markdown)
