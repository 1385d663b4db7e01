"""`pdserve sim run`: one simulated cluster on one trace, summarised as a table, JSON and a PNG.

Owns the command's flags and what a person sees: progress on stderr, the summary table (or one
JSON document with `--json`), and with `--out DIR` the full report (`report.json`, per-request
records included), `summary.json` and `roles.png` (workers per role over time, TTFT and ITL
distributions). Must not simulate itself (`run.simulate`) nor define step times (the profile,
`pdserve.core.step_profile.load_profile`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from pdserve.controller.policy import PolicyConfig
from pdserve.router.policy import DECODE_POLICIES, PREFILL_POLICIES
from pdserve.sim.config import LINKS, SimConfig, SimConfigError
from pdserve.sim.trace import TraceError, load_trace


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", required=True, help="a .jsonl (Mooncake), .csv (Azure) or "
                   "synthetic:poisson:rate=R,n=N,in=MEAN,out=MEAN (or synthetic:gamma:cv=C,...)")
    p.add_argument("--prefill", type=int, default=1, help="prefill workers")
    p.add_argument("--decode", type=int, default=1, help="decode workers")
    p.add_argument("--profile", default="h100-llama3-8b",
                   help="a shipped step-time profile name or a profile JSON file")
    p.add_argument("--policy", default="kv_aware", choices=PREFILL_POLICIES,
                   help="prefill routing policy")
    p.add_argument("--decode-policy", default="free_kv", choices=DECODE_POLICIES)
    p.add_argument("--controller", choices=("on", "off"), default="off",
                   help="run the controller's decide() in the loop (role flips, offload)")
    p.add_argument("--migrate", choices=("on", "off"), default="on",
                   help="a decode worker's flip moves its running requests with their KV "
                        "(off: they finish in place)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--limit", type=int, default=None, help="first N requests of the trace")
    p.add_argument("--scale-rate", type=float, default=1.0,
                   help="arrivals this many times faster (time compression)")
    p.add_argument("--scale-lengths", type=float, default=1.0,
                   help="prompt and output lengths times this")
    p.add_argument("--duration-s", type=float, default=None,
                   help="tile the trace back to back to this many seconds")
    p.add_argument("--copies", type=int, default=1,
                   help="overlay this many copies of the trace (own prefixes, seeded offsets)")
    p.add_argument("--block-size", type=int, default=16,
                   help="KV block size in tokens (the Mooncake trace names prefixes per 512 "
                        "tokens: 512 keeps all of its sharing and runs several times faster)")
    p.add_argument("--kv-blocks", type=int, default=None,
                   help="KV blocks per worker (default: the profile's capacity)")
    p.add_argument("--store-blocks", type=int, default=10_000_000,
                   help="shared KV store capacity in blocks (0: no store)")
    p.add_argument("--transport", default="tcp")
    p.add_argument("--link", choices=LINKS, default="per_worker")
    p.add_argument("--workers-per-host", type=int, default=None,
                   help="workers sharing one host's cores, for a CPU profile (host_cores)")
    p.add_argument("--max-local-prefill-tokens", type=int,
                   default=SimConfig.max_local_prefill_tokens,
                   help="a decode worker caching all but this many tokens of a prompt prefills "
                        "it itself (conditional disaggregation, the router's default; 0: off)")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-itl-ms", type=float, default=200.0)
    p.add_argument("--json", action="store_true", help="print the summary as one JSON document")
    p.add_argument("--out", default=None, help="write report.json, summary.json, roles.png here")


def load_profile_named(name: str):
    try:
        from pdserve.core.step_profile import load_profile
    except ModuleNotFoundError as e:
        raise SimConfigError(f"--profile: step-time profiles are not available in this "
                             f"installation ({e.name} is missing)") from None
    return load_profile(name)


def config_from(args) -> SimConfig:
    return SimConfig(
        prefill_workers=args.prefill, decode_workers=args.decode, prefill_policy=args.policy,
        decode_policy=args.decode_policy, controller=args.controller == "on",
        migrate=args.migrate == "on",
        policy=PolicyConfig(), block_size=args.block_size, kv_blocks=args.kv_blocks,
        store_capacity_blocks=args.store_blocks, transport=args.transport, link=args.link,
        slo_ttft_ms=args.slo_ttft_ms, slo_itl_ms=args.slo_itl_ms, seed=args.seed,
        workers_per_host=args.workers_per_host,
        max_local_prefill_tokens=args.max_local_prefill_tokens)


def _progress():
    started = time.perf_counter()
    last = [0.0]

    def show(now_s: float, done: int, total: int) -> None:
        t = time.perf_counter()
        if t - last[0] < 1.0 and done < total:
            return
        last[0] = t
        print(f"\rsim {now_s:9.1f} s simulated | {done}/{total} requests | "
              f"{t - started:6.1f} s wall", end="" if done < total else "\n", file=sys.stderr,
              flush=True)
    return show


def run(args) -> int:
    try:
        cfg = config_from(args)
        profile = load_profile_named(args.profile)
        requests = load_trace(args.trace, scale_rate=args.scale_rate,
                              scale_lengths=args.scale_lengths, limit=args.limit,
                              seed=args.seed, duration_s=args.duration_s, copies=args.copies)
    except (SimConfigError, TraceError, ValueError, OSError) as e:
        print(f"pdserve sim run: {e}", file=sys.stderr)
        return 2
    from pdserve.sim.run import simulate

    report = simulate(cfg, requests, profile, progress=_progress())
    summary = report.summary()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "report.json"), "w") as f:
            f.write(report.to_json())
        with open(os.path.join(args.out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1, sort_keys=True)
        plot(report, os.path.join(args.out, "roles.png"))
    if args.json:
        print(json.dumps({"summary": summary, "wall_s": report.wall_s}, sort_keys=True))
        return 0
    print_table(summary, report.wall_s, report.profile)
    if args.out:
        print(f"wrote {args.out}/report.json, summary.json, roles.png")
    return 0


def print_table(s: dict, wall_s: float, profile: str) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"pdserve sim run ({profile})")
    for col in ("metric", "mean", "p50", "p90", "p99"):
        t.add_column(col, justify="right" if col != "metric" else "left")
    for key, label in (("ttft_s", "TTFT s"), ("itl_s", "ITL s (per request)"),
                       ("e2e_s", "e2e s")):
        d = s[key]
        t.add_row(label, *("-" if d[q] is None else f"{d[q]:.4f}"
                           for q in ("mean", "p50", "p90", "p99")))
    c = Console()
    c.print(t)
    att = s["slo_attainment"]
    c.print(f"requests {s['requests']} (finished {s['finished']}, rejected {s['rejected']}); "
            f"SLO attainment {'-' if att is None else f'{att:.3f}'} (TTFT <= "
            f"{s['slo']['ttft_s']} s, ITL <= {s['slo']['itl_s']} s); goodput "
            f"{s['goodput_rps']:.2f} req/s; {s['worker_hours']:.2f} worker-hours; flips "
            f"{s['flips']} ({s.get('failed_flips', 0)} failed: drain timeout), draining "
            f"{s['drain_s']:.1f} s; {_moves(s)}{s['events']} events in "
            f"{wall_s:.1f} s wall ({s['events'] / max(wall_s, 1e-9):.0f} events/s)")


def _moves(s: dict) -> str:
    """Running decodes moved with their KV, by reason, and their stall; "" when none moved."""
    moves = s.get("migrations") or {}
    if not sum(moves.values()):
        return ""
    stall = s["migration_stall_s"]
    return (f"moved {sum(moves.values())} decodes ("
            + ", ".join(f"{n} {why}" for why, n in moves.items())
            + f"; {s['migration_bytes'] / 1e9:.2f} GB put), stall p50 "
            + ("-" if stall["p50"] is None else f"{stall['p50']:.3f}")
            + " s; ")


def plot(report, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4))
    ax1, ax2 = fig.subplots(1, 2)
    end = report.counts.get("sim_end_s", 0.0)
    roles = list(report.roles) + ([(end, *report.roles[-1][1:])] if report.roles else [])
    ts = [r[0] for r in roles]
    for col, label in ((1, "prefill"), (2, "decode"), (3, "flipping")):
        ax1.step(ts, [r[col] for r in roles], where="post", label=label)
    ax1.set_xlabel("simulated time (s)")
    ax1.set_ylabel("workers")
    ax1.set_title("roles over time")
    ax1.legend()
    done = [i for i, st in enumerate(report.status) if st == "ok"]
    for values, label in (([report.ttft_s[i] for i in done], "TTFT"),
                          ([x for x in (report.itl_s(i) for i in done) if x is not None],
                           "ITL")):
        if values:
            v = sorted(values)
            ax2.plot(v, [(k + 1) / len(v) for k in range(len(v))], label=label)
    ax2.set_xscale("log")
    ax2.set_xlabel("seconds")
    ax2.set_ylabel("fraction of requests")
    ax2.set_title("latency CDF")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
