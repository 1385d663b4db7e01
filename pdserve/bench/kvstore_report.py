"""What a person sees of `pdserve bench kvstore`: rich tables, and the JSON + PNG files of --out.

Owns the layout: bandwidth per system and size (each cell GB/s and its ratio to this run's
memcpy), internal TLS against plaintext over TCP (on loopback and over the shaped link, each
cell the ratio with its rounds' spread, the cipher's own speed beside it), batch gets, trace hit
rates beside the ideal and an exact LRU, the aims; the plots `kvstore_bandwidth.png` (GB/s vs
size, log-x, get and put), `kvstore_tls.png` (TLS / plaintext vs size, the aim as a line) and
`kvstore_trace.png` (hit rate vs capacity, the ideal as a line). Must not compute figures: it
reads the result document.
"""

from __future__ import annotations

import os
from typing import Any

from pdserve.output import write_json
from pdserve.bench.kvstore_summary import BATCH_SYSTEMS

MiB = 1 << 20
# Rows of the bandwidth table and lines of its plot: (series, field, label).
ROWS = [("pdserve_shm", "get", "pdserve shm get_into"),
        ("pdserve_shm", "put", "pdserve shm put_from"),
        ("raw_shm", "get", "raw shm read_into"), ("raw_shm", "put", "raw shm write"),
        ("pdserve_tcp", "get", "pdserve tcp get_into"),
        ("pdserve_tcp", "put", "pdserve tcp put_from"),
        ("raw_tcp", "get", "raw tcp read_into"), ("raw_tcp", "put", "raw tcp write"),
        ("pdserve_tcp_tls", "get", "pdserve tcp+TLS get_into"),
        ("pdserve_tcp_tls", "put", "pdserve tcp+TLS put_from"),
        ("raw_tcp_tls", "get", "raw tcp+TLS read_into"),
        ("raw_tcp_tls", "put", "raw tcp+TLS write"),
        ("pdserve_ucx", "get", "pdserve ucx get_into"),
        ("pdserve_ucx", "put", "pdserve ucx put_from"),
        ("redis", "get", "redis GET"), ("redis", "put", "redis SET"),
        ("mooncake", "get", "Mooncake get_into"), ("mooncake", "put", "Mooncake put_from")]


def _sizes(result: dict[str, Any]) -> list[int]:
    return [r["size_bytes"] for r in result["bandwidth"]["series"]["memcpy"]]


def _met(aim: dict[str, Any]) -> str:
    return "not measured" if aim["met"] is None else ("met" if aim["met"] else "not met")


