"""`pdserve bench fluid`: the controller against static splits, repeated, on one workload.

Owns one benchmark run on this machine. The same open-loop arrivals (`fluid_workload`:
two-phase, bursty, drift or a trace file) are replayed, greedy, against a fresh 4-worker
cluster per configuration (`fluid_cluster.CONFIGS`): every static split (controller off), and
from 2:2 the controller with FluidToken only, FluidRole only, both, and the flipping ones again
with migration off (running decodes finish in place). Each configuration is measured `runs`
times, the runs interleaved (round k measures every configuration once, its order rotated by
k) so the host's drift hits all alike. Every request's tokens in every run are compared with
the first run of the static 2:2 split (the first request with the in-process engine's too).
`fluid_summary` turns the records into means, spreads, the best static split and the gains.
With an output folder each run's record is kept there as it ends, and a later run with the
same settings and workload continues from them. With `emulated` N, the clusters are N workers
running the emulated engine (steps timed by a profile, tokens by `engine.emulated.token_of`,
checked for every request), each split scaled to N and the synthetic arrivals N/4 times as
many: the controller at a size this host cannot run real engines at. Must not decide
anything: it measures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from pdserve.bench.fluid_cluster import (CONFIGS, DEFAULT_MODEL_PROFILE, DEFAULT_SPLIT, WORKERS,
                                         cpu_quota_available, digest, request_id)
from pdserve.bench.fluid_runs import RunFiles, run_key
from pdserve.bench.fluid_summary import summarize
from pdserve.bench.fluid_workload import (WORKLOADS, Shape, Workload, make_workload,
                                          mooncake_records, traces_dir)
from pdserve.bench.serve_workload import WorkloadError
from pdserve.core.step_profile import load_profile
from pdserve.output import emit


@dataclass(frozen=True)
class FluidBenchSettings:
    model_path: str = ""  # "" -> the default model (SmolLM2-135M-Instruct GGUF)
    configs: tuple[str, ...] = tuple(CONFIGS)
    workload: str = "two-phase"
    trace_path: str = ""  # the file the `trace` workload replays
    speedup: float = 1.0  # the trace's arrivals divided by this
    runs: int = 3  # each configuration measured this many times
    phase_s: float = 60.0
    prefill_rps: float = 0.8
    decode_rps: float = 0.5
    shape: Shape = Shape()
    # Looser than `pdserve serve`'s defaults: each worker here has half a core (cpu_quota).
    ttft_slo_ms: float = 3000.0
    itl_slo_ms: float = 300.0
    num_blocks: int = 1024
    cpu_quota: bool = True
    seed: int = 0
    engine_checks: int = 4  # first requests also checked against the in-process engine
    # More controller settings (`ControllerConfig` fields) of the configs that run one.
    controller_settings: Mapping[str, Any] = field(
        default_factory=lambda: {"sustain_s": 2.0, "cooldown_s": 10.0})
    request_timeout_s: float = 300.0
    logs_dir: str = ""  # keep every process's log and the audit logs here ("" : a temp dir)
    # Emulated workers in each cluster (0: `WORKERS` workers running the model), a multiple of
    # `WORKERS`; their step profile ("": the default model's at a worker's share of this
    # host's cores, as the real workers run it), slowed `slowdown` times; KV bytes at
    # `kv_scale` of the profile's.
    emulated: int = 0
    profile: str = ""
    slowdown: float = 1.0
    kv_scale: float = 1 / 64

    def __post_init__(self) -> None:
        bad = [c for c in self.configs if c not in CONFIGS]
        if bad or not self.configs:
            raise ValueError(f"configs: choose from {', '.join(CONFIGS)}, got {bad or '()'}")
        if len(set(self.configs)) != len(self.configs):
            raise ValueError(f"configs: each at most once, got {', '.join(self.configs)}")
        if self.workload not in WORKLOADS:
            raise ValueError(f"workload: choose from {', '.join(WORKLOADS)}, "
                             f"got {self.workload!r}")
        if (self.workload == "trace") != bool(self.trace_path):
            raise ValueError("trace_path (--trace): needed by the trace workload, and by no other")
        for name in ("phase_s", "prefill_rps", "decode_rps", "speedup"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.runs < 1:
            raise ValueError(f"runs must be >= 1, got {self.runs}")
        if self.emulated < 0 or self.emulated % WORKERS:
            raise ValueError(f"emulated must be a multiple of {WORKERS} (each split scaled "
                             f"whole), got {self.emulated}")
        if not self.emulated and (self.profile or self.slowdown != 1.0):
            raise ValueError("profile and slowdown: only for an emulated cluster (--emulated)")
        if not self.slowdown >= 1.0:
            raise ValueError(f"slowdown must be >= 1, got {self.slowdown}")
        if not 0 < self.kv_scale <= 1:
            raise ValueError(f"kv_scale must be in (0, 1], got {self.kv_scale}")

    @property
    def workers(self) -> int:
        return self.emulated or WORKERS


def rounds(configs: tuple[str, ...], runs: int) -> list[tuple[int, str]]:
    """(run index, configuration) in measuring order: round k is every configuration once,
    the order rotated by k."""
    n = len(configs)
    return [(k, configs[(k + i) % n]) for k in range(runs) for i in range(n)]


def _baseline(configs: tuple[str, ...]) -> str:
    """The configuration whose first run every run's tokens are compared with."""
    statics = [c for c in configs if CONFIGS[c][2] is None]
    return DEFAULT_SPLIT if DEFAULT_SPLIT in configs else (statics or list(configs))[0]


