"""`pdserve sim plan`: which prefill:decode split, routing policy and controller settings serve a
trace on a cluster of N workers best, answered by simulating each candidate.

Owns the candidate set (static splits over a range of prefill shares; every prefill routing
policy at the best static split; the controller in several settings from an even split), the
phase-shifting trace (a prefill-heavy half, then a decode-heavy half: the best static split of
one half is wrong for the other), running the candidates (in parallel processes, each
deterministic by its seed) and ranking them. Tables, JSON and plots are `plan_report`'s.
Must not model time itself (the simulator does) or change what a policy decides.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from pdserve.core.errors import ConfigError
from pdserve.sim.config import SimConfig
from pdserve.core.step_profile import load_profile

DEFAULT_TTFT_SLO_MS = 2000.0  # a chat reply starts within 2 s
DEFAULT_ITL_SLO_MS = 100.0  # 10 tokens/s per stream: faster than people read
GPU_PROFILES = {"h100": "h100-llama3-8b", "h200": "h200-llama3-8b", "a100": "a100-llama2-7b",
                "cpu": "cpu-smollm2-135m"}
PREFILL_SHARES = (0.125, 0.25, 0.375, 0.5, 0.625, 0.75)


class PlanError(ConfigError):
    """A planning setting that cannot work; the message names the flag."""


@dataclass(frozen=True)
class Candidate:
    name: str
    kind: str  # "static", "routing", "controller"
    prefill_workers: int
    decode_workers: int
    prefill_policy: str = "kv_aware"
    controller: bool = False
    policy: dict[str, Any] = field(default_factory=dict)  # PolicyConfig overrides


# ---- the phase-shifting trace ---------------------------------------------------------------
def phase_shift_trace(*, duration_s: float, rate: float, heavy_prefill: tuple[int, int] = (
        8192, 32), heavy_decode: tuple[int, int] = (256, 6144), seed: int = 0) -> list:
    """Poisson arrivals at `rate`/s for `duration_s`: the first half asks for long prompts and
    short answers (`heavy_prefill` = mean prompt, mean output tokens), the second half for short
    prompts and long answers. Each request's prompt has its own prefix ids (no sharing), so the
    shift in work is the only thing that changes."""
    from pdserve.sim.trace import HASH_BLOCK_TOKENS, SimRequest

    if not duration_s > 0 or not rate > 0:
        raise PlanError(f"duration_s and rate must be > 0, got {duration_s}, {rate}")
    rng = random.Random(seed)
    out, t, next_id = [], 0.0, 0
    while True:
        t += rng.expovariate(rate)
        if t >= duration_s:
            return out
        p_mean, o_mean = heavy_prefill if t < duration_s / 2 else heavy_decode
        p = max(1, round(rng.expovariate(1.0 / p_mean)))
        o = max(1, round(rng.expovariate(1.0 / o_mean)))
        k = -(-p // HASH_BLOCK_TOKENS)
        out.append(SimRequest(f"r{len(out)}", t, p, o, tuple(range(next_id, next_id + k))))
        next_id += k


def load_requests(trace: str, *, workers: int, workers_per_copy: int, duration_s: float,
                  rate: float, seed: int) -> list:
    """`phase` (the phase-shifting trace at `rate` arrivals per second per worker), or a trace
    file / synthetic spec scaled to the cluster: one copy per `workers_per_copy` workers."""
    from pdserve.sim.trace import for_cluster, load_trace

    if trace == "phase":
        return phase_shift_trace(duration_s=duration_s, rate=rate * workers, seed=seed)
    base = load_trace(trace, seed=seed)
    return for_cluster(base, workers=workers, workers_per_copy=workers_per_copy,
                       duration_s=duration_s, seed=seed)


# ---- candidates -----------------------------------------------------------------------------
def split(workers: int, share: float) -> tuple[int, int]:
    p = min(workers - 1, max(1, round(workers * share)))
    return p, workers - p


def static_candidates(workers: int, shares=PREFILL_SHARES) -> list[Candidate]:
    seen, out = set(), []
    for s in shares:
        p, d = split(workers, s)
        if (p, d) not in seen:
            seen.add((p, d))
            out.append(Candidate(f"static {p}P:{d}D", "static", p, d))
    return out


def controller_candidates(workers: int) -> list[Candidate]:
    p, d = split(workers, 0.5)
    many = max(1, workers // 100)  # a large cluster moves 1% of its workers per tick
    settings = [("controller (defaults)", {}),
                ("controller FluidRole only", {"fluid_token": False}),
                ("controller FluidToken only", {"fluid_role": False}),
                (f"controller {many} flips/tick, 10 s cooldown",
                 {"max_flips_per_tick": many, "cooldown_s": 10.0})]
    return [Candidate(f"{name} from {p}P:{d}D", "controller", p, d, controller=True, policy=pol)
            for name, pol in settings]


def routing_candidates(best: Candidate) -> list[Candidate]:
    from pdserve.router.policy import PREFILL_POLICIES

    return [replace(best, name=f"routing {pol} at {best.prefill_workers}P:"
                    f"{best.decode_workers}D", kind="routing", prefill_policy=pol)
            for pol in PREFILL_POLICIES if pol != best.prefill_policy]


# ---- running --------------------------------------------------------------------------------
def _sim_config(c: Candidate, s: dict[str, Any]):
    from pdserve.controller.policy import PolicyConfig

    return SimConfig(prefill_workers=c.prefill_workers, decode_workers=c.decode_workers,
                     prefill_policy=c.prefill_policy, controller=c.controller,
                     policy=PolicyConfig(**c.policy), slo_ttft_ms=s["ttft_slo_ms"],
                     slo_itl_ms=s["itl_slo_ms"], transport=s["transport"],
                     block_size=s.get("block_size", 16), seed=s["seed"],
                     max_local_prefill_tokens=s.get("max_local_prefill_tokens",
                                                    SimConfig.max_local_prefill_tokens))


def run_candidate(c: Candidate, requests: list, profile_name: str,
                  s: dict[str, Any]) -> dict[str, Any]:
    """Simulate one candidate; its row of the plan (see `plan_report.row_of`)."""
    from pdserve.sim.plan_report import row_of
    from pdserve.sim.run import simulate

    t0 = time.monotonic()
    report = simulate(_sim_config(c, s), requests, load_profile(profile_name))
    return row_of(c, report, time.monotonic() - t0)


def _run_all(cands: list[Candidate], requests: list, s: dict[str, Any], jobs: int,
             say) -> list[dict[str, Any]]:
    if jobs <= 1:
        rows = []
        for c in cands:
            rows.append(run_candidate(c, requests, s["profile"], s))
            say(f"{c.name}: attainment {rows[-1]['attainment']:.3f} "
                f"({rows[-1]['sim_wall_s']:.1f} s)")
        return rows
    with ProcessPoolExecutor(jobs) as ex:
        futs = [ex.submit(run_candidate, c, requests, s["profile"], s) for c in cands]
        rows = []
        for c, f in zip(cands, futs):
            rows.append(f.result())
            say(f"{c.name}: attainment {rows[-1]['attainment']:.3f} "
                f"({rows[-1]['sim_wall_s']:.1f} s)")
        return rows


def best_of(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Highest goodput, then attainment, then fewer worker-hours; ties by name (stable)."""
    return max(rows, key=lambda r: (r["goodput_rps"], r["attainment"], -r["worker_hours"],
                                    r["name"]))


