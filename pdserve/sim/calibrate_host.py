"""The host part of `pdserve sim calibrate`: how much slower one engine's steps run while other
engines compute on the same cores.

Owns the measurement: N engines (one process each, the profile's threads each) load the real
model, then run the same round of steps (prefill steps, then decode steps) with 1, 2, ... N of
them at once, the counts interleaved and repeated; the slowdown table is each count's quickest
mean round over the one-engine round. Also the host's core count. Must not fit step constants
(`calibrate.py` does) or simulate.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import date
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from pdserve.sim.calibrate import Plan
    from pdserve.sim.profile import StepProfile


def cores() -> int:
    """The cores this process may run on (its affinity), else the machine's count."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


HOST_ENGINE = """
import torch
torch.set_num_threads({threads})
from pdserve.sim.calibrate_host import host_round
host_round({model!r}, {prefill!r}, {decode!r})
"""


def host_round(model: str, prefill: tuple[int, int], decode: tuple[int, int]) -> None:
    """One engine of the host measurement (a child process): loads, warms up, says `ready`,
    then times one round (prefill steps, then decode steps) per `go` line on stdin."""
    import random

    from pdserve.engine.config import EngineConfig, SchedulerConfig
    from pdserve.engine.engine import LLMEngine
    from pdserve.engine.sampling import SamplingParams

    rng = random.Random(0)
    engine = LLMEngine(EngineConfig(model, dtype="float32", scheduler=SchedulerConfig(
        max_num_batched_tokens=max(prefill[0], 64) * 2)))
    vocab = engine.model_config.vocab_size

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]

    def one_round() -> float:
        t0 = time.perf_counter()
        for _ in range(prefill[1]):
            engine.add_request(None, prompt(prefill[0]), SamplingParams(max_tokens=1))
            while engine.has_work():
                engine.step()
        for _ in range(decode[0]):
            engine.add_request(None, prompt(64), SamplingParams(max_tokens=decode[1] + 1,
                                                                 ignore_eos=True))
        while engine.has_work():
            engine.step()
        return time.perf_counter() - t0
    one_round()
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() != "go":
            break
        print(f"{one_round():.6f}", flush=True)


def host_slowdown(model: str, threads: int, plan: Plan, say) -> list[float]:
    """How many times longer one engine's round of steps takes while 1, 2, ... engines (one
    process each, `threads` threads) run the same round at once on this host: the slowdown
    table of workers sharing these cores (`host.py`). Each count: `plan.repeats` rounds, the
    counts interleaved, the quickest mean over the engines."""
    import subprocess

    code = HOST_ENGINE.format(threads=threads, model=model, prefill=plan.host_prefill,
                              decode=plan.host_decode)
    procs = [subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
             for _ in range(plan.host_workers)]
    try:
        for p in procs:
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError("a host-measurement engine did not start")
        counts = range(1, plan.host_workers + 1)
        rounds: dict[int, list[float]] = {k: [] for k in counts}
        for _ in range(plan.repeats):  # interleaved: a drift in other work hits every count
            for k in counts:
                for p in procs[:k]:
                    p.stdin.write("go\n")
                    p.stdin.flush()
                rounds[k].append(sum(float(p.stdout.readline()) for p in procs[:k]) / k)
        means = [min(rounds[k]) for k in counts]
        for k, m in zip(counts, means):
            say(f"host: {k} engine(s) at once: {m * 1e3:.0f} ms per round (x{m / means[0]:.2f}; "
                f"rounds {', '.join(f'{x * 1e3:.0f}' for x in rounds[k])} ms)")
    finally:
        for p in procs:
            try:
                p.stdin.close()
            except OSError:  # it died: its exit is waited for below
                pass
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
    return [m / means[0] for m in means]


def calibrate_host(profile: StepProfile, model: str | None = None, plan: Plan | None = None,
                   threads: int = 1, say: Callable[[str], None] = lambda s: None) -> StepProfile:
    """`profile` with this host's cores and slowdown table measured now (its step constants as
    they were): how a profile from a quiet machine learns the host it was measured on."""
    import dataclasses

    from pdserve.engine.model_files import default_model_path
    from pdserve.sim.calibrate import FULL

    plan = plan or FULL
    load = os.getloadavg()[0]
    slowdown = host_slowdown(model or default_model_path(), threads, plan, say)
    host = {"host_cores": cores(), "threads": threads, "host_slowdown": slowdown,
            "loadavg_1m": {"start": load, "end": os.getloadavg()[0]},
            "date": date.today().isoformat()}
    return dataclasses.replace(profile, host_cores=cores(), threads_per_worker=threads,
                               host_slowdown=tuple(slowdown), fit={**profile.fit, "host": host})