def _token_check(rows: list[dict], base: list[dict]) -> dict[str, int]:
    """Requests both finished (every one, not a sample) and how many of those differ."""
    both = [(a, b) for a, b in zip(rows, base) if a["error"] is None and b["error"] is None]
    return {"compared": len(both), "mismatches": sum(a["digest"] != b["digest"]
                                                     for a, b in both)}


def _emulated_check(model: str, wl: Workload, rows) -> tuple[int, int]:
    """(requests finished, those whose tokens differ from the emulated engine's for their
    id): every finished request is checked."""
    from pdserve.engine.emulated import token_of
    from pdserve.engine.loader import load_model_config

    mc = load_model_config(model)
    eos = frozenset(mc.eos_token_ids)
    done = [(i, r, row) for i, (r, row) in enumerate(zip(wl.requests, rows))
            if row["error"] is None]
    return len(done), sum(
        row["digest"] != digest([token_of(request_id(i), k, None, mc.vocab_size, eos)
                                 for k in range(r.max_tokens)]) for i, r, row in done)


def _engine_check(model: str, wl: Workload, rows, n: int) -> int:
    """Requests among the first `n` whose tokens differ from the in-process engine's."""
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine import LLMEngine
    from pdserve.engine.sampling import SamplingParams

    engine = LLMEngine(EngineConfig(model))
    bad = 0
    for r, row in list(zip(wl.requests, rows))[:n]:
        ref = engine.generate([list(r.prompt)], SamplingParams(max_tokens=r.max_tokens,
                                                               ignore_eos=True))[0]
        bad += row["digest"] != digest(ref)
    return bad


