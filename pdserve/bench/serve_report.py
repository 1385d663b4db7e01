"""`pdserve bench serve`'s result as tables on a console, and as summary.json + bench_serve.png.

Owns the presentation only: the comparison per concurrency (pdserve, the engine's ceiling,
each baseline server, their ratios), each server's latency figures, the per-hop breakdown of
one token's time with the hops no metric measures named, internal TLS on against off (tokens/s
and CPU per token per level, the aim), and the plot (tokens/s per level for pdserve, with TLS
and without when both ran, the engine and the baselines; ITL and TTFT per level). Must not
compute figures: the result document carries them all.
"""

from __future__ import annotations

import os
from typing import Any

from pdserve.output import write_json


def _f(x: float | None, fmt: str = "{:.1f}", scale: float = 1.0) -> str:
    return "-" if x is None else fmt.format(x * scale)


def _ms(x: float | None) -> str:
    return _f(x, "{:.1f}", 1000.0)


def _threads(n: int) -> str:
    return f"{n} thread" if n == 1 else f"{n} threads"


def _servers(result: dict[str, Any]) -> list[dict[str, Any]]:
    return [result["pdserve"], *[b for b in result["baselines"].values() if "levels" in b]]


def print_tables(result: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    eng = result["engine"]
    base = [k for k, b in result["baselines"].items() if "levels" in b]
    t = Table(title=f"{result['model']}: output tokens/s per concurrency (engine alone: "
                    f"{_threads(eng['threads'])}, the most a decode step may use)")
    for col in ("c", "pdserve", "engine", "pdserve/engine", "ITL p50/step",
                *[c for k in base for c in (k, f"pdserve/{k}")]):
        t.add_column(col, justify="right")
    for row in result["comparison"]:
        t.add_row(str(row["concurrency"]), _f(row["pdserve_tokens_per_s"]),
                  _f(row["engine_tokens_per_s"]), _f(row["serving_over_engine"], "{:.2f}x"),
                  _f(row["itl_p50_over_engine_step"], "{:.2f}x"),
                  *[c for k in base for c in (_f(row[f"{k}_tokens_per_s"]),
                                              _f(row[f"pdserve_over_{k}"], "{:.2f}x"))])
    console.print(t)
    lat = Table(title="latency (ms; ITL: gap between streamed chunks; p50 / p90)")
    for col in ("server", "c", "tok/s", "TTFT", "ITL", "TPOT mean", "ok", "failed"):
        lat.add_column(col, justify="right")
    for srv in _servers(result):
        for lv in srv["levels"]:
            lat.add_row(srv["name"], str(lv["concurrency"]), _f(lv["tokens_per_s"]),
                        f"{_ms(lv['ttft_p50_s'])} / {_ms(lv['ttft_p90_s'])}",
                        f"{_ms(lv['itl_p50_s'])} / {_ms(lv['itl_p90_s'])}",
                        _ms(lv["tpot_mean_s"]), str(lv["ok"]), str(lv["failed"]))
    console.print(lat)
    print_cpu(result, console)
    print_tls(result, console)
    hop = Table(title="pdserve: one token's time by hop (ms, means over the level)")
    hop.caption = ("to router: worker -> router; to client: router -> client; busy: the "
                   "decode engine's share of the wall time")
    for col in ("c", "engine step", "to router", "to client", "router ITL", "client TPOT",
                "busy"):
        hop.add_column(col, justify="right")
    for lv in result["pdserve"]["levels"]:
        h = lv["hops"]
        secs = {x["hop"]: x["seconds"] for x in h["hops"]}
        hop.add_row(str(lv["concurrency"]), _ms(secs["engine step"]),
                    _ms(secs["worker -> router"]), _ms(secs["router -> client"]),
                    _ms(h["router_itl_mean_s"]), _ms(h["client_tpot_mean_s"]),
                    _f(h["decode_engine_busy_fraction"], "{:.0%}"))
    console.print(hop)
    for note in missing_metrics(result):
        console.print(f"[yellow]no metric[/]: {note}")
    for srv in _servers(result):
        console.print(f"{srv['name']}: ready in {srv['start_s']:.1f} s, resident memory "
                      f"{srv['rss_bytes'] / 2**30:.2f} GiB at the end")
        for lv in srv["levels"]:
            for e in lv["errors"]:
                console.print(f"[red]{srv['name']} c{lv['concurrency']}[/]: {e['count']} x "
                              f"{e['error']}")
    for k, b in result["baselines"].items():
        if "skipped" in b:
            console.print(f"[yellow]{k} not measured[/]: {b['skipped']}")
    m = result["machine"]
    console.print(f"load average {m['loadavg_1m_start']:.2f} at the start, "
                  f"{m['loadavg_1m_end']:.2f} at the end; {result['seconds']:.0f} s")


def cpu_rows(result: dict[str, Any]) -> list[tuple[str, int, float, str, float]]:
    """Per server and level: (server, c, wall s, "name seconds, ..." busiest first, all
    processes' CPU seconds over wall x cores); levels measured without CPU times are left out."""
    cores = result["machine"]["cpu_count"] or 1
    rows = []
    for srv in _servers(result):
        for lv in srv["levels"]:
            cpu = lv.get("cpu_s")
            if not cpu:
                continue
            named = ", ".join(f"{k} {v:.1f}" for k, v in
                              sorted(cpu.items(), key=lambda kv: -kv[1]) if v >= 0.05)
            rows.append((srv["name"], lv["concurrency"], lv["wall_s"], named,
                         sum(cpu.values()) / (lv["wall_s"] * cores)))
    return rows


def print_cpu(result: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    rows = cpu_rows(result)
    if not rows:
        return
    t = Table(title="CPU seconds per level by process (client: the bench's own streaming "
                    "client); all: their sum over wall x cores")
    for col in ("server", "c", "wall s", "CPU s by process", "all"):
        t.add_column(col, justify="right")
    for name, c, wall, named, share in rows:
        t.add_row(name, str(c), _f(wall), named, _f(share, "{:.0%}"))
    console.print(t)


def print_tls(result: dict[str, Any], console: Any) -> None:
    """The processes' internal-TLS flags per pass and, with both settings, the comparison."""
    from rich.table import Table

    tls = result.get("internal_tls")
    if not tls:
        return
    for i, p in enumerate(tls["passes"]):
        flags = sorted({" ".join(f) or "(environment)" for f in p["flags"].values()})
        console.print(f"pass {i + 1} (internal TLS {p['mode']}): processes ran with "
                      f"{'; '.join(flags)}; load average at its levels "
                      f"{', '.join(f'{x:.2f}' for x in p['loadavg_1m'])}")
    rows = tls.get("by_level")
    if not rows:
        return
    t = Table(title=f"internal TLS on / off, {len(tls['order'])} passes "
                    f"({', '.join(tls['order'])}): output tokens/s (mean of the passes) and "
                    "CPU ms per output token of the cluster's processes")
    for col in ("c", "tok/s on", "tok/s off", "on/off", "pairs", "CPU ms/tok on",
                "CPU ms/tok off", "on/off", "failed"):
        t.add_column(col, justify="right")
    for r in rows:
        on, off = r["on"], r["off"]
        t.add_row(str(r["concurrency"]), _f(on["tokens_per_s"]), _f(off["tokens_per_s"]),
                  _f(r["tokens_ratio"], "{:.3f}x"),
                  ", ".join(f"{x:.3f}" for x in r["pair_ratios"]),
                  _ms(on["cpu_s_per_token"]), _ms(off["cpu_s_per_token"]),
                  _f(r["cpu_per_token_ratio"], "{:.3f}x"), f"{on['failed']} / {off['failed']}")
    console.print(t)
    aim = tls["aim"]
    verdict = "not measured" if aim["met"] is None else ("met" if aim["met"] else "not met")
    console.print(f"aim: tokens/s with internal TLS >= {aim['aim']}x without at c"
                  f"{aim['concurrency']}: {verdict} ({_f(aim['ratio'], '{:.3f}x')})")


def missing_metrics(result: dict[str, Any]) -> list[str]:
    seen: list[str] = []
    for lv in result["pdserve"]["levels"]:
        for note in lv["hops"]["missing"]:
            if note not in seen:
                seen.append(note)
    return seen


def write_outputs(result: dict[str, Any], out_dir: str) -> list[str]:
    from matplotlib.figure import Figure

    json_path = write_json(result, out_dir, "summary.json")
    png_path = os.path.join(out_dir, "bench_serve.png")
    levels = [lv["concurrency"] for lv in result["pdserve"]["levels"]]
    x = list(range(len(levels)))
    fig = Figure(figsize=(13, 4.2), layout="constrained")
    tput, itl, ttft = fig.subplots(1, 3)
    eng = {e["batch_size"]: e for e in result["engine"]["levels"]}
    batches = [lv["batch_size"] for lv in result["pdserve"]["levels"]]
    tput.plot(x, [eng[b]["tokens_per_s"] for b in batches], "k--o",
              label=f"engine alone ({_threads(result['engine']['threads'])})")
    itl.plot(x, [eng[b]["step_s"] * 1000 for b in batches], "k--o", label="engine step")
    for srv, mark in zip(_servers(result), "osd^v"):
        by = {lv["concurrency"]: lv for lv in srv["levels"]}
        rows = [by.get(c) for c in levels]
        tput.plot(x, [r["tokens_per_s"] if r else None for r in rows], f"-{mark}",
                  label=srv["name"] if srv is not result["pdserve"] or "by_level" not in
                  (result.get("internal_tls") or {}) else "pdserve (pass 1 with TLS)")
        itl.errorbar(x, [r["itl_p50_s"] * 1000 if r and r["itl_p50_s"] else None for r in rows],
                     yerr=[[0] * len(rows),
                           [(r["itl_p90_s"] - r["itl_p50_s"]) * 1000
                            if r and r["itl_p50_s"] else 0 for r in rows]],
                     fmt=f"-{mark}", capsize=3, label=f"{srv['name']} (p50, bar to p90)")
        ttft.errorbar(x, [r["ttft_p50_s"] if r and r["ttft_p50_s"] else None for r in rows],
                      yerr=[[0] * len(rows),
                            [r["ttft_p90_s"] - r["ttft_p50_s"]
                             if r and r["ttft_p50_s"] else 0 for r in rows]],
                      fmt=f"-{mark}", capsize=3, label=srv["name"])
    for r_mode, mark in (("on", "x"), ("off", "+")):
        by_level = (result.get("internal_tls") or {}).get("by_level")
        if by_level:
            tput.plot(x, [r[r_mode]["tokens_per_s"] for r in by_level], f":{mark}",
                      label=f"pdserve, internal TLS {r_mode} (mean of "
                            f"{by_level[0][r_mode]['passes']} passes)")
    for ax, title, ylabel in ((tput, "output tokens/s", "tokens/s"),
                              (itl, "inter-token latency", "ms"),
                              (ttft, "time to first token (p50, bar to p90)", "s")):
        ax.set_xticks(x, [str(c) for c in levels])
        ax.set_xlabel("concurrency")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    m = result["machine"]
    fig.suptitle(f"pdserve bench serve: {result['model']}, {result['workload']['requests']} "
                 f"requests x {result['settings']['max_tokens']} tokens, "
                 f"{m['cpu_count']} cores, load {m['loadavg_1m_start']:.1f}")
    fig.savefig(png_path, dpi=110)
    if (result.get("internal_tls") or {}).get("by_level"):
        tls_path = os.path.join(out_dir, "bench_serve_tls.png")
        _plot_tls(result, tls_path)
        return [json_path, png_path, tls_path]
    return [json_path, png_path]


def _plot_tls(result: dict[str, Any], path: str) -> None:
    """Each pass's output tokens/s and the cluster's CPU ms per output token, per level: TLS
    passes solid, plaintext dashed, so a pass the machine slowed shows as one."""
    from matplotlib.figure import Figure

    tls = result["internal_tls"]
    levels = [r["concurrency"] for r in tls["by_level"]]
    x = list(range(len(levels)))
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    tput, cpu = fig.subplots(1, 2)
    spent: list[float] = []
    for i, p in enumerate(tls["passes"]):
        by = {lv["concurrency"]: lv for lv in p["levels"]}
        style = "-o" if p["mode"] == "on" else "--s"
        label = f"pass {i + 1}, TLS {p['mode']}"
        tput.plot(x, [by[c]["tokens_per_s"] for c in levels], style, label=label)
        ms = [1000 * sum(v for k, v in (by[c]["cpu_s"] or {}).items() if k != "client")
              / by[c]["output_tokens"] for c in levels]
        spent += ms
        cpu.plot(x, ms, style, label=label)
    for ax, title, ylabel in ((tput, "output tokens/s", "tokens/s"),
                              (cpu, "CPU per output token, the cluster's processes", "ms")):
        ax.set_xticks(x, [str(c) for c in levels])
        ax.set_xlabel("concurrency")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    cpu.set_yscale("log")
    cpu.set_yticks([t for t in (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)
                    if min(spent) / 2 <= t <= max(spent) * 2])
    cpu.yaxis.set_major_formatter(ScalarFormatter())
    cpu.yaxis.set_minor_formatter(NullFormatter())
    ratio = tls["aim"]["ratio"]
    fig.suptitle(f"internal TLS on / off, passes {', '.join(tls['order'])}: tokens/s ratio at "
                 f"c{tls['aim']['concurrency']} "
                 f"{'-' if ratio is None else f'{ratio:.3f}'}x (aim >= {tls['aim']['aim']}x)")
    fig.savefig(path, dpi=110)
