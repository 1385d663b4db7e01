"""`pdserve bench migrate`: the stall a client sees when its running decode moves live, with its
KV, to another decode worker, in steps of the worker it lands on.

Owns one benchmark run on this machine. A `LocalCluster` of 2 prefill workers and 1 decode
worker (controller off, no local prefill, no admission bound) starts; one prefill worker is
flipped to decode (`SetRole`, nothing runs there) and held out of the router's pools, so every
stream runs on the first decode worker (the source) and the second (the target) is empty.
Each decode worker first decodes a short batch of its own (prompts no run uses).
For each of `runs` sets of N requests (distinct prompts per set, so the target never holds a
moved request's blocks from an earlier run) a fault-free pass streams the set at once on the
source alone. Then each move pass streams its set again; once every stream has K tokens the
target joins the decode pool and the source's `Migrate(count=N, reason="balance")` moves every
running decode to it. It records each message's arrival, the target's decode steps while it
ran them (`GetStats`), the router's `pdserve:migration_stall_seconds` and every request's
tokens against its fault-free run. A moved stream's stall is its longest gap between two
messages that ends after the call started (the gap the router's histogram times too); its
ordinary gap, the median of its gaps in the fault-free pass. Must not change the cluster's
code paths (it calls the operator's RPCs and observes) nor judge anything but the figures it
reports.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import sys
import time
from statistics import median
from typing import Any

from pdserve import rpc
from pdserve.bench.migrate_client import (Request, WorkloadError, gaps_s, percentiles, run_all,
                                          stall_s, start, workload)
from pdserve.bench.serve_probe import get_text
from pdserve.bench.serve_summary import sample_totals
from pdserve.core.identity import ROUTER, WORKER
from pdserve.proto import router_pb2 as rpb
from pdserve.proto import router_pb2_grpc as rpb_grpc
from pdserve.proto import worker_pb2 as wpb
from pdserve.proto import worker_pb2_grpc as wpb_grpc

AIM_STEPS = 2.0  # stall p99 at most this many of the target's decode steps
STALL_METRIC = "pdserve:migration_stall_seconds"


def _stalls_metric(http: str) -> tuple[float, float]:
    """The router's stall histogram: (count, sum of seconds)."""
    totals = sample_totals(get_text(f"http://{http}/metrics"))
    return totals.get(STALL_METRIC + "_count", 0.0), totals.get(STALL_METRIC + "_sum", 0.0)


def _set_member(control, address: str, state: int, why: str) -> None:
    control.SetWorkerState(rpb.SetWorkerStateRequest(address=address, state=state,
                                                     role=wpb.ROLE_DECODE, reason=why),
                           timeout=10)


