"""The vidur comparison as people read it: tables on the terminal and a PNG.

Owns `print_report` (mean/p50/p90 TTFT, ITL and e2e of every run with the difference against
vidur's, and vidur's linear-operator times against our roofline's) and `plot` (the three
distributions as CDFs, one line per simulator). Must not run or simulate anything: it reads the
document `vidur_compare.compare` returns.
"""

from __future__ import annotations

from typing import Any

from pdserve.simtools.vidur_compare import METRICS, STATS

LABELS = {"ttft_s": "TTFT", "itl_s": "ITL", "e2e_s": "e2e"}


def print_report(doc: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(width=160)
    runs, diff = doc["runs"], doc["difference_vs_vidur"]
    v = runs["vidur"]
    con.print(f"{doc['config']}; {doc['trace']} ({doc['requests']} requests, "
              f"{doc['prompts_shortened']} prompts shortened to fit 4,096 tokens); vidur "
              f"{v.get('version', '')}")
    t = Table(title="vidur vs pdserve sim, same requests and operator numbers (ms)")
    t.add_column("metric")
    names = list(runs)
    for n in names:
        t.add_column(n, justify="right")
    for n in names[1:]:
        t.add_column(f"{n} / vidur", justify="right")
    for m in METRICS:
        for s in STATS:
            cells = [f"{runs[n][m][s] * 1e3:.1f}" if runs[n][m][s] is not None else "-"
                     for n in names]
            cells += [f"{100 * diff[n][m][s]:+.1f}%" if s in diff[n][m] else "-"
                      for n in names[1:]]
            t.add_row(f"{LABELS[m]} {s}", *cells)
    t.add_row("finished", *[str(runs[n]["finished"]) for n in names], *[""] * (len(names) - 1))
    con.print(t)
    if doc.get("steps"):
        names = [k for k in doc["steps"][0] if k != "case"]
        t = Table(title="one step (ms): vidur's predictor and our profiles, same batch")
        t.add_column("batch")
        for n in names:
            t.add_column(n, justify="right")
        for r in doc["steps"]:
            t.add_row(r["case"], *[f"{r[n] * 1e3:.2f}" for n in names])
        con.print(t)
    if doc.get("linear_steps"):
        t = Table(title="linear operators per step, H100 Llama-2-7B TP1: vidur's profile vs "
                        "our roofline (ms)")
        for c in ("tokens", "vidur", "roofline", "roofline / vidur"):
            t.add_column(c, justify="right")
        for r in doc["linear_steps"]:
            t.add_row(str(r["tokens"]), f"{r['vidur_s'] * 1e3:.2f}",
                      f"{r['roofline_s'] * 1e3:.2f}", f"{r['roofline_over_vidur']:.2f}")
        con.print(t)


def plot(samples: dict[str, dict[str, list[float]]], doc: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, m in zip(axes, METRICS):
        for name, s in samples.items():
            xs = sorted(x * 1e3 for x in s[m])
            if xs:
                ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post",
                        label=name)
        ax.set_xlabel(f"{LABELS[m]} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        if m != "itl_s":
            ax.set_xscale("log")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"vidur vs pdserve sim: {doc['config']}\n{doc['trace']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
