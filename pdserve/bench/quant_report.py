"""`pdserve bench quant`'s report: the console tables and the JSON + PNG files.

Owns how one run's result document (`quant.run_quant_bench`) is shown: agreement, logprob
error and decode speed tables, and a two-panel plot (the share of prompts still agreeing with
fp32 at each generated position; decode tokens/s of both engines per batch size). Must not
measure anything.
"""

from __future__ import annotations

import os
from typing import Any

from rich.console import Console
from rich.table import Table

from pdserve.output import write_json


def print_table(result: dict[str, Any], console: Console) -> None:
    q, g, lp = result["quantization"], result["greedy"], result["logprobs"]
    st = result["settings"]
    t = Table(title=f"{q} vs fp32: greedy agreement ({st['prompts']} held-out prompts, "
                    f"{st['new_tokens']} tokens each)")
    t.add_column("measure")
    t.add_column("value", justify="right")
    for n, share in g["all_agree_share"].items():
        t.add_row(f"prompts whose first {n} tokens all agree", f"{100 * share:.1f}%")
    t.add_row("mean tokens before the first divergence", f"{g['mean_prefix_tokens']:.1f}")
    t.add_row("tokens equal at the same position", f"{100 * g['token_agreement']:.1f}%")
    t.add_row(f"teacher-forced: top-1 agreement ({lp['positions']} positions)",
              f"{100 * lp['teacher_forced_top1_agreement']:.2f}%")
    t.add_row("teacher-forced |logprob diff|, mean / max",
              f"{lp['logprob_abs_diff_mean']:.4f} / {lp['logprob_abs_diff_max']:.4f}")
    t.add_row("teacher-forced KL(fp32 || q), mean / max",
              f"{lp['kl_mean']:.5f} / {lp['kl_max']:.5f}")
    console.print(t)
    d = Table(title=f"engine decode, {result['machine']['torch_threads']} threads "
                    f"(load {result['machine']['loadavg_1m_start']:.2f} at start)")
    for col in ("batch", "fp32 tok/s", f"{q} tok/s", f"{q}/fp32"):
        d.add_column(col, justify="right")
    for row in result["decode"]:
        d.add_row(str(row["batch_size"]), f"{row['fp32']['tokens_per_s']:.1f}",
                  f"{row[q]['tokens_per_s']:.1f}", f"{row['speedup']:.2f}x")
    console.print(d)
    wb = result["model"]["weight_bytes"]
    console.print(f"weights read per step: fp32 {wb['fp32'] / 2**20:.0f} MiB, {q} "
                  f"{wb[q] / 2**20:.0f} MiB; LM head (fp32 / {q} engine): "
                  f"{result['model']['lm_head']}")


def write_outputs(result: dict[str, Any], out_dir: str) -> list[str]:
    from matplotlib.figure import Figure

    json_path = write_json(result, out_dir, "quant.json")
    png_path = os.path.join(out_dir, "quant.png")
    q, g = result["quantization"], result["greedy"]
    fig = Figure(figsize=(10, 4), layout="constrained")
    ax, bx = fig.subplots(1, 2)
    curve = g["all_agree_share_by_position"]
    ax.plot(range(1, len(curve) + 1), [100 * c for c in curve], "o-", markersize=3)
    ax.set_ylim(0, 102)
    ax.set_xlabel("generated tokens N")
    ax.set_ylabel("% of prompts whose first N tokens equal fp32's")
    lp = result["logprobs"]
    ax.set_title(f"{q} greedy vs fp32 ({result['settings']['prompts']} prompts); "
                 f"mean KL {lp['kl_mean']:.4f}")
    ax.grid(True, alpha=0.3)
    rows = result["decode"]
    xs = range(len(rows))
    bx.bar([x - 0.2 for x in xs], [r["fp32"]["tokens_per_s"] for r in rows], 0.4, label="fp32")
    bx.bar([x + 0.2 for x in xs], [r[q]["tokens_per_s"] for r in rows], 0.4, label=q)
    for x, r in zip(xs, rows):
        bx.annotate(f"{r['speedup']:.2f}x", (x + 0.2, r[q]["tokens_per_s"]), ha="center",
                    va="bottom")
    bx.set_xticks(list(xs), [f"batch {r['batch_size']}" for r in rows])
    bx.set_ylabel("engine decode tokens/s")
    bx.set_title(f"{os.path.basename(result['model']['path'])}, "
                 f"{result['machine']['torch_threads']} threads")
    bx.legend()
    fig.savefig(png_path, dpi=120)
    return [json_path, png_path]
