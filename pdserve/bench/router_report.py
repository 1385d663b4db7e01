"""Tables and the PNG of `pdserve bench router`.

Owns presentation only: per router count and API, a row per rate window; the cost per token
and per request with what one core carries at it against the aims; the highest rate within
the latency limits; throughput against the number of routers. Must not measure anything.
"""

from __future__ import annotations

from typing import Any

from rich.table import Table

from pdserve.output import write_report

WINDOW_COLUMNS = ("routers", "api", "rate req/s", "sent", "ok", "refused", "tokens/s",
                  "TTFT p50 ms", "TTFT p99 ms", "gap p50 ms", "gap p99 ms", "router cores",
                  "client cores")
COST_COLUMNS = ("routers", "api", "CPU us/token", "CPU us/request", "tokens/s per core",
                "requests/s per core", "within limits: req/s", "tokens/s", "per core: tokens/s",
                "req/s")


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.1f}"


def _n(x: float | None, fmt: str = "{:.0f}") -> str:
    return "-" if x is None else fmt.format(x)


def window_rows(result: dict[str, Any]) -> list[list[str]]:
    out = []
    for run in result["runs"]:
        for api, a in run["apis"].items():
            for w in a["windows"]:
                out.append([str(run["routers"]), api, f"{w['rate_rps']:g}", str(w["sent"]),
                            str(w["ok"]), str(w["refused"]), f"{w['tokens_per_s']:.0f}",
                            _ms(w["ttft_p50_s"]), _ms(w["ttft_p99_s"]), _ms(w["gap_p50_s"]),
                            _ms(w["gap_p99_s"]), f"{w['router_cores']:.2f}",
                            f"{w.get('client_cores', 0.0):.2f}"])
    return out


def cost_rows(result: dict[str, Any]) -> list[list[str]]:
    out = []
    for run in result["runs"]:
        for api, a in run["apis"].items():
            c, core, lim = a["cost"] or {}, a["per_core"] or {}, a["within_limits"] or {}
            out.append([str(run["routers"]), api, _n(c.get("us_per_token"), "{:.1f}"),
                        _n(c.get("us_per_request")), _n(core.get("tokens_per_s")),
                        _n(core.get("requests_per_s"), "{:.1f}"),
                        _n(lim.get("requests_per_s"), "{:.1f}"), _n(lim.get("tokens_per_s")),
                        _n(lim.get("tokens_per_s_per_core")),
                        _n(lim.get("requests_per_s_per_core"), "{:.1f}")])
    return out


def _md(columns, rows) -> list[str]:
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns),
            *("| " + " | ".join(r) + " |" for r in rows)]


def markdown(result: dict[str, Any]) -> str:
    return "\n".join([*_md(COST_COLUMNS, cost_rows(result)), "",
                      *_md(WINDOW_COLUMNS, window_rows(result))])


def print_tables(result: dict[str, Any], console: Any) -> None:
    s, aims = result["settings"], result["aims"]
    t = Table(title=f"bench router: CPU per streamed token and request ({result['profile']} "
                    f"emulated workers, {s['max_tokens']}-token answers, {result['machine']}); "
                    f"aims per core: {aims['tokens_per_s_per_core']:,} tokens/s, "
                    f"{aims['requests_per_s_per_core']} requests/s; limits: +"
                    f"{s['ttft_limit_s'] * 1000:g} ms TTFT p99, +{s['itl_limit_s'] * 1000:g} ms "
                    f"gap p99")
    for c in COST_COLUMNS:
        t.add_column(c)
    for r in cost_rows(result):
        t.add_row(*r)
    console.print(t)
    t = Table(title="windows (router cores: the routers' CPU seconds per second, idle removed)")
    for c in WINDOW_COLUMNS:
        t.add_column(c)
    for r in window_rows(result):
        t.add_row(*r)
    console.print(t)
    for run in result["runs"]:
        c = run.get("convergence")
        if c:
            console.print(f"{run['routers']} routers: a move in the membership table listed by "
                          f"every router in {c['p50_s'] * 1000:.1f} ms (p50), "
                          f"{c['max_s'] * 1000:.1f} ms at most, over {c['moves']} moves")
    for api, rows in result["scaling"].items():
        console.print(f"{api}: " + "; ".join(
            f"{r['routers']} router(s) {r['tokens_per_s']:.0f} tokens/s"
            + ("" if r["vs_n_times_one"] is None else f" ({r['vs_n_times_one']:.2f} x N x one)")
            for r in rows))


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    styles = {"http": "o-", "grpc": "s--"}
    for run in result["runs"]:
        for api, a in run["apis"].items():
            ws = a["windows"]
            label = f"{api}, {run['routers']} router(s)"
            axes[0].plot([w["tokens_per_s"] for w in ws],
                         [(w["ttft_p99_s"] or 0) * 1000 for w in ws], styles[api], label=label)
            axes[1].plot([w["tokens_per_s"] for w in ws], [w["router_cores"] for w in ws],
                         styles[api], label=label)
    axes[0].set_xlabel("tokens/s delivered")
    axes[0].set_ylabel("TTFT p99, ms")
    axes[0].set_yscale("log")
    axes[0].set_title("latency against load")
    axes[1].set_xlabel("tokens/s delivered")
    axes[1].set_ylabel("router CPU, cores (idle removed)")
    axes[1].set_title("router CPU against load")
    ax = axes[2]
    for api, rows in result["scaling"].items():
        ax.plot([r["routers"] for r in rows], [r["tokens_per_s"] for r in rows], styles[api],
                label=f"{api}: measured")
        if rows and rows[0]["tokens_per_s"]:
            ax.plot([r["routers"] for r in rows],
                    [0.8 * r["routers"] * rows[0]["tokens_per_s"] for r in rows], ":",
                    label=f"{api}: 0.8 x N x one router")
    ax.set_xlabel("routers")
    ax.set_ylabel("most tokens/s served in a window")
    ax.set_title(f"routers on one host ({result['machine']})")
    for ax in axes:
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(result: dict[str, Any], out_dir: str) -> list[str]:
    return write_report(result, out_dir, "router", plot, markdown)