def plan(s: dict[str, Any], say=lambda line: None) -> dict[str, Any]:
    """The whole sweep: static splits, then routing policies at the best split, then the
    controller; every candidate sees the same requests."""
    workers = s["workers"]
    requests = load_requests(s["trace"], workers=workers, workers_per_copy=s["workers_per_copy"],
                             duration_s=s["duration_s"], rate=s["rate"], seed=s["seed"])
    if not requests:
        raise PlanError(f"--trace {s['trace']!r} gave no requests")
    say(f"{len(requests)} requests over {requests[-1].arrival_s:.0f} s on {workers} workers")
    rows = _run_all(static_candidates(workers), requests, s, s["jobs"], say)
    best_static = best_of(rows)
    best_c = Candidate(best_static["name"], "static", best_static["prefill_workers"],
                       best_static["decode_workers"])
    more = (routing_candidates(best_c) if s["routing"] else []) + \
        (controller_candidates(workers) if s["controller"] else [])
    rows += _run_all(more, requests, s, s["jobs"], say)
    return {"settings": s, "profile_origin": load_profile(s["profile"]).origin,
            "requests": len(requests), "trace_span_s": requests[-1].arrival_s,
            "rows": rows, "best": best_of(rows)["name"],
            "best_static": best_static["name"]}


