"""Tables and the PNG of `pdserve bench emulate` (one row per cluster size).

Owns presentation only. Must not measure anything.
"""

from __future__ import annotations

from typing import Any

from rich.table import Table

from pdserve.output import write_report

COLUMNS = ("workers", "start s", "worker RSS / PSS MB", "router RSS MB", "router CPU idle",
           "router CPU load", "controller CPU idle", "master CPU load", "master calls/s",
           "master call p99 ms", "workers CPU load",
           "tick observe p99 ms", "tick decide p99 ms", "KV event lag p99 ms",
           "rebalance s (flips)", "killed", "out of pools s", "restarted s", "back s",
           "requests correct")


def _ms(h: dict | None) -> str:
    return "-" if not h else f"<={h['p99_le'] * 1000:g}"


def _cpu(d: dict, kind: str, key: str = "sum") -> str:
    return f"{d[kind][key]:.2f}" if kind in d else "-"


def _master(m: dict | None) -> list[str]:
    if not m:
        return ["-", "-"]
    return [f"{m['per_s']:g}", "-" if m["p99_le"] is None else f"<={m['p99_le'] * 1000:g}"]


def rows(result: dict[str, Any]) -> list[list[str]]:
    out = []
    for s in result["sizes"]:
        m, tick, kill = s["memory"], s["controller_tick"], s["kill_tenth"]
        out.append([str(s["workers"]), f"{s['start_s']:.0f}",
                    f"{m['worker']['mean_mb']:.0f} / {m['worker']['pss_mean_mb']:.0f}",
                    f"{m['router']['mean_mb']:.0f}",
                    _cpu(s["cpu_idle"], "router"), _cpu(s["cpu_load"], "router"),
                    _cpu(s["cpu_idle"], "controller"), _cpu(s["cpu_load"], "kvmaster"),
                    *_master(s.get("master_calls")),
                    _cpu(s["cpu_load"], "worker"),
                    _ms(tick.get("observe")), _ms(tick.get("decide")), _ms(s["kv_event_lag"]),
                    f"{s['rebalance']['seconds']:.1f} ({s['rebalance']['ok']}/"
                    f"{s['rebalance']['flips']})",
                    str(kill["killed"]), str(kill["out_of_pools_s"]), str(kill["restarted_s"]),
                    str(kill["back_in_pools_s"]),
                    f"{s['load']['correct']}/{s['load']['requests']}"])
    return out


def markdown(result: dict[str, Any]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(r) + " |" for r in rows(result)]
    return "\n".join(lines)


def print_tables(result: dict[str, Any], console: Any) -> None:
    s = result["settings"]
    t = Table(title=f"bench emulate: the control plane against N ({result['profile']}, "
                    f"{s['rate_rps']:g} requests/s, {result['machine']}); CPU in cores, summed "
                    f"over a kind's processes")
    table = rows(result)  # one column per size: the figures read down
    t.add_column("")
    for r in table:
        t.add_column(f"{r[0]} workers")
    for i, name in enumerate(COLUMNS[1:], start=1):
        t.add_row(name, *(r[i] for r in table))
    console.print(t)


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = result["sizes"]
    n = [s["workers"] for s in sizes]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    ax = axes[0]
    for kind, style in (("router", "o-"), ("controller", "s-"), ("kvmaster", "^-"),
                        ("worker", "d--")):
        ax.plot(n, [s["cpu_idle"].get(kind, {}).get("sum", 0.0) for s in sizes], style,
                label=f"{kind} (idle)")
    ax.plot(n, [s["cpu_load"].get("router", {}).get("sum", 0.0) for s in sizes], "o:",
            label="router (load)")
    ax.set_xlabel("workers")
    ax.set_ylabel("CPU cores (summed over the kind's processes)")
    ax.set_title("control-plane CPU")
    ax.legend(fontsize=7)
    ax = axes[1]
    for part, style in (("observe", "o-"), ("decide", "s-"), ("whole", "^-")):
        ax.plot(n, [((s["controller_tick"].get(part) or {}).get("p99_le") or 0) * 1000
                    for s in sizes], style, label=f"controller tick: {part} p99")
    ax.plot(n, [((s["kv_event_lag"] or {}).get("p99_le") or 0) * 1000 for s in sizes], "d--",
            label="KV event lag p99")
    ax.plot(n, [((s.get("master_calls") or {}).get("p99_le") or 0) * 1000 for s in sizes], "v:",
            label="store master call p99 (under load)")
    ax.set_xlabel("workers")
    ax.set_ylabel("ms (histogram bucket bound)")
    ax.set_yscale("log")
    ax.set_title("latency of the control loops")
    ax.legend(fontsize=7)
    ax = axes[2]
    def secs(key: str) -> list[float]:  # None (never happened) is left out of the line
        return [float("nan") if s["kill_tenth"][key] is None else s["kill_tenth"][key]
                for s in sizes]
    ax.plot(n, secs("out_of_pools_s"), "o-", label="a tenth killed: out of the pools")
    ax.plot(n, secs("restarted_s"), "v-", label="... restarted")
    ax.plot(n, secs("back_in_pools_s"), "s-", label="... back in the pools")
    ax.plot(n, [s["rebalance"]["seconds"] for s in sizes], "^-", label="rebalance (N/16 flips)")
    ax.plot(n, [s["start_s"] for s in sizes], "d--", label="cluster start")
    ax.set_xlabel("workers")
    ax.set_ylabel("seconds")
    ax.set_title("membership and flips")
    ax.legend(fontsize=7)
    fig.suptitle(f"emulated clusters ({result['profile']}) on {result['machine']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(result: dict[str, Any], out_dir: str) -> list[str]:
    return write_report(result, out_dir, "emulate", plot, markdown)