def run_bench(s: FluidBenchSettings, progress=None, out_dir: str | None = None
              ) -> dict[str, Any]:
    """Every configuration `s.runs` times; with `out_dir`, each run's record kept there and
    earlier ones of the same settings and workload taken instead of measured again."""
    from pdserve.bench.fluid_cluster import run_config
    from pdserve.engine.loader import default_model_path, load_model_config

    model = s.model_path or default_model_path()
    if s.cpu_quota and (s.emulated or not cpu_quota_available()):  # emulated steps sleep
        s = replace(s, cpu_quota=False)
    mc = load_model_config(model)
    per = s.workers / WORKERS  # the rates are a 4-worker cluster's
    wl = make_workload(traces_dir(), s.shape, phase_s=s.phase_s,
                       prefill_rps=s.prefill_rps * per, decode_rps=s.decode_rps * per,
                       vocab=(100, mc.vocab_size - 100), seed=s.seed,
                       kind=s.workload, trace_path=s.trace_path, speedup=s.speedup,
                       context_tokens=mc.max_position_embeddings)
    if not wl.requests:
        raise WorkloadError(f"--trace {s.trace_path}: no request arrives in the first "
                            f"{wl.duration_s:.0f} s at --speedup {s.speedup}")
    settings = {**asdict(s), "model": model, "context_tokens": mc.max_position_embeddings,
                "workers": s.workers}
    files = RunFiles(os.path.join(out_dir, "fluid-runs") if out_dir else None,
                     run_key(settings, model, wl.requests))
    records: dict[str, list[dict[str, Any]]] = {c: [{}] * s.runs for c in s.configs}
    resumed = 0
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-fluid-") as tmp:
        profile = _step_profile(s, out_dir or tmp)
        sim = _for_the_simulator(s, wl, out_dir, profile) if out_dir else None
        for k, name in rounds(s.configs, s.runs):
            label = f"{name} run {k + 1}/{s.runs}"
            rec = files.load(name, k)
            if rec is None:
                task = progress(label, len(wl.requests), False) if progress else None
                rec = run_config(name, s, model, wl, os.path.join(
                    s.logs_dir or tmp, f"{name}.run{k + 1}"), task,
                    emulated_profile=profile if s.emulated else "")
                files.save(name, k, rec)
            else:
                resumed += 1
                if progress:
                    progress(label + " (kept)", len(wl.requests), True)
            records[name][k] = rec
    base_name = _baseline(s.configs)
    base = records[base_name][0]["rows"]
    for name, recs in records.items():
        for k, rec in enumerate(recs):
            rec["tokens"] = {"against": f"{base_name} run 1", **(
                {"compared": 0, "mismatches": 0} if (name, k) == (base_name, 0)
                else _token_check(rec["rows"], base))}
    checked, engine_bad = (_emulated_check(model, wl, base) if s.emulated else (
        min(s.engine_checks, len(wl.requests)), _engine_check(model, wl, base, s.engine_checks)))
    for recs in records.values():
        for rec in recs:
            del rec["rows"]
    phases = [p.name for p in wl.phases]
    return {"settings": settings, "machine": _machine(),
            "workload": {"kind": wl.kind, "duration_s": wl.duration_s,
                         "decode_from_s": wl.decode_from_s,
                         "phases": [asdict(p) for p in wl.phases],
                         "requests": {p: sum(r.phase == p for r in wl.requests)
                                      for p in phases}},
            "engine_checked": checked,
            "engine_mismatches": engine_bad, "runs_kept_from_earlier": resumed,
            "runs": records, **({"sim_plan": sim} if sim else {}),
            "summary": summarize(records, phases, default=DEFAULT_SPLIT,
                                 static=[c for c in CONFIGS if CONFIGS[c][2] is None],
                                 decode_from_s=wl.decode_from_s)}


def _step_profile(s: FluidBenchSettings, folder: str) -> str:
    """The step profile of the run's workers as a file in `folder` ("" for another model's
    real workers: `pdserve sim calibrate --model M` makes one): an emulated cluster's as
    asked, slowed `slowdown` times; else the default model's at each worker's share of this
    host's cores (each computes on one thread within it, `cpu_quota`)."""
    if s.emulated and s.profile:
        prof = load_profile(s.profile).slowed(s.slowdown)
    elif s.model_path and not s.emulated:
        return ""
    else:
        prof = load_profile(DEFAULT_MODEL_PROFILE).slowed(
            max(1.0, WORKERS / (os.cpu_count() or 1)) * s.slowdown)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "sim-profile.json")
    prof.save(path)
    return path


def _for_the_simulator(s: FluidBenchSettings, wl: Workload, out_dir: str, profile: str) -> str:
    """Write the arrivals (a Mooncake trace) into `out_dir`; the `pdserve sim plan` command
    that ranks the splits and the controller on the same arrivals with the workers' step
    `profile`."""
    os.makedirs(out_dir, exist_ok=True)
    trace = os.path.join(out_dir, "arrivals.jsonl")
    with open(trace, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in mooncake_records(wl))
    # Just past the last arrival: the trace is replayed once, not tiled.
    span = wl.requests[-1].arrival_s - wl.requests[0].arrival_s
    return (f"pdserve sim plan --trace {trace} --profile {profile or 'PROFILE'} "
            f"--workers {s.workers} --workers-per-copy {s.workers} --duration-s "
            f"{span + 0.001:.3f} --ttft-slo-ms {s.ttft_slo_ms:g} --itl-slo-ms {s.itl_slo_ms:g}")


