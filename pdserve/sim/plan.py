"""`pdserve sim plan`: which prefill:decode split, routing policy and controller settings serve a
trace on a cluster of N workers best, answered by simulating each candidate.

Owns the candidate set (static splits over a range of prefill shares; every prefill routing
policy at the best static split; the controller in several settings from an even split), the
phase-shifting trace (a prefill-heavy half, then a decode-heavy half: the best static split of
one half is wrong for the other), how many candidates run at once (from the memory one is
estimated to take, `plan_jobs`, unless `--jobs` says) and ranking them. Each candidate runs in
a process of its own, deterministic by its seed; a plan that cannot fit, or a candidate whose
process dies, ends with one line naming why. Tables, JSON and plots are `plan_report`'s.
Must not model time itself (the simulator does) or change what a policy decides.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Any

from pdserve.core.errors import ConfigError
from pdserve.core.step_profile import load_profile
from pdserve.sim.config import SimConfig
from pdserve.sim.plan_jobs import (GB, JobFailed, JobSize, available_memory_bytes, choose_jobs,
                                   job_memory_bytes, run_jobs, usable_cpus)
from pdserve.sim.plan_progress import PlanProgress, stderr_console

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
        8192, 32), heavy_decode: tuple[int, int] = (256, 6144), seed: int = 0):
    """Poisson arrivals at `rate`/s for `duration_s`: the first half asks for long prompts and
    short answers (`heavy_prefill` = mean prompt, mean output tokens), the second half for short
    prompts and long answers. Each request's prompt has its own prefix ids (no sharing), so the
    shift in work is the only thing that changes. An `OwnIdsTrace`: requests made when read."""
    from pdserve.sim.trace import HASH_BLOCK_TOKENS, OwnIdsTrace

    if not duration_s > 0 or not rate > 0:
        raise PlanError(f"duration_s and rate must be > 0, got {duration_s}, {rate}")
    rng = random.Random(seed)
    out, t, next_id = OwnIdsTrace(), 0.0, 0
    while True:
        t += rng.expovariate(rate)
        if t >= duration_s:
            return out
        p_mean, o_mean = heavy_prefill if t < duration_s / 2 else heavy_decode
        p = max(1, round(rng.expovariate(1.0 / p_mean)))
        o = max(1, round(rng.expovariate(1.0 / o_mean)))
        out.append(t, p, o, next_id)
        next_id += -(-p // HASH_BLOCK_TOKENS)


def load_requests(trace: str, *, workers: int, workers_per_copy: int, duration_s: float,
                  rate: float, seed: int):
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


def run_candidate(c: Candidate, requests, profile_name: str, s: dict[str, Any],
                  progress=None) -> dict[str, Any]:
    """Simulate one candidate; its row of the plan (see `plan_report.row_of`).
    `progress(now_s, done, total)` is called now and then (`run.simulate`)."""
    from pdserve.sim.plan_report import row_of
    from pdserve.sim.run import simulate

    t0 = time.monotonic()
    report = simulate(_sim_config(c, s), requests, load_profile(profile_name), progress)
    return row_of(c, report, time.monotonic() - t0)


def job_size(s: dict[str, Any], requests) -> JobSize:
    """What one candidate's memory grows with, for these settings and requests."""
    from pdserve.sim.trace import columns

    bs = s.get("block_size", 16)
    prompts = columns(requests)[1]
    return JobSize(workers=s["workers"],
                   blocks_per_worker=max(1, load_profile(s["profile"]).kv_capacity_tokens // bs),
                   store_blocks=SimConfig.store_capacity_blocks, requests=len(requests),
                   prompt_blocks=sum(prompts) / max(1, len(prompts)) / bs)


def jobs_for(s: dict[str, Any], requests, candidates: int, say) -> dict[str, Any]:
    """How many candidates run at once: `--jobs`, or as many as memory and cores allow. Raises
    `PlanError` when the estimate of one is more than the memory available."""
    per_job = job_memory_bytes(job_size(s, requests))
    avail = s.get("max_memory_bytes") or available_memory_bytes()
    cpus = usable_cpus()
    fit = choose_jobs(avail, per_job, cpus, candidates)
    room = "unknown" if avail is None else f"{avail / GB:.1f} GB"
    if fit == 0 and not s["jobs"]:
        raise PlanError(
            f"one candidate needs about {per_job / GB:.1f} GB ({s['workers']} workers' KV "
            f"pools and caches at --block-size {s.get('block_size', 16)}, the store, "
            f"{len(requests)} requests) and {room} is available: use a larger --block-size, "
            f"fewer --workers or a shorter --duration-s (--max-memory-gb if the estimate is "
            f"wrong for this machine)")
    jobs = s["jobs"] or fit
    how = "--jobs" if s["jobs"] else f"{cpus} cores"
    say(f"jobs: {jobs} at once ({how}; about {per_job / GB:.1f} GB per job estimated, "
        f"{room} available)")
    if s["jobs"] and avail is not None and s["jobs"] * per_job > avail:
        say(f"warning: {s['jobs']} jobs may need {s['jobs'] * per_job / GB:.1f} GB, more "
            f"than the {room} available")
    return {"jobs": jobs, "per_job_estimate_bytes": per_job, "available_bytes": avail,
            "cpus": cpus}


def _what_to_try(jobs: dict[str, Any]) -> str:
    """The end of the message of a job that dies: the estimate, and what to change."""
    avail = jobs["available_bytes"]
    room = "unknown" if avail is None else f"{avail / GB:.1f} GB"
    return (f"about {jobs['per_job_estimate_bytes'] / GB:.1f} GB per job was estimated, "
            f"{jobs['jobs']} at once, {room} available: try fewer --jobs, a larger "
            f"--block-size or a shorter --duration-s")


def best_of(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Highest goodput, then attainment, then fewer worker-hours; ties by name (stable)."""
    return max(rows, key=lambda r: (r["goodput_rps"], r["attainment"], -r["worker_hours"],
                                    r["name"]))


def plan(s: dict[str, Any], say=lambda line: None, live: bool = False) -> dict[str, Any]:
    """The whole sweep: static splits, then routing policies at the best split, then the
    controller; every candidate sees the same requests. Progress goes to `say` (and bars
    with `live`)."""
    workers = s["workers"]
    requests = load_requests(s["trace"], workers=workers, workers_per_copy=s["workers_per_copy"],
                             duration_s=s["duration_s"], rate=s["rate"], seed=s["seed"])
    if not requests:
        raise PlanError(f"--trace {s['trace']!r} gave no requests")
    span = requests[-1].arrival_s
    say(f"{len(requests)} requests over {span:.0f} s on {workers} workers")
    statics = static_candidates(workers)
    controllers = controller_candidates(workers) if s["controller"] else []
    routings = len(routing_candidates(statics[0])) if s["routing"] else 0
    jobs = jobs_for(s, requests, max(len(statics), routings + len(controllers)), say)
    with PlanProgress(stderr_console(), span, say, live=live) as progress:
        rows = run_jobs(statics, requests, s, min(jobs["jobs"], len(statics)), progress,
                        _what_to_try(jobs))
        best_static = best_of(rows)
        best_c = Candidate(best_static["name"], "static", best_static["prefill_workers"],
                           best_static["decode_workers"])
        more = (routing_candidates(best_c) if s["routing"] else []) + controllers
        if more:
            rows += run_jobs(more, requests, s, min(jobs["jobs"], len(more)), progress,
                             _what_to_try(jobs))
    return {"settings": s, "profile_origin": load_profile(s["profile"]).origin,
            "requests": len(requests), "trace_span_s": span, "jobs": jobs,
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
    p.add_argument("--jobs", type=int, default=None,
                   help="candidates simulated at once, each in a process of its own (default: "
                        "as many as the memory available holds at the estimate of one, at most "
                        "one per core)")
    p.add_argument("--max-memory-gb", type=float, default=None,
                   help="memory the plan's jobs may take together (default: the machine's "
                        "available memory, MemAvailable)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="plan_out", help="folder for plan.json and plan.png")
    p.add_argument("--json", action="store_true", help="print the JSON document, not the table")
    return p


def settings_from_args(a: argparse.Namespace) -> dict[str, Any]:
    for name in ("workers", "workers_per_copy", "block_size"):
        if getattr(a, name) < 1:
            raise PlanError(f"--{name.replace('_', '-')} must be >= 1")
    if a.jobs is not None and a.jobs < 1:
        raise PlanError("--jobs must be >= 1")
    if a.max_memory_gb is not None and not a.max_memory_gb > 0:
        raise PlanError("--max-memory-gb must be > 0")
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
            "max_memory_bytes": None if a.max_memory_gb is None else int(a.max_memory_gb * GB),
            "block_size": a.block_size, "seed": a.seed,
            "max_local_prefill_tokens": a.max_local_prefill_tokens}


def run_command(args: argparse.Namespace, tag: str, settings, work, errors: tuple,
                write_outputs, print_table, failures: tuple = ()) -> int:
    """A `pdserve sim` command: settings (a bad one: its message and exit 2), the work with
    progress lines on stderr (one of `errors` raised by it: its message and exit 2; one of
    `failures`: its detail, if any, its message and exit 1), then files and a table or JSON
    (`output.emit`)."""
    from pdserve.output import emit

    try:
        s = settings(args)
    except errors as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    console = stderr_console()

    def say(line: str) -> None:
        console.print(f"[{tag} {time.monotonic() - t0:7.1f}s] {line}", markup=False,
                      highlight=False)
    try:
        result = work(s, say)
    except errors as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except failures as e:
        if getattr(e, "detail", ""):
            print(e.detail, file=sys.stderr, end="")
        print(f"error: {e}", file=sys.stderr)
        return 1
    return emit(result, json_out=args.json, out_dir=args.out,
                write_outputs=write_outputs, print_tables=print_table)


def run(args: argparse.Namespace) -> int:
    from pdserve.sim.plan_report import print_table, write_outputs

    live = not args.json and stderr_console().is_terminal
    return run_command(args, "plan", settings_from_args,
                       lambda s, say: plan(s, say, live=live), (PlanError, ValueError),
                       write_outputs, print_table, failures=(JobFailed,))


def main(argv: list[str] | None = None) -> int:
    return run(add_arguments(argparse.ArgumentParser(prog="pdserve sim plan")).parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