# ---- CLI ------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--trace", required=True,
                   help="a Mooncake .jsonl, an Azure .csv, a synthetic:... spec, or 'phase' "
                        "(prefill-heavy first half, decode-heavy second half)")
    p.add_argument("--workers", type=int, default=1000, help="cluster size (default 1000)")
    p.add_argument("--ttft-slo-ms", type=float, default=DEFAULT_TTFT_SLO_MS,
                   help=f"TTFT SLO (default {DEFAULT_TTFT_SLO_MS:.0f} ms)")
    p.add_argument("--itl-slo-ms", type=float, default=DEFAULT_ITL_SLO_MS,
                   help=f"inter-token latency SLO (default {DEFAULT_ITL_SLO_MS:.0f} ms)")
    p.add_argument("--gpu", default="h100", choices=sorted(GPU_PROFILES),
                   help="hardware profile (default h100: Llama-3-8B roofline)")
    p.add_argument("--profile", default=None, help="a profile file or name (overrides --gpu)")
    p.add_argument("--duration-s", type=float, default=3600.0,
                   help="simulated time: the trace is tiled to this (default one hour)")
    p.add_argument("--workers-per-copy", type=int, default=8,
                   help="one copy of the trace's arrivals per this many workers (default 8)")
    # 1.5/s per worker: on the H100 roofline the first half needs about 5 of 8 workers
    # prefilling, the second about 6 of 8 decoding; no static split serves both halves.
    p.add_argument("--rate", type=float, default=1.5,
                   help="'phase' trace: arrivals per second per worker (default %(default)s)")
    p.add_argument("--transport", default="ucx", help="KV transport of the profile (default ucx)")
    p.add_argument("--block-size", type=int, default=16,
                   help="KV block size in tokens (default 16; 512 is the Mooncake trace's own "
                        "prefix granularity and costs a 32nd of the block work)")
    p.add_argument("--max-local-prefill-tokens", type=int,
                   default=SimConfig.max_local_prefill_tokens,
                   help="conditional disaggregation as the router does it (its default, "
                        "%(default)s; 0: every prompt takes a prefill worker)")
    p.add_argument("--no-routing", action="store_true", help="skip the routing-policy sweep")
    p.add_argument("--no-controller", action="store_true", help="skip the controller sweep")
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                   help="candidates simulated at once (processes)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="plan_out", help="folder for plan.json and plan.png")
    p.add_argument("--json", action="store_true", help="print the JSON document, not the table")
    return p


def settings_from_args(a: argparse.Namespace) -> dict[str, Any]:
    for name in ("workers", "workers_per_copy", "jobs", "block_size"):
        if getattr(a, name) < 1:
            raise PlanError(f"--{name.replace('_', '-')} must be >= 1")
    if a.max_local_prefill_tokens < 0:
        raise PlanError("--max-local-prefill-tokens must be >= 0")
    if a.workers < 2:
        raise PlanError("--workers must be >= 2 (one prefill and one decode worker)")
    for name in ("ttft_slo_ms", "itl_slo_ms", "duration_s", "rate"):
        if not getattr(a, name) > 0:
            raise PlanError(f"--{name.replace('_', '-')} must be > 0")
    profile = a.profile or GPU_PROFILES[a.gpu]
    prof = load_profile(profile)
    if a.transport not in prof.transports:
        raise PlanError(f"--transport {a.transport!r} is not in profile {profile} "
                        f"({', '.join(sorted(prof.transports))})")
    return {"trace": a.trace, "workers": a.workers, "ttft_slo_ms": a.ttft_slo_ms,
            "itl_slo_ms": a.itl_slo_ms, "profile": profile, "duration_s": a.duration_s,
            "workers_per_copy": a.workers_per_copy, "rate": a.rate, "transport": a.transport,
            "routing": not a.no_routing, "controller": not a.no_controller, "jobs": a.jobs,
            "block_size": a.block_size, "seed": a.seed,
            "max_local_prefill_tokens": a.max_local_prefill_tokens}


def run_command(args: argparse.Namespace, tag: str, settings, work, errors: tuple,
                write_outputs, print_table) -> int:
    """A `pdserve sim` command: settings (a bad one: its message and exit 2), the work with
    progress lines on stderr, then files and a table or JSON (`output.emit`)."""
    from pdserve.output import emit

    try:
        s = settings(args)
    except errors as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    t0 = time.monotonic()

    def say(line: str) -> None:
        print(f"[{tag} {time.monotonic() - t0:7.1f}s] {line}", file=sys.stderr, flush=True)
    return emit(work(s, say), json_out=args.json, out_dir=args.out,
                write_outputs=write_outputs, print_tables=print_table)


def run(args: argparse.Namespace) -> int:
    from pdserve.sim.plan_report import print_table, write_outputs

    return run_command(args, "plan", settings_from_args, plan, (PlanError, ValueError),
                       write_outputs, print_table)


def main(argv: list[str] | None = None) -> int:
    return run(add_arguments(argparse.ArgumentParser(prog="pdserve sim plan")).parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
