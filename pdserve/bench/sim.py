"""`pdserve bench sim`: how fast the cluster simulator runs on this machine.

Owns one measurement of the simulator (not of a cluster): for each case, the wall and CPU
seconds of `simulate`, events processed and events per second, engine steps modelled (a decode
run of k steps is one event), requests per second of wall time, and the run's pace (wall time
against simulated time, sampled as it goes; by quarter in the table, drawn in `sim_report`). Cases:
- `100k`: a 100,000-request synthetic Poisson trace (prompt 512, output 128 tokens on average)
  on 8 prefill + 8 decode workers with KV-aware routing;
- `1000w`: 1,000 workers (750 prefill, 250 decode) on the Mooncake conversation trace at its
  arrival rate scaled to that cluster (`trace.for_cluster`: one copy of the trace per
  `workers_per_copy` workers, tiled to `duration_s`; 3,600 s is the hour, `--quick` takes 60 s),
  512-token KV blocks (the trace's own prefix granularity).
The result says how many of the hot modules ran compiled (`scripts/compile.sh`; the same
decisions, fewer instructions). With `--projected`, a case cut short by `duration_s` also
reports the wall time its full hour would take at the measured rate (labelled as a
projection). Must not assert speed: it reports.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

from pdserve.output import emit

HOUR_S = 3600.0


@dataclass(frozen=True)
class SimBenchSettings:
    profile: str = "h100-llama3-8b"
    cases: tuple[str, ...] = ("100k", "1000w")
    requests: int = 100_000  # the 100k case
    rate: float = 100.0  # its arrivals per second
    workers: int = 1000  # the 1000w case
    prefill_share: float = 0.75
    workers_per_copy: int = 8
    duration_s: float = HOUR_S
    policy: str = "kv_aware"
    mooncake: str = ""  # "" -> ../shared/traces/mooncake_conversation_trace.jsonl
    seed: int = 0


def _mooncake(path: str) -> str:
    if path:
        return path
    from pdserve.bench.route_trace import default_trace_path
    return str(default_trace_path())


def measure(name: str, cfg, requests, profile, progress=None) -> dict[str, Any]:
    from pdserve.sim.run import simulate

    # The run's pace: [simulated s, wall s since the start, requests done] each time the
    # simulator reports progress (every 65,536 events, and at the end).
    pace: list[list[float]] = []
    started = time.perf_counter()

    def sample(now_s: float, done: int, total: int) -> None:
        pace.append([round(now_s, 6), round(time.perf_counter() - started, 6), done])
        if progress is not None:
            progress(now_s, done, total)

    cpu0 = time.process_time()
    report = simulate(cfg, requests, profile, progress=sample)
    cpu = time.process_time() - cpu0
    s = report.summary()
    return {"case": name, "requests": len(requests), "workers": s["workers"],
            "simulated_s": s["sim_end_s"], "wall_s": report.wall_s, "cpu_s": cpu,
            "events": s["events"], "steps": s["steps"],
            "events_per_s": s["events"] / max(report.wall_s, 1e-9),
            "events_per_cpu_s": s["events"] / max(cpu, 1e-9),
            "requests_per_s": len(requests) / max(report.wall_s, 1e-9),
            "finished": s["finished"], "slo_attainment": s["slo_attainment"],
            "ttft_mean_s": s["ttft_s"]["mean"], "itl_mean_s": s["itl_s"]["mean"],
            "quarters_wall_per_sim_s": quarters(pace, s["sim_end_s"]), "pace": pace}


def wall_at(pace: list[list[float]], sim_s: float) -> float:
    """Wall seconds the run had taken when the simulation reached `sim_s` (linear between
    the samples of `pace`; the start is (0, 0))."""
    prev_sim, prev_wall = 0.0, 0.0
    for now_s, wall_s, _ in pace:
        if now_s >= sim_s:
            if now_s <= prev_sim:
                return wall_s
            return prev_wall + (wall_s - prev_wall) * (sim_s - prev_sim) / (now_s - prev_sim)
        prev_sim, prev_wall = now_s, wall_s
    return prev_wall


def quarters(pace: list[list[float]], end_s: float) -> list[float]:
    """Wall seconds per simulated second in each quarter of the simulated span [0, end_s]."""
    if end_s <= 0 or not pace:
        return [0.0] * 4
    cuts = [end_s * q / 4 for q in range(5)]
    walls = [wall_at(pace, c) for c in cuts]
    return [(walls[q + 1] - walls[q]) / (cuts[q + 1] - cuts[q]) for q in range(4)]


def run_bench(s: SimBenchSettings, progress=None) -> dict[str, Any]:
    import pdserve.engine.scheduler  # noqa: F401 - loaded before timing starts
    from pdserve.sim.config import SimConfig
    from pdserve.core.step_profile import load_profile
    from pdserve.sim.trace import for_cluster, load_trace

    profile = load_profile(s.profile)
    rows = []
    if "100k" in s.cases:
        reqs = load_trace(f"synthetic:poisson:rate={s.rate},n={s.requests},in=512,out=128",
                          seed=s.seed)
        cfg = SimConfig(prefill_workers=8, decode_workers=8, prefill_policy=s.policy,
                        seed=s.seed)
        rows.append(measure("100k", cfg, reqs, profile, progress))
    if "1000w" in s.cases:
        base = load_trace(_mooncake(s.mooncake), seed=s.seed)
        reqs = for_cluster(base, workers=s.workers, workers_per_copy=s.workers_per_copy,
                           duration_s=s.duration_s, seed=s.seed)
        prefill = max(1, round(s.workers * s.prefill_share))
        cfg = SimConfig(prefill_workers=prefill, decode_workers=s.workers - prefill,
                        prefill_policy=s.policy, block_size=512, seed=s.seed)
        row = measure("1000w", cfg, reqs, profile, progress)
        row["duration_s"] = s.duration_s
        row["copies"] = max(1, round(s.workers / s.workers_per_copy))
        if s.duration_s < HOUR_S:
            row["projected_hour_wall_s"] = row["wall_s"] * HOUR_S / s.duration_s
        rows.append(row)
    from pdserve.compiled import MODULES, compiled

    return {"bench": "sim", "settings": asdict(s), "profile": profile.origin,
            # How many of the hot modules ran compiled (scripts/compile.sh): the same
            # decisions, fewer instructions per event.
            "compiled_modules": f"{len(compiled())}/{len(MODULES)}",
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                        "python": platform.python_version()},
            "rows": rows}


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    d = SimBenchSettings()
    p.add_argument("--profile", default=d.profile)
    p.add_argument("--cases", default=",".join(d.cases), help="100k, 1000w or both")
    p.add_argument("--requests", type=int, default=d.requests, help="size of the 100k case")
    p.add_argument("--workers", type=int, default=d.workers)
    p.add_argument("--workers-per-copy", type=int, default=d.workers_per_copy,
                   help="workers one copy of the Mooncake trace's arrival rate loads")
    p.add_argument("--duration-s", type=float, default=d.duration_s,
                   help="simulated seconds of the 1000w case (the hour: 3600)")
    p.add_argument("--policy", default=d.policy)
    p.add_argument("--trace", default=d.mooncake,
                   help="the Mooncake JSONL trace of the 1000w case "
                        "(default: ../shared/traces/mooncake_conversation_trace.jsonl)")
    p.add_argument("--quick", action="store_true",
                   help="CI size: 10,000 requests and 60 simulated seconds")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", default=None, help="write sim_bench.json and sim_bench.png here")
    return p


def settings_of(args) -> SimBenchSettings:
    cases = tuple(c for c in args.cases.split(",") if c)
    for c in cases:
        if c not in ("100k", "1000w"):
            raise ValueError(f"--cases: unknown case {c!r} (100k, 1000w)")
    if args.requests < 1 or args.workers < 2 or args.workers_per_copy < 1:
        raise ValueError("--requests, --workers (>= 2) and --workers-per-copy must be positive")
    if args.trace and not os.path.isfile(args.trace):
        raise ValueError(f"--trace: no such file {args.trace!r}")
    if not args.duration_s > 0:
        raise ValueError(f"--duration-s must be > 0, got {args.duration_s}")
    return SimBenchSettings(
        profile=args.profile, cases=cases,
        requests=min(args.requests, 10_000) if args.quick else args.requests,
        workers=args.workers, workers_per_copy=args.workers_per_copy,
        duration_s=min(args.duration_s, 60.0) if args.quick else args.duration_s,
        policy=args.policy, mooncake=args.trace, seed=args.seed)


def _progress(now_s: float, done: int, total: int) -> None:
    print(f"\rsim {now_s:9.1f} s simulated | {done}/{total} requests", end="",
          file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    try:
        s = settings_of(args)
    except ValueError as e:
        print(f"pdserve bench sim: {e}", file=sys.stderr)
        return 2
    result = run_bench(s, progress=_progress)
    print(file=sys.stderr)
    from pdserve.bench.sim_report import print_tables, write_outputs

    return emit(result, json_out=args.json, out_dir=args.out, write_outputs=write_outputs,
                print_tables=print_tables)