def print_tables(result: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    series = result["bandwidth"]["series"]
    sizes = _sizes(result)
    reps = result["settings"]["repeats"]
    t = Table(title=f"kvstore bandwidth, GB/s (x this run's memcpy), best of {reps}; "
                    "bytes counted once")
    t.add_column("system / op")
    for size in sizes:
        t.add_column(f"{size / MiB:g} MiB", justify="right")
    t.add_row("memcpy", *[f"{r['gbps']:.2f}" for r in series["memcpy"]])
    t.add_row("checksum (xxh3)", *[f"{r['gbps']:.2f} ({r['vs_memcpy']:.2f}x)" for r in series["crc32"]])
    for name, op, label in ROWS:
        rows = {r["size_bytes"]: r for r in series.get(name, [])}
        if not rows:
            why = result.get(name, {}).get("reason") if name in ("redis", "mooncake") else None
            t.add_row(label, *["n/a" for _ in sizes])
            if why and op == "put":
                t.caption = (t.caption + "\n" if t.caption else "") + f"{name}: not measured: {why}"
            continue
        t.add_row(label, *[f"{rows[s][op + '_gbps']:.2f} ({rows[s][op + '_vs_memcpy']:.2f}x)"
                           if s in rows else "n/a" for s in sizes])
    console.print(t)
    print_tls(result, console)

    b = result["batch_get"]
    bt = Table(title=f"batch get: {b['objects']} objects of {b['object_bytes'] // 1024} KiB, "
                     f"best of {b['repeats']}")
    for col in ("system", "objects/s", "GB/s", "x redis MGET"):
        bt.add_column(col, justify="right" if col != "system" else "left")
    for name, how in BATCH_SYSTEMS.items():
        v = b["systems"].get(name)
        if v is None:
            bt.add_row(how, "n/a", "n/a", "n/a")
        else:
            vs = "n/a" if v["vs_redis_mget"] is None else f"{v['vs_redis_mget']:.2f}x"
            bt.add_row(how, f"{v['objects_per_s']:,.0f}", f"{v['gbps']:.3f}", vs)
    console.print(bt)

    tr = result["trace"]
    tt = Table(title=f"trace hit rate (hit blocks / all blocks): {tr['requests']} requests, "
                     f"{tr['total_blocks']} blocks "
                     f"({tr['unique_blocks']} distinct); object = {tr['scale']:g} x "
                     f"{tr['full_block_bytes'] // MiB} MiB = {tr['object_bytes'] / MiB:g} MiB")
    for col in ("blocks", "bytes", "MasterCore", "exact LRU", "ideal", "of ideal", "evicted",
                "unreachable"):
        tt.add_column(col, justify="right")
    for r in tr["capacities"]:
        of = "n/a" if r["vs_ideal"] is None else f"{r['vs_ideal']:.0%}"
        tt.add_row(f"{r['capacity_blocks']:,}", f"{r['capacity_bytes'] / MiB:,.0f} MiB",
                   f"{r['hit_rate']:.1%}", f"{r['lru_hit_rate']:.1%}",
                   f"{tr['ideal_hit_rate']:.1%}",
                   of, f"{r['evictions']:,}", f"{r['put_already_stored']:,}")
    tt.caption = ("blocks: capacity; unreachable: missing blocks already stored behind an "
                  "evicted earlier block; trace: " + tr["attribution"])
    console.print(tt)

    for name, aim in result["aims"].items():
        if aim["met"] is None:
            console.print(f"aim {name} >= {aim['aim']}: not measured; {aim.get('note', '')}")
        else:
            console.print(f"aim {name} >= {aim['aim']}: {_met(aim)} (min {aim['min']:.2f}x; "
                          f"{aim['figure']})")


def _tls_table(title: str, ratios: list[dict[str, Any]], console: Any) -> None:
    from rich.table import Table

    sizes = sorted({r["size_bytes"] for r in ratios})
    t = Table(title=title)
    t.add_column("system / op")
    for size in sizes:
        t.add_column(f"{size / MiB:g} MiB", justify="right")
    for system, label in (("pdserve_tcp", "pdserve tcp"), ("raw_tcp", "raw tcp")):
        for op in ("get", "put"):
            cells = {r["size_bytes"]: r for r in ratios if r["system"] == system and r["op"] == op}
            t.add_row(f"{label} {op}", *[
                f"{c['tls_gbps']:.2f} / {c['plaintext_gbps']:.2f} = {c['ratio']:.2f}x "
                f"(med {c['round_ratio_median']:.2f}, {c['round_ratio_min']:.2f}-"
                f"{c['round_ratio_max']:.2f})" if c else "n/a"
                for c in (cells.get(z) for z in sizes)])
    console.print(t)


def print_tls(result: dict[str, Any], console: Any) -> None:
    """Internal TLS: the settings measured, the ratio tables, the cipher and its ceiling."""
    tls = result.get("internal_tls")
    if not tls:
        return
    console.print(f"internal TLS: --internal-tls {tls['mode']} (rows measured once ran with "
                  f"TLS {tls['main']}); TLS folder: {tls.get('folder') or 'none'}")
    neg, ceil = tls.get("negotiated"), tls.get("crypto_ceiling") or {}
    if neg:
        console.print(f"data connections negotiate {neg['version']} {neg['cipher']}")
    if ceil.get("gbps"):
        console.print(f"crypto ceiling: `{ceil['command']}`: {ceil['gbps']:.2f} GB/s on one core "
                      f"({ceil.get('openssl')})")
    elif ceil:
        console.print(f"crypto ceiling: not measured: {ceil.get('reason')}")
    def head(rounds: int) -> str:
        return (f"GB/s with TLS / without (best of {rounds} interleaved rounds) = ratio (the "
                "rounds' pairs: median, lowest-highest)")
    if tls["ratios"]:
        _tls_table(f"internal TLS over TCP on loopback: {head(tls['rounds'])}", tls["ratios"],
                   console)
    link = tls["link"]
    if link.get("available"):
        _tls_table(f"internal TLS over a link shaped to {link['rate']} (nominal "
                   f"{link['nominal_gbps']:.2f} GB/s): {head(link['rounds'])}",
                   link["ratios"], console)
    else:
        console.print(f"shaped link: not measured: {link.get('reason')}")


def _plot_tls(result: dict[str, Any], path: str) -> None:
    from matplotlib.figure import Figure

    tls = result["internal_tls"]
    fig = Figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.add_subplot()
    places = [("loopback", tls["ratios"], "-")]
    if tls["link"].get("available"):
        places.append((f"link {tls['link']['rate']}", tls["link"]["ratios"], "--"))
    marks = {("pdserve_tcp", "get"): "o", ("pdserve_tcp", "put"): "s",
             ("raw_tcp", "get"): "^", ("raw_tcp", "put"): "v"}
    for place, ratios, line in places:
        for i, ((system, op), mark) in enumerate(marks.items()):
            rows = sorted((r for r in ratios if r["system"] == system and r["op"] == op),
                          key=lambda r: r["size_bytes"])
            if not rows:
                continue
            xs = [r["size_bytes"] / MiB for r in rows]
            ax.errorbar(xs, [r["ratio"] for r in rows],
                        yerr=[[r["ratio"] - r["round_ratio_min"] for r in rows],
                              [r["round_ratio_max"] - r["ratio"] for r in rows]],
                        fmt=line + mark, capsize=3, color=f"C{i}",
                        label=f"{system.replace('_', ' ')} {op}, {place}")
    aim = result["aims"].get("tls_tcp_get_vs_plaintext", {}).get("aim")
    if aim:
        ax.axhline(aim, color="k", linestyle=":", label=f"aim {aim:g}x")
    ax.axhline(1.0, color="grey", linewidth=0.5)
    ax.set_xscale("log", base=2)
    sizes = sorted({r["size_bytes"] / MiB for _, ratios, _ in places for r in ratios})
    ax.set_xticks(sizes, [f"{z:g}" for z in sizes])
    ax.set_ylim(0, 1.2)
    ax.set_xlabel("object size (MiB)")
    ax.set_ylabel("GB/s with internal TLS / without")
    rounds = f"{tls['rounds']}" + (f" (link: {tls['link']['rounds']})"
                                    if tls["link"].get("available") else "")
    ax.set_title(f"internal TLS over TCP: best of {rounds} interleaved rounds; "
                 "bars: the rounds' own ratios", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower left", ncol=2)
    fig.savefig(path, dpi=120)


def _plot_bandwidth(result: dict[str, Any], path: str) -> None:
    from matplotlib.figure import Figure

    series = result["bandwidth"]["series"]
    sizes = [s / MiB for s in _sizes(result)]
    fig = Figure(figsize=(11, 4.5), layout="constrained")
    styles = {"pdserve_shm": "o-", "raw_shm": "o:", "pdserve_tcp": "s-", "raw_tcp": "s:",
              "pdserve_tcp_tls": "x-", "raw_tcp_tls": "x:",
              "pdserve_ucx": "v-",
              "redis": "^-", "mooncake": "D-"}
    for i, op in enumerate(("get", "put")):
        ax = fig.add_subplot(1, 2, i + 1)
        ax.plot(sizes, [r["gbps"] for r in series["memcpy"]], "k--", label="memcpy")
        for name, row_op, label in ROWS:
            rows = series.get(name)
            if row_op != op or not rows:
                continue
            ax.plot([r["size_bytes"] / MiB for r in rows], [r[op + "_gbps"] for r in rows],
                    styles[name], label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(sizes, [f"{s:g}" for s in sizes])
        ax.set_xlabel("object size (MiB)")
        ax.set_ylabel("GB/s (1e9 B/s, bytes counted once)")
        ax.set_title(f"{op}, best of {result['settings']['repeats']}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    if "mooncake" not in series:
        fig.suptitle(f"Mooncake not measured: {result['mooncake'].get('reason')}"[:120], fontsize=8)
    fig.savefig(path, dpi=120)


def _plot_trace(result: dict[str, Any], path: str) -> None:
    from matplotlib.figure import Figure

    tr = result["trace"]
    caps = [r["capacity_blocks"] for r in tr["capacities"]]
    fig = Figure(figsize=(6, 4), layout="constrained")
    ax = fig.add_subplot()
    ax.plot(caps, [r["hit_rate"] for r in tr["capacities"]], "o-", label="pdserve MasterCore")
    ax.plot(caps, [r["lru_hit_rate"] for r in tr["capacities"]], "s--", label="exact LRU")
    ax.axhline(tr["ideal_hit_rate"], color="k", linestyle=":",
               label=f"ideal (unbounded) {tr['ideal_hit_rate']:.1%}")
    ax.set_xscale("log")
    ax.set_xticks(caps, [f"{c:,}" for c in caps])
    ax.set_ylim(0, max(0.05, tr["ideal_hit_rate"] * 1.15))
    ax.set_xlabel("store capacity (blocks of 512 tokens)")
    ax.set_ylabel("hit rate (hit blocks / all blocks)")
    ax.set_title(f"Mooncake conversation trace, {tr['requests']} requests, "
                 f"object {tr['object_bytes'] / MiB:g} MiB (x{tr['scale']:g})", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=120)


def write_outputs(result: dict[str, Any], out_dir: str) -> list[str]:
    paths = [write_json(result, out_dir, "kvstore.json")] + [
        os.path.join(out_dir, n) for n in ("kvstore_bandwidth.png", "kvstore_trace.png")]
    _plot_bandwidth(result, paths[1])
    _plot_trace(result, paths[2])
    tls = result.get("internal_tls", {})
    if tls.get("ratios") or tls.get("link", {}).get("ratios"):
        paths.append(os.path.join(out_dir, "kvstore_tls.png"))
        _plot_tls(result, paths[-1])
    return paths

