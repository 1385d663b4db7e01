"""`pdserve sim calibrate`: a `StepProfile` fitted to the real engine, store and cluster here.

Owns the measurement plan (prefill steps vs uncached tokens on cached context, decode steps vs
batch size and context, mixed steps, several prompts prefilled in one step; store put+get per
transport; through `calibrate_cluster.py`, in a real 1P1D cluster, a worker's start-up, the gap
between streamed tokens at a few decode batches, single prompts' first tokens and an idle role
flip; through `calibrate_host.py`, the host's cores and slowdown) and the re-measuring of a
profile's step constants and serving costs (`steps_now`, what `sim validate` does before its
real runs). The fits are `calibrate_fit.py`'s. The engine, the store and the cluster are
imported only inside the measuring functions, so the fit and the CLI's help stay torch-free.
Must not simulate anything or decide what a measurement should have been.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from dataclasses import dataclass
from datetime import date
from typing import Callable

import numpy as np

from pdserve.simtools.calibrate_cluster import cluster_times, serving_times
from pdserve.simtools.calibrate_fit import (  # noqa: F401 - the fits, importable from here
    FEATURES, SERVING, Point, build_profile, fit_serving, fit_serving_prefill, fit_steps,
    fit_transfer, with_serving)
from pdserve.simtools.calibrate_host import calibrate_host, cores, host_slowdown
from pdserve.core.step_profile import StepProfile


@dataclass(frozen=True)
class Plan:
    prefill_tokens: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024, 2048)
    cached_tokens: tuple[int, ...] = (0, 512, 1536)
    decode_batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    decode_prompt_tokens: tuple[int, ...] = (64, 256)
    decode_steps: int = 16  # the median step is kept: the decode points are the noisiest
    mixed: tuple[tuple[int, int], ...] = ((64, 4), (256, 4), (256, 16), (1024, 8))
    # prompts x tokens prefilled in one step: a burst of arrivals batches short prompts, whose
    # attention is small but whose linear layers run on every token
    batched: tuple[tuple[int, int], ...] = ((4, 64), (8, 128), (8, 256), (4, 512))
    repeats: int = 2
    transfer_sizes: tuple[int, ...] = (1 << 18, 1 << 22, 1 << 24)
    host_workers: int = 4  # engines computing at once, 1..N, for the host's slowdown table
    host_prefill: tuple[int, int] = (256, 3)  # each engine's round: prefill tokens x steps,
    host_decode: tuple[int, int] = (4, 12)  # then decode batch x steps
    # the decode probe: batch, context tokens per sequence; the others' prefill steps' tokens
    host_probe: tuple[int, int, int] = (4, 256, 512)
    cluster: bool = True  # start a 1P1D cluster: start-up, served decode steps, flip time
    served_batches: tuple[int, ...] = (1, 4, 8, 16)  # decode batches timed in that cluster
    served_prompts: tuple[int, ...] = (32, 128, 512)  # single prompts' first tokens timed there


FULL = Plan()
QUICK = Plan(prefill_tokens=(16, 64, 256), cached_tokens=(0, 256), decode_batches=(1, 4),
             decode_prompt_tokens=(32, 256), decode_steps=3, mixed=((64, 4),), batched=((4, 64),),
             repeats=1,
             transfer_sizes=(1 << 16, 1 << 20), host_workers=2, host_prefill=(64, 2),
             host_decode=(2, 4), host_probe=(2, 64, 64), served_batches=(1, 4),
             served_prompts=(32, 128))
# The step constants alone (no store, host or cluster), in about a minute: what `sim validate`
# re-measures next to its real runs, since a shared machine's speed drifts by 20-30 % over hours.
STEPS_NOW = Plan(prefill_tokens=(32, 128, 256, 512), cached_tokens=(0, 512),
                 decode_batches=(1, 4, 8, 16), decode_prompt_tokens=(64, 256), decode_steps=8,
                 mixed=((64, 4), (256, 4)), batched=((4, 64), (4, 128)), repeats=3,
                 transfer_sizes=(), host_workers=0, cluster=True, served_batches=(1, 4, 8))
STEPS_QUICK = Plan(**{**QUICK.__dict__, "transfer_sizes": (), "host_workers": 0,
                      "cluster": False})


# ---- measuring (imports the engine, the store, the cluster) -----------------------------------
def _median(xs: list[float]) -> float:
    """The middle of the repeats (the mean of the middle two): the step a cluster sees, not the
    luckiest one."""
    ys = sorted(xs)
    return (ys[(len(ys) - 1) // 2] + ys[len(ys) // 2]) / 2


def _step_times(engine, plan: Plan, salt: Callable[[], str], say) -> list[Point]:
    import random

    from pdserve.engine.sampling import SamplingParams

    rng = random.Random(0)
    vocab = engine.model_config.vocab_size

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]

    def timed_step() -> float:
        t0 = time.perf_counter()
        engine.step()
        return time.perf_counter() - t0

    def drain() -> None:
        while engine.has_work():
            engine.step()
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    engine.add_request(None, prompt(64), one, salt=salt())  # warm-up, not timed
    drain()
    points = []
    for cached in plan.cached_tokens:
        # One prefix per context size, computed once (untimed) and then hit in the prefix
        # cache by every timed prompt: each of those adds fresh tokens after it.
        s, ctx = salt(), prompt(cached)
        if cached:
            engine.add_request(None, ctx, one, salt=s)
            drain()
        for n in plan.prefill_tokens:
            best = []
            for _ in range(plan.repeats):
                engine.add_request(None, ctx + prompt(n), one, salt=s)
                best.append(timed_step())
                drain()
            points.append(Point("prefill", n, cached, 0, 0, _median(best)))
            say(f"prefill {n} tokens on {cached} cached: {points[-1].seconds * 1e3:.1f} ms")
    for k, n in plan.batched:
        best = []
        for _ in range(plan.repeats):
            for _ in range(k):
                engine.add_request(None, prompt(n), one, salt=salt())
            best.append(timed_step())
            drain()
        points.append(Point("batched", k * n, 0, 0, 0, _median(best), prompts=k))
        say(f"prefill {k} prompts x {n} tokens in one step: {points[-1].seconds * 1e3:.1f} ms")
    for length in plan.decode_prompt_tokens:
        for b in plan.decode_batches:
            points += _decode_points(engine, prompt, b, length, plan, salt(), None)
            say(f"decode batch {b} x {length}: {points[-1].seconds * 1e3:.1f} ms")
    for p, b in plan.mixed:
        points += _decode_points(engine, prompt, b, 64, plan, salt(), p)
        say(f"mixed {p} prefill + {b} decodes: {points[-1].seconds * 1e3:.1f} ms")
    return points


def _decode_points(engine, prompt, b: int, length: int, plan: Plan, salt: str,
                   mixed_prefill: int | None) -> list[Point]:
    from pdserve.engine.sampling import SamplingParams

    # The sequences share all but their last 8 prompt tokens, computed once beforehand: the
    # decode steps still attend over each sequence's whole context, and the set-up prefill
    # stays short on a slow machine.
    params = SamplingParams(max_tokens=plan.decode_steps + 3, ignore_eos=True)
    shared = prompt(max(0, length - 8))
    engine.add_request(None, shared, SamplingParams(max_tokens=1, ignore_eos=True), salt=salt)
    while engine.has_work():
        engine.step()
    ids = [engine.add_request(None, shared + prompt(length - len(shared)), params, salt=salt)
           for _ in range(b)]
    made = dict.fromkeys(ids, 0)
    while min(made.values()) < 1:
        for out in engine.step():
            made[out.request_id] += len(out.new_token_ids)
    points = []
    for i in range(1 if mixed_prefill else plan.decode_steps):
        ctx = sum(length + made[r] for r in ids)
        p = mixed_prefill or 0
        if p:
            engine.add_request(None, prompt(p), SamplingParams(max_tokens=1, ignore_eos=True),
                               salt=salt + "-mixed")
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        for out in outs:
            if out.request_id in made:
                made[out.request_id] += len(out.new_token_ids)
        points.append(Point("mixed" if p else "decode", p, 0, b, ctx, dt))
    while engine.has_work():
        engine.step()
    if not mixed_prefill:  # the median step: one slow step on a shared machine is not the engine
        med = sorted(points, key=lambda q: q.seconds)[len(points) // 2]
        points = [med]
    return points


def _transfers(plan: Plan, say) -> dict[str, list[tuple[int, float]]]:
    from contextlib import ExitStack

    from pdserve.bench import kvstore_measure as m
    from pdserve.bench.kvstore import REMOTE_SUFFIX
    from pdserve.bench.kvstore_procs import PdserveStore
    from pdserve.kvstore.dist_client import DistStoreClient
    from pdserve.kvstore.transport.ucx import ucx_allowed

    out: dict[str, list[tuple[int, float]]] = {}
    with ExitStack() as stack:
        # As the cluster moves KV: TCP under this process's internal TLS; UCX only without.
        ucx = ucx_allowed()
        store = stack.enter_context(PdserveStore(4 * max(plan.transfer_sizes) + (64 << 20),
                                                 ucx=ucx))
        clients = {"shm": DistStoreClient(store.master_address, store.host_id),
                   "tcp": DistStoreClient(store.master_address, store.host_id + REMOTE_SUFFIX,
                                          ucx=False)}
        if ucx:
            clients["ucx"] = DistStoreClient(store.master_address, store.host_id + REMOTE_SUFFIX,
                                             ucx=True)
        for c in clients.values():
            stack.enter_context(c)
        store.wait_registered(clients["shm"])
        for size in plan.transfer_sizes:
            src, dst = m.payload(size), np.empty(size, dtype=np.uint8)
            for name, client in clients.items():
                r = m.client_rounds(client, src, dst, plan.repeats + 1, name)
                out.setdefault(name, []).append((size, min(r["put_s"]) + min(r["get_s"])))
                say(f"transfer {name} {size >> 10} KiB put+get: {out[name][-1][1] * 1e3:.2f} ms")
    return out


def _engine(model: str, plan: Plan, threads: int):
    import torch

    from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from pdserve.engine.engine import LLMEngine
    from pdserve.worker.config import WorkerConfig

    torch.set_num_threads(threads)
    wc = WorkerConfig.__dataclass_fields__
    block, blocks = wc["block_size_tokens"].default, wc["num_blocks"].default
    budget = max(max(plan.prefill_tokens) + max(plan.cached_tokens),
                 max((p + b for p, b in plan.mixed), default=0))
    return LLMEngine(EngineConfig(model, dtype="float32", cache=CacheConfig(
        block_size_tokens=block, num_blocks=blocks), scheduler=SchedulerConfig(
        max_num_seqs=max(plan.decode_batches) + 1, max_num_batched_tokens=budget)))


def calibrate(model: str | None = None, plan: Plan = FULL, threads: int = 1,
              say: Callable[[str], None] = lambda s: None) -> StepProfile:
    from pdserve.engine.model_files import default_model_path
    from pdserve.worker.config import WorkerConfig

    model = model or default_model_path()
    load_start = os.getloadavg()[0]
    engine = _engine(model, plan, threads)
    wc = WorkerConfig.__dataclass_fields__
    block, blocks = wc["block_size_tokens"].default, wc["num_blocks"].default
    counter = iter(range(1 << 30))
    say(f"engine loaded: {model} fp32, {threads} thread(s)")
    points = _step_times(engine, plan, lambda: f"calib-{next(counter)}", say)
    mc = engine.model_config
    kv_bytes = 2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim * 4
    del engine
    transfers = _transfers(plan, say)
    slowdown, decode = host_slowdown(model, threads, plan, say) if plan.host_workers else ([], [])
    times = (cluster_times(model, plan.served_batches, plan.served_prompts, say)
             if plan.cluster else {})
    name = model.rsplit("/", 1)[-1]
    origin = (f"measured: {cores()}-core {platform.machine()} CPU, {name} fp32, "
              f"{threads} thread(s), {date.today().isoformat()}")
    return build_profile(points, transfers, {
        "origin": origin, "model": name, "kv_bytes_per_token": kv_bytes,
        "kv_capacity_tokens": block * blocks, "threads": threads, "host_cores": cores(),
        "host_slowdown": slowdown, "host_slowdown_decode": decode,
        "loadavg_1m": {"start": load_start, "end": os.getloadavg()[0]},
        "plan": "quick" if plan == QUICK else "full", **times})


def steps_now(profile: StepProfile, model: str | None = None, plan: Plan = STEPS_NOW,
              say: Callable[[str], None] = lambda s: None) -> StepProfile:
    """`profile` with its step constants re-measured on this machine now (the engine alone, the
    profile's threads) and, where the plan says `cluster`, its serving costs on a fresh 1P1D
    cluster (`calibrate_cluster.serving_times`); everything else kept: the store, the host
    table, the flip and start-up times. The points and errors are kept under
    `fit["steps_now"]`."""
    from pdserve.engine.model_files import default_model_path

    model = model or default_model_path()
    threads = profile.threads_per_worker or 1
    load_start, stamp = os.getloadavg()[0], time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    engine = _engine(model, plan, threads)
    counter = iter(range(1 << 30))
    say(f"re-measuring the step constants: {model.rsplit('/', 1)[-1]} fp32, "
        f"{threads} thread(s)")
    points = _step_times(engine, plan, lambda: f"steps-{next(counter)}", say)
    del engine
    coef, errors = fit_steps(points)
    serving = SERVING if plan.cluster else ()
    now = {"at": stamp, "errors": errors, "points": [p.__dict__ for p in points],
           "replaced": {k: getattr(profile, k) for k in FEATURES + serving}}
    what = "step constants" + (" and serving costs" if serving else "")
    prof = dataclasses.replace(profile, **coef, origin=f"{profile.origin}; {what} re-measured "
                               f"{stamp}")
    if serving:
        times = serving_times(model, plan.served_batches, plan.served_prompts, say)
        now.update(times)
        prof = with_serving(prof, times)
    now["loadavg_1m"] = {"start": load_start, "end": os.getloadavg()[0]}
    return dataclasses.replace(prof, fit={**profile.fit, "steps_now": now})


def serving_now(profile: StepProfile, name: str, model: str, plan: Plan, kv_scale: float,
                say: Callable[[str], None] = lambda s: None) -> StepProfile:
    """`profile` with its serving costs measured on this machine now, on a fresh 1P1D cluster
    of emulated workers running the profile `name` (`profile`, KV at `kv_scale`): the real processes' time around
    steps the profile models (the router, the gRPC hops, the worker's loop, the store), which
    a GPU profile leaves at zero. The step constants are the profile's own: the emulated
    workers wait them out."""
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    say("measuring the serving costs on an emulated 1P1D cluster")
    times = serving_times(model, plan.served_batches, plan.served_prompts, say,
                          engine="emulated", profile=name, kv_scale=kv_scale)
    prof = with_serving(profile, times)
    return dataclasses.replace(
        prof, origin=f"{profile.origin}; serving costs of emulated workers measured {stamp}",
        fit={**profile.fit, "serving_now": {"at": stamp, **times,
                                           "replaced": {k: getattr(profile, k) for k in SERVING}}})


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--out", required=True, help="where to write the profile JSON")
    p.add_argument("--model", default=None, help="model path (default: SmolLM2-135M GGUF)")
    p.add_argument("--threads", type=int, default=1,
                   help="compute threads (default 1: a worker's share when two share 2 cores)")
    p.add_argument("--quick", action="store_true", help="few points, for tests (minutes)")
    p.add_argument("--host-into", default=None, metavar="PROFILE",
                   help="measure only the host (cores, slowdown with 1..N engines at once) and "
                        "write PROFILE (a shipped name or a file) with it to --out")
    p.add_argument("--no-cluster", action="store_true",
                   help="skip the cluster start-up and flip measurement (flip_s, startup_s = 0)")
    return p


def run(args: argparse.Namespace) -> int:
    if args.threads < 1:
        print("error: --threads must be >= 1", file=sys.stderr)
        return 2
    plan = QUICK if args.quick else FULL
    if args.no_cluster:
        plan = Plan(**{**plan.__dict__, "cluster": False})
    t0 = time.monotonic()

    def say(line: str) -> None:
        print(f"[calibrate {time.monotonic() - t0:6.1f}s] {line}", file=sys.stderr, flush=True)
    if args.host_into:
        from pdserve.core.step_profile import load_profile

        prof = calibrate_host(load_profile(args.host_into), args.model, plan, args.threads,
                              say)
        prof.save(args.out)
        print(json.dumps({"out": args.out, "host_cores": prof.host_cores,
                          "host_slowdown": prof.host_slowdown,
                          "host_slowdown_decode": prof.host_slowdown_decode}, indent=1))
        return 0
    prof = calibrate(args.model, plan, args.threads, say)
    prof.save(args.out)
    print(json.dumps({"out": args.out, "origin": prof.origin, "fit_errors": prof.fit["errors"],
                      "transports": sorted(prof.transports), "flip_s": prof.flip_s,
                      "startup_s": prof.startup_s}, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(add_arguments(argparse.ArgumentParser(prog="pdserve sim calibrate"))
               .parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
