"""What a person sees of `pdserve bench transfer`: a rich table, and the JSON + PNG of --out.

Owns the layout: one table per prompt size (a row per link rate and variant: time to the 2nd and
10th token after prefill, wait, KV bytes, anchor fraction, drafts, regime, exactness), then the
nine-decode-steps point and the aims there; the plot `transfer.png` (time to the 10th token vs
link rate, one line per variant, one panel per prompt size). Must not compute figures: it reads
the result document.
"""

from __future__ import annotations

import os
from typing import Any

from pdserve.output import write_json

SHORT = {"full-after": "(a) full-after", "full-layerwise": "(b) full-layerwise",
         "int8-layerwise": "(c) int8-layerwise", "progressive": "(d) progressive"}
LETTER = {"full-after": "a", "full-layerwise": "b", "int8-layerwise": "c", "progressive": "d"}
REGIME = {"compute-bound": "compute", "link-bound": "link", "residual-overlapped": "overlap"}


def _ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 1000:,.0f}"


def _s(x: float) -> str:
    return f"{x:.3f}"


def print_tables(result: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    link = result["link"]
    style = "" if link["shaped"] else "[bold yellow]"
    console.print(f"{style}link: {link['description']}")
    for note in result["notes"]:
        console.print(f"note: {note}")
    for size in result["sizes"]:
        n = size["prompt_tokens"]
        t = Table(title=f"bench transfer: {n}-token prompt, {os.path.basename(result['model']['path'])}"
                        f" fp32, times in s after prefill end "
                        f"(prefill {_ms(size.get('prefill_s'))} ms)")
        for col in ("Gbit/s", "var", "2nd", "10th", "wait", "KV MB", "anchor", "drafts",
                    "acc", "regime", "exact"):  # var: a b c d, spelled out in the caption
            t.add_column(col, justify="left" if col in ("var", "regime") else "right")
        for r in (r for r in result["rows"] if r["prompt_tokens"] == n):
            mark = "*" if r["nine_step_point"] else ""
            af = r["anchor_fraction"]
            exact = "yes" if r["exact"] else f"no:{r['differing_tokens']}"
            drafts = (f"{r['anchor_draft_tokens']}" if r["variant"] == "progressive" else "")
            acc = (f"{r['anchor_accepted_tokens']}" if r["variant"] == "progressive" else "")
            regime = REGIME[r["regime"]] + (" fb" if r["fallback_to_layerwise"] else "")
            t.add_row(f"{r['link_gbps']:.3g}{mark}", LETTER[r["variant"]], _s(r["t_2nd_s"]),
                      _s(r["t_10th_s"]), _s(r["wait_s"]), f"{r['kv_bytes'] / 1e6:,.1f}",
                      "" if af is None else f"{af:.4f}", drafts, acc, regime, exact)
        t.caption = ("a full-after, b full-layerwise, c int8-layerwise, d progressive. "
                     "* the nine-decode-steps point. drafts/acc: tokens decoded on the anchor, "
                     "and how many held once the exact KV landed. regime: compute (transfer done "
                     "within prefill), link (waited for the link), overlap (drafted while the "
                     "residual was in flight); fb: residual shorter than a decode step, so (d) "
                     "sent full precision layer-wise like (b). exact no:N = N tokens differ from a")
        console.print(t, width=max(console.width, 110))
        for r in result["rows"]:
            if r["prompt_tokens"] == n and r["fallback_to_layerwise"]:
                console.print(f"note: {n} tokens at {r['link_gbps']:.3g} Gbit/s: the residual "
                              f"would take less than a decode step on the link, so (d) fell "
                              f"back to (b): full precision, layer by layer")
        if "decode_step_s" in size:
            console.print(f"{n} tokens: decode step {_ms(size['decode_step_s'])} ms; (b) waits "
                          f"nine steps ({_ms(size['nine_steps_s'])} ms) at about "
                          f"{size['nine_step_gbps']:.3g} Gbit/s ({size['nine_step_gbps_how']})")
        if "ratios_t10" in size:
            r, met, aims = size["ratios_t10"], size["aims_met"], result["aims"]
            for key, aim in (("progressive_vs_layerwise", "progressive_vs_layerwise_max"),
                             ("progressive_vs_after", "progressive_vs_after_max"),
                             ("progressive_vs_int8", "progressive_vs_int8_max")):
                console.print(f"  aim t_10th {key.replace('_vs_', ' / ')} <= {aims[aim]}: "
                              f"{r[key]:.2f}x, {'met' if met[key] else 'not met'}")
    ok = "identical" if result["exact_abd"] else "DIFFERENT (bug)"
    console.print(f"(a), (b), (d) tokens: {ok}; anchor fraction of the codec "
                  f"{result['anchor_fraction_codec']:.4f}")


def plot(result: dict[str, Any], path: str) -> None:
    from matplotlib.figure import Figure

    sizes = [s["prompt_tokens"] for s in result["sizes"]]
    fig = Figure(figsize=(5.5 * len(sizes), 4.2), layout="constrained")
    for i, n in enumerate(sizes):
        ax = fig.add_subplot(1, len(sizes), i + 1)
        for v, label in SHORT.items():
            pts = sorted((r["link_gbps"], r["t_10th_s"]) for r in result["rows"]
                         if r["prompt_tokens"] == n and r["variant"] == v)
            ax.plot([p[0] for p in pts], [1000 * p[1] for p in pts], "o-", label=label)
        size = result["sizes"][i]
        if "nine_step_gbps" in size:
            ax.axvline(size["nine_step_gbps"], color="grey", linestyle=":",
                       label="(b) waits 9 decode steps")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("link rate (Gbit/s)" + ("" if result["link"]["shaped"] else ", emulated"))
        ax.set_ylabel("time to 10th token after prefill (ms)")
        ax.set_title(f"{n}-token prompt", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.savefig(path, dpi=110)


def write_outputs(result: dict[str, Any], out_dir: str) -> list[str]:
    paths = [write_json(result, out_dir, "results.json"), os.path.join(out_dir, "transfer.png")]
    plot(result, paths[1])
    return paths