def _wait_tokens(streams, k: int, timeout_s: float) -> None:
    """Until every stream has `k` tokens; raises if one ended or the time is up first."""
    deadline = time.monotonic() + timeout_s
    while any(len(s.ids) < k for s in streams):
        ended = [s for s in streams if not s.is_alive() and len(s.ids) < k]
        if ended:
            raise RuntimeError(f"a stream ended with {len(ended[0].ids)} of {k} tokens before "
                               f"the move: {ended[0].error}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"not every stream reached {k} tokens in {timeout_s:.0f} s")
        time.sleep(0.005)


def _step_s(before, after) -> tuple[int, float | None]:
    """A worker's decode steps between two `GetStats` and their mean seconds."""
    steps = after.decode_steps - before.decode_steps
    secs = after.decode_step_seconds - before.decode_step_seconds
    return steps, (secs / steps if steps else None)


def _stats(stub) -> wpb.WorkerStats:
    return stub.GetStats(wpb.GetStatsRequest(), timeout=10)


def fault_free(cluster, source: str, requests: list[Request], timeout_s: float
               ) -> tuple[list[list[int]], list[list[float]], float | None]:
    """Every request's tokens and message gaps with nothing moved, and the source's mean step."""
    with rpc.make_channel(source, WORKER) as ch:
        stub = wpb_grpc.WorkerStub(ch)
        before = _stats(stub)
        streams = run_all(cluster.router_address, requests, timeout_s)
        _, step = _step_s(before, _stats(stub))
    bad = [s.error for s in streams if s.error is not None]
    if bad:
        raise RuntimeError(f"a pass with nothing moved failed: {bad[:3]}")
    return [s.ids for s in streams], [gaps_s(s.times) for s in streams], step


def move_pass(cluster, control, source: str, target: str, requests: list[Request],
              ref: list[list[int]], ordinary: list[list[float]], k: int, timeout_s: float
              ) -> dict[str, Any]:
    """One move pass (the target held out of the pools until the move): its record."""
    http = cluster.http_address
    stalls_before = _stalls_metric(http)
    streams = start(cluster.router_address, requests, timeout_s)
    _wait_tokens(streams, k, timeout_s)
    with rpc.make_channel(source, WORKER) as sch, rpc.make_channel(target, WORKER) as tch:
        src, dst = wpb_grpc.WorkerStub(sch), wpb_grpc.WorkerStub(tch)
        _set_member(control, target, rpb.MEMBER_STATE_ACTIVE, "bench migrate: the target")
        dst_before, running = _stats(dst), _stats(src).num_running
        in_flight = [i for i, s in enumerate(streams) if s.is_alive() and s.finish is None]
        moved_at = time.monotonic()
        resp = src.Migrate(wpb.MigrateRequest(count=len(requests), reason="balance"),
                           timeout=120)
        call_s = time.monotonic() - moved_at
        for s in streams:
            s.join(timeout_s + 30)
        dst_after = _stats(dst)
    stalls_after = _stalls_metric(http)
    _set_member(control, target, rpb.MEMBER_STATE_DRAINING, "bench migrate: held out")
    steps, step = _step_s(dst_before, dst_after)
    stall = [x for i in in_flight if (x := stall_s(streams[i].times, moved_at)) is not None]
    in_steps = [x / step for x in stall] if step else []
    gaps = [g for i in in_flight for g in ordinary[i]]
    gap = median(gaps) if gaps else None
    n = int(stalls_after[0] - stalls_before[0])
    return {
        "source": source, "target": target, "running_at_move": running,
        "in_flight_at_move": len(in_flight), "moved": resp.moved_requests,
        "copied": resp.copied_requests, "migrate_call_s": round(call_s, 4),
        "errors": sum(s.error is not None or s.is_alive() for s in streams),
        "mismatches": sum(s.error is None and s.ids != r for s, r in zip(streams, ref)),
        "resumed_on_target": dst_after.local_prefill_requests
        - dst_before.local_prefill_requests,
        "target_decode_steps": steps, "target_step_s": step,
        "stall_s": stall, "stall_steps": in_steps,
        "stall": percentiles(stall), "stall_in_steps": percentiles(in_steps),
        "ordinary_gap_s": gap,
        "ordinary_gap_steps": gap / step if gap is not None and step else None,
        "router_stall_count": n,
        "router_stall_mean_s": (stalls_after[1] - stalls_before[1]) / n if n else None,
        "loadavg_1m": round(os.getloadavg()[0], 2)}


def pooled(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Every run's streams together (each stall in its own run's target steps)."""
    stall = [x for r in runs for x in r["stall_s"]]
    steps = [x for r in runs for x in r["stall_steps"]]
    out = {key: sum(r[key] for r in runs) for key in (
        "in_flight_at_move", "moved", "copied", "errors", "mismatches", "router_stall_count")}
    step = [r["target_step_s"] for r in runs if r["target_step_s"] is not None]
    gaps = [r["ordinary_gap_s"] for r in runs if r["ordinary_gap_s"] is not None]
    n = out["router_stall_count"]
    out["router_stall_mean_s"] = sum(r["router_stall_mean_s"] * r["router_stall_count"]
                                     for r in runs if r["router_stall_count"]) / n if n else None
    return {**out, "stall": percentiles(stall), "stall_in_steps": percentiles(steps),
            "target_step_s": median(step) if step else None,
            "ordinary_gap_s": median(gaps) if gaps else None}


def run_bench(model: str, n: int, max_tokens: int, k: int, runs: int, seed: int,
              log_dir: str | None, progress=lambda what: None, timeout_s: float = 600.0
              ) -> dict[str, Any]:
    """The cluster started, the flip, the warm-up, `runs` fault-free passes, then `runs` move
    passes."""
    from pdserve.engine.loader import load_model_config
    from pdserve.launcher.cluster_spec import free_ports
    from pdserve.launcher.local import ClusterSpec, LocalCluster

    all_sets = workload(runs + 2, n, max_tokens, load_model_config(model).vocab_size, seed)
    warm_sets, sets = all_sets[:2], all_sets[2:]
    spec = ClusterSpec(model_path=model, prefill_workers=2, decode_workers=1,
                       router_port=free_ports(1)[0], http_port=0, log_dir=log_dir,
                       controller=False, max_predicted_ttft_s=0.0, max_local_prefill_tokens=0)
    started, load_before = time.monotonic(), os.getloadavg()[0]
    progress("starting the cluster")
    records = []
    with LocalCluster(spec) as cluster, rpc.make_channel(cluster.router_control_address,
                                                         ROUTER) as rch:
        control = rpb_grpc.RouterControlStub(rch)
        [source] = cluster.worker_addresses("decode")
        target = cluster.worker_addresses("prefill")[1]
        # Out of the pools first, then the flip: it runs nothing, so the switch is immediate.
        _set_member(control, target, rpb.MEMBER_STATE_DRAINING, "bench migrate: held out")
        with rpc.make_channel(target, WORKER) as ch:
            flip = wpb_grpc.WorkerStub(ch).SetRole(wpb.SetRoleRequest(
                role=wpb.ROLE_DECODE, drain=True, drain_timeout_s=60), timeout=90)
        # Each decode worker decodes a batch of its own first (prompts no run uses), so no
        # figure holds a worker's first steps.
        progress("warming up")
        for on, off, warm in ((source, target, warm_sets[0]), (target, source, warm_sets[1])):
            _set_member(control, on, rpb.MEMBER_STATE_ACTIVE, "bench migrate: warm-up")
            _set_member(control, off, rpb.MEMBER_STATE_DRAINING, "bench migrate: held out")
            fault_free(cluster, on, [dataclasses.replace(r, max_tokens=k + 2) for r in warm],
                       timeout_s)
        _set_member(control, source, rpb.MEMBER_STATE_ACTIVE, "bench migrate: the source")
        _set_member(control, target, rpb.MEMBER_STATE_DRAINING, "bench migrate: held out")
        base = []
        for j, requests in enumerate(sets):
            progress(f"fault-free pass {j + 1}/{runs}")
            base.append(fault_free(cluster, source, requests, timeout_s))
        for j, requests in enumerate(sets):
            progress(f"move pass {j + 1}/{runs}")
            ref, gaps, source_step = base[j]
            rec = move_pass(cluster, control, source, target, requests, ref, gaps, k,
                            timeout_s)
            records.append({"run": j + 1, "source_step_s": source_step, **rec})
    progress("done")
    p = pooled(records)
    p99 = p["stall_in_steps"]["p99"]
    return {
        "bench": "migrate", "model": os.path.basename(model),
        "machine": {"cpus": os.cpu_count(), "machine": platform.machine(),
                    "platform": platform.platform(),
                    "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)]},
        "settings": {"requests": n, "max_tokens": max_tokens, "move_after_tokens": k,
                     "runs": runs, "seed": seed, "prefill_workers": 2, "decode_workers": 1,
                     "flipped_to_decode": flip.role == wpb.ROLE_DECODE,
                     "sampling": "even greedy, odd seeded (T 0.8, top-p 0.9)",
                     "prompt_tokens": "20-60, distinct ids"},
        "aim": {"stall_p99_steps": AIM_STEPS, "lost": 0, "mismatches": 0},
        "verdict": {"stall_p99_within_aim": p99 is not None and p99 <= AIM_STEPS,
                    "no_request_lost": p["errors"] == 0,
                    "tokens_identical": p["mismatches"] == 0 and p["errors"] == 0,
                    "every_decode_moved": p["moved"] == p["in_flight_at_move"] == n * runs,
                    "router_counted_every_stall": p["router_stall_count"] == p["moved"]},
        "runs": records, "pooled": p, "seconds": round(time.monotonic() - started, 1)}


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="write migrate.json, migrate.png, migrate.md and the logs here")
    p.add_argument("--model", default="", help="model path (default: SmolLM2-135M GGUF)")
    p.add_argument("--requests", type=int, default=20, metavar="N",
                   help="streams running on the source when it moves them all")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--move-after-tokens", type=int, default=16, metavar="K",
                   help="the move starts once every stream has this many tokens")
    p.add_argument("--runs", type=int, default=3, help="move passes (each its own requests)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


def problem(args: argparse.Namespace) -> str | None:
    for flag, value in (("--requests", args.requests), ("--move-after-tokens",
                                                        args.move_after_tokens),
                        ("--runs", args.runs)):
        if value < 1:
            return f"{flag} must be >= 1, got {value}"
    if args.max_tokens <= args.move_after_tokens + 1:
        return (f"--max-tokens must exceed --move-after-tokens + 1 (streams must still run "
                f"when they move), got {args.max_tokens} and {args.move_after_tokens}")
    return None


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import Progress

    from pdserve.bench import migrate_report
    from pdserve.output import emit

    bad = problem(args)
    if bad:
        print(f"pdserve bench migrate: {bad}", file=sys.stderr)
        return 2
    model = args.model
    if not model:
        from pdserve.engine.loader import default_model_path
        model = default_model_path()
    with Progress(transient=True, disable=args.json or args.no_progress,
                  console=Console(stderr=True)) as bar:
        task = bar.add_task("bench migrate", total=2 * args.runs + 2)
        steps = iter(range(2 * args.runs + 3))

        def progress(what: str) -> None:
            bar.update(task, description=f"{what:<24}", completed=next(steps))
        try:
            result = run_bench(model, args.requests, args.max_tokens, args.move_after_tokens,
                               args.runs, args.seed,
                               os.path.join(args.out, "logs") if args.out else None, progress)
        except WorkloadError as e:  # the message names the flags
            print(f"pdserve bench migrate: {e}", file=sys.stderr)
            return 2
    return emit(result, json_out=args.json, out_dir=args.out,
                write_outputs=migrate_report.write_outputs,
                print_tables=migrate_report.print_tables)
