"""What a person sees of `pdserve bench spec`: a rich table, and the JSON + PNG files of --out.

Owns the layout: one row per method and batch size (acceptance length, tokens per step, decode
tok/s, speed-up over no speculation, exact), the skipped methods with why; the plot `speedup.png`
(speed-up vs batch size, one line per method, y = 1 marked). Must not compute figures: it reads
the result document.
"""

from __future__ import annotations

import os
from typing import Any

from pdserve.output import write_json


def _num(x: float | None, fmt: str) -> str:
    return "n/a" if x is None else format(x, fmt)


def print_tables(result: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    st = result["settings"]
    t = Table(title=f"bench spec: gamma {st['gamma']}, {st['max_tokens']} tokens per request, "
                    f"schedule {'on' if st['schedule'] else 'off'}, {result['model']['dtype']}, "
                    f"{result['machine']['torch_threads']} torch threads")
    for col in ("method", "batch", "accept len", "tok/step", "tok/s", "speedup", "exact"):
        t.add_column(col, justify="left" if col == "method" else "right")
    for r in result["rows"]:
        if r["status"] != "ok":
            t.add_row(r["method"], str(r["batch_size"]), "", "", "", "", r["status"])
            continue
        exact = "[green]true[/green]" if r["exact"] else "[red]false[/red]"
        t.add_row(r["method"], str(r["batch_size"]), _num(r["acceptance_length"], ".2f"),
                  _num(r["tokens_per_step"], ".2f"), f"{r['tokens_per_s']:.1f}",
                  f"{r['speedup']:.2f}x", exact)
    t.caption = ("accept len: tokens emitted per verification with drafts; tok/step: per request "
                 "per target step, steps without drafts included; tok/s: decode phase only; "
                 f"speedup: vs none at the same batch, same run. prompts: {st['prompt_source']} "
                 f"({st['heldout_rule']}).")
    console.print(t)
    for name, why in {**result["skipped"], **result["errors"]}.items():
        console.print(f"{name}: {'skipped' if name in result['skipped'] else 'error'}: {why}")
    if not result["all_exact"]:
        console.print("[red]greedy output differs from no speculation (invariant 2)[/red]")


def plot(result: dict[str, Any], path: str) -> None:
    from matplotlib.figure import Figure

    rows = [r for r in result["rows"] if r["status"] == "ok" and r["method"] != "none"]
    bs = result["settings"]["batch_sizes"]
    fig = Figure(figsize=(6, 4), layout="constrained")
    ax = fig.add_subplot()
    for m in dict.fromkeys(r["method"] for r in rows):
        pts = [(r["batch_size"], r["speedup"]) for r in rows if r["method"] == m]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=m)
    ax.axhline(1.0, color="k", linestyle="--", label="no speculation")
    ax.set_xscale("log", base=2)
    ax.set_xticks(bs, [str(b) for b in bs])
    ax.set_xlabel("batch size")
    ax.set_ylabel("decode tokens/s vs no speculation")
    st = result["settings"]
    ax.set_title(f"{os.path.basename(result['model']['path'])}, gamma {st['gamma']}, schedule "
                 f"{'on' if st['schedule'] else 'off'}, {result['machine']['torch_threads']} threads",
                 fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.savefig(path, dpi=120)


def write_outputs(result: dict[str, Any], out_dir: str) -> list[str]:
    paths = [write_json(result, out_dir, "results.json"), os.path.join(out_dir, "speedup.png")]
    plot(result, paths[1])
    return paths
