"""What a person sees of `pdserve bench admission`: a rich table, and the JSON, PNG and
Markdown files of --out.

Owns the layout: one row per mode (sent, admitted, refused, failed, admitted TTFT p50 / p99 /
max, p99 over the limit, the share within it, prompt tokens admitted per second, the router's
factor at the end); the plot `admission.png` (the admitted requests' TTFT, sorted, per mode,
against the limit). Must not compute figures: it reads the result document.
"""

from __future__ import annotations

from typing import Any

from pdserve.output import write_report

COLUMNS = ("mode", "sent", "admitted", "refused", "failed", "TTFT p50 s", "p99 s", "max s",
           "p99/limit", "within", "prompt tok/s", "factor")


def _s(x: float | None, fmt: str = "{:.2f}") -> str:
    return "n/a" if x is None else fmt.format(x)


def rows(result: dict[str, Any]) -> list[list[str]]:
    out = []
    for name, m in result["modes"].items():
        out.append([name, str(m["sent"]), str(m["admitted"]), str(m["refused"]),
                    str(m["failed"]), _s(m["ttft_p50_s"]), _s(m["ttft_p99_s"]),
                    _s(m["ttft_max_s"]), _s(m["p99_over_limit"]),
                    _s(m["within_limit"], "{:.1%}"),
                    _s(m["admitted_prompt_tokens_per_s"], "{:,.0f}"),
                    _s(m["router_factor"])])
    return out


def title(result: dict[str, Any]) -> str:
    s = result["settings"]
    return (f"bench admission: {s['requests']} requests of {result['trace']} at "
            f"{s['speedup']:g}x, limit {s['limit_s']:g} s, {result['model']}, "
            f"{result['machine']['cpus']} CPUs")


def print_tables(result: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    t = Table(title=title(result))
    for col in COLUMNS:
        t.add_column(col, justify="left" if col == "mode" else "right")
    for r in rows(result):
        t.add_row(*r)
    console.print(t)


def markdown(result: dict[str, Any]) -> str:
    lines = [f"**{title(result)}**", "", "| " + " | ".join(COLUMNS) + " |",
             "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(r) + " |" for r in rows(result)]
    return "\n".join(lines)


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    limit = result["settings"]["limit_s"]
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, m in result["modes"].items():
        t = m["ttfts_s"]
        if t:
            ax.plot([100 * (i + 1) / len(t) for i in range(len(t))], t,
                    label=f"{name}: {m['admitted']} admitted, {m['refused']} refused")
    ax.axhline(limit, color="black", linestyle="--", linewidth=1, label=f"limit {limit:g} s")
    ax.set_xlabel("admitted requests, % (sorted by TTFT)")
    ax.set_ylabel("time to first token, s")
    ax.set_title(title(result), fontsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(result: dict[str, Any], out_dir: str) -> list[str]:
    return write_report(result, out_dir, "admission", plot, markdown)
