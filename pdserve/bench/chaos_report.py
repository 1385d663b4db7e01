"""Tables and the PNG of `pdserve bench chaos` (one row per fault).

Owns presentation only. Must not measure anything.
"""

from __future__ import annotations

from typing import Any

from rich.table import Table

from pdserve.output import write_report

COLUMNS = ("fault", "killed", "requests", "in flight at kill", "sent after kill",
           "completed correct", "wrong", "lost",
           "client resends", "restarted", "time to heal s", "health not serving s",
           "serves after")


def rows(result: dict[str, Any]) -> list[list[str]]:
    out = []
    for f in result["faults"]:
        out.append([f["fault"], f["victim"], str(f["requests"]), str(f["in_flight_at_kill"]),
                    str(f["sent_after_kill"]),
                    str(f["completed_correct"]), str(f["wrong"]), str(f["lost"]),
                    str(f["resends"]), "yes" if f["restarted"] else "no",
                    "-" if f["heal_s"] is None else f"{f['heal_s']:.1f}",
                    f"{f['not_serving_s']:.1f}", "yes" if f["serves_after"] else "no"])
    return out


def markdown(result: dict[str, Any]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(r) + " |" for r in rows(result)]
    return "\n".join(lines)


def print_tables(result: dict[str, Any], console: Any) -> None:
    s = result["settings"]
    t = Table(title=f"bench chaos: kill -9 under {s['requests']} streaming requests "
                    f"({s['sampling']}), {result['model']}, {result['machine']}")
    for col in COLUMNS:
        t.add_column(col)
    for r in rows(result):
        t.add_row(*r)
    console.print(t)


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    faults = result["faults"]
    names = [f["fault"] for f in faults]
    heal = [f["heal_s"] or 0.0 for f in faults]
    fig, ax = plt.subplots(figsize=(8, 0.6 * len(faults) + 1.6))
    bars = ax.barh(names, heal, color=["tab:green" if f["lost"] == 0 and f["wrong"] == 0
                                       else "tab:red" for f in faults])
    for b, f in zip(bars, faults):
        ax.text(b.get_width(), b.get_y() + b.get_height() / 2,
                f"  {f['completed_correct']}/{f['requests']} correct, {f['lost']} lost",
                va="center")
    ax.invert_yaxis()
    ax.set_xlabel("seconds from kill -9 to the restarted process healthy")
    ax.set_title(f"kill -9 under load ({result['model']}): time to heal; green = no request "
                 "lost or changed", fontsize=9)
    ax.set_xlim(0, max(heal + [1.0]) * 1.6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(result: dict[str, Any], out_dir: str) -> list[str]:
    return write_report(result, out_dir, "chaos", plot, markdown)