def _machine() -> dict[str, Any]:
    return {"cpus": os.cpu_count(), "platform": platform.platform(),
            "loadavg_1m": os.getloadavg()[0]}


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="write fluid.json and the PNGs here; each run's record is kept in "
                        "DIR/fluid-runs as it ends, and a stopped run continues from them")
    p.add_argument("--model", default="", help="model path (default: SmolLM2-135M GGUF)")
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help=f"comma-separated among {', '.join(CONFIGS)}")
    p.add_argument("--workload", choices=WORKLOADS, default=None,
                   help="two-phase (prefill-heavy then decode-heavy), bursty (long answers "
                        "with a burst of long prompts mid-run), drift (prefill-heavy drifting "
                        "to decode-heavy), trace (--trace); default: trace with --trace, "
                        "else two-phase")
    p.add_argument("--trace", default="", metavar="FILE",
                   help="an Azure CSV or Mooncake JSONL trace to replay")
    p.add_argument("--speedup", type=float, default=1.0,
                   help="the trace's arrivals divided by this (below 1: slower)")
    p.add_argument("--runs", type=int, default=3, help="times each configuration is measured")
    p.add_argument("--phase-s", type=float, default=60.0, help="seconds of each phase")
    p.add_argument("--prefill-rps", type=float, default=0.8)
    p.add_argument("--decode-rps", type=float, default=0.5)
    p.add_argument("--ttft-slo-ms", type=float, default=3000.0)
    p.add_argument("--itl-slo-ms", type=float, default=300.0)
    p.add_argument("--no-cpu-quota", action="store_true",
                   help="let workers share every core (no per-worker CPU cap)")
    p.add_argument("--emulated", type=int, default=0, metavar="N",
                   help=f"clusters of N emulated workers (a multiple of {WORKERS}) instead of "
                        f"{WORKERS} running the model: splits scaled to N, the synthetic "
                        f"arrivals N/{WORKERS} times as many")
    p.add_argument("--profile", default="",
                   help="the emulated workers' step profile, a shipped name or a JSON file "
                        "(default: the default model's at a worker's share of this host)")
    p.add_argument("--slowdown", type=float, default=1.0,
                   help="every emulated step this many times as long (>= 1)")
    p.add_argument("--kv-scale", type=float, default=1 / 64,
                   help="emulated KV bytes per token as a fraction of the profile's")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")
    return p


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import Progress

    from pdserve.bench import fluid_report

    try:
        s = FluidBenchSettings(
            model_path=args.model, configs=tuple(
                c.strip() for c in args.configs.split(",") if c.strip()),
            workload=args.workload or ("trace" if args.trace else "two-phase"),
            trace_path=args.trace, speedup=args.speedup, runs=args.runs, phase_s=args.phase_s,
            prefill_rps=args.prefill_rps, decode_rps=args.decode_rps,
            ttft_slo_ms=args.ttft_slo_ms, itl_slo_ms=args.itl_slo_ms,
            cpu_quota=not args.no_cpu_quota, seed=args.seed, emulated=args.emulated,
            profile=args.profile, slowdown=args.slowdown, kv_scale=args.kv_scale,
            logs_dir=os.path.join(args.out, "logs") if args.out else "")
        with Progress(transient=True, disable=args.json or args.no_progress,
                      console=Console(stderr=True)) as bar:
            def progress(label: str, total: int, done: bool):
                task = bar.add_task(f"{label:<30}", total=total,
                                    completed=total if done else 0)
                return lambda: bar.advance(task)
            result = run_bench(s, progress, args.out)
    except ValueError as e:  # WorkloadError included: the message names the option
        print(f"pdserve bench fluid: {e}", file=sys.stderr)
        return 2
    return emit(result, json_out=args.json, out_dir=args.out,
                write_outputs=fluid_report.write_outputs, print_tables=fluid_report.print_tables)
