"""The host part of `pdserve sim calibrate`: how much slower one engine's steps run while other
engines compute on the same cores.

Owns the measurement: N engines (one process each, the profile's threads each) load the real
model, then run the same round of steps (prefill steps, then decode steps) with 1, 2, ... N of
them at once, the counts interleaved and repeated; the slowdown table is each count's quickest
mean round over the one-engine round. Then the decode table: one engine's decode steps with 0,
1, ... N-1 others running prefill steps beside it, over its decode steps alone. Also the host's
core count. Must not fit step constants (`calibrate.py` does) or simulate.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from datetime import date
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from pdserve.simtools.calibrate import Plan
    from pdserve.core.step_profile import StepProfile


def cores() -> int:
    """The cores this process may run on (its affinity), else the machine's count."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


HOST_ENGINE = """
import torch
torch.set_num_threads({threads})
from pdserve.simtools.calibrate_host import host_round
host_round({model!r}, {prefill!r}, {decode!r}, {probe!r})
"""


def host_round(model: str, prefill: tuple[int, int], decode: tuple[int, int],
               probe: tuple[int, int, int] = (4, 256, 512)) -> None:
    """One engine of the host measurement (a child process): loads, warms up, says `ready`,
    then per line on stdin: `go` times one round (prefill steps, then decode steps), `decode`
    the decode probe (`probe`: batch, context tokens), `load S` runs prefill steps of
    probe[2] tokens for S seconds."""
    import random

    from pdserve.engine.config import EngineConfig, SchedulerConfig
    from pdserve.engine.engine import LLMEngine
    from pdserve.engine.sampling import SamplingParams

    rng = random.Random(0)
    engine = LLMEngine(EngineConfig(model, dtype="float32", scheduler=SchedulerConfig(
        max_num_batched_tokens=max(prefill[0], probe[2], 64) * 2)))
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
    def load(seconds: float) -> None:
        """Prefill steps, back to back, for `seconds` (other work beside a decode probe)."""
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            engine.add_request(None, prompt(probe[2]), SamplingParams(max_tokens=1))
            while engine.has_work():
                engine.step()

    def decode_probe() -> float:
        """The median of 2 x decode[1] decode steps of probe[0] sequences of probe[1] tokens."""
        steps = 2 * decode[1]
        for _ in range(probe[0]):
            engine.add_request(None, prompt(probe[1]), SamplingParams(max_tokens=steps + 2,
                                                                       ignore_eos=True))
        engine.step()  # the prompts' prefill, untimed
        times = []
        while engine.has_work():
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
        return statistics.median(times[:steps])

    one_round()
    decode_probe()
    print("ready", flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if cmd == ["go"]:
            print(f"{one_round():.6f}", flush=True)
        elif cmd == ["decode"]:
            print(f"{decode_probe():.6f}", flush=True)
        elif len(cmd) == 2 and cmd[0] == "load":
            load(float(cmd[1]))
            print("done", flush=True)
        else:
            break


def host_slowdown(model: str, threads: int, plan: Plan, say) -> tuple[list[float], list[float]]:
    """How many times longer one engine's round of steps takes while 1, 2, ... engines (one
    process each, `threads` threads) run the same round at once on this host: the slowdown
    table of workers sharing these cores (`host.py`). Each count: `plan.repeats` rounds, the
    counts interleaved, the quickest mean over the engines. Also the decode table: how many
    times longer one engine's decode step takes (the median of a probe's steps) while 0, 1, ...
    others run prefill steps back to back."""
    import subprocess

    code = HOST_ENGINE.format(threads=threads, model=model, prefill=plan.host_prefill,
                              decode=plan.host_decode, probe=plan.host_probe)
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
        decode = _decode_table(procs, counts, plan, say)
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
    return [m / means[0] for m in means], decode


def _send(p, line: str) -> None:
    p.stdin.write(line + "\n")
    p.stdin.flush()


def _decode_table(procs, counts, plan: Plan, say) -> list[float]:
    """The decode probe on the first engine with k - 1 others loading the cores with prefills
    (for long enough to outlast it), each count `plan.repeats` times, interleaved; the median
    per count (what a decode worker beside prefills sees, not its luckiest probe)."""
    _send(procs[0], "decode")
    alone = float(procs[0].stdout.readline())
    steps: dict[int, list[float]] = {k: [] for k in counts}
    for _ in range(plan.repeats):
        for k in counts:
            for p in procs[1:k]:
                _send(p, f"load {6 * alone * plan.host_decode[1] + 1.0:.3f}")
            _send(procs[0], "decode")
            steps[k].append(float(procs[0].stdout.readline()))
            for p in procs[1:k]:
                if p.stdout.readline().strip() != "done":
                    raise RuntimeError("a host-measurement engine stopped answering")
    best = [statistics.median(steps[k]) for k in counts]
    for k, b in zip(counts, best):
        say(f"host: a decode step beside {k - 1} computing prefill(s): {b * 1e3:.1f} ms "
            f"(x{b / best[0]:.2f})")
    return [b / best[0] for b in best]


def calibrate_host(profile: StepProfile, model: str | None = None, plan: Plan | None = None,
                   threads: int = 1, say: Callable[[str], None] = lambda s: None) -> StepProfile:
    """`profile` with this host's cores and slowdown table measured now (its step constants as
    they were): how a profile from a quiet machine learns the host it was measured on."""
    import dataclasses

    from pdserve.engine.model_files import default_model_path
    from pdserve.simtools.calibrate import FULL

    plan = plan or FULL
    load = os.getloadavg()[0]
    slowdown, decode = host_slowdown(model or default_model_path(), threads, plan, say)
    host = {"host_cores": cores(), "threads": threads, "host_slowdown": slowdown,
            "host_slowdown_decode": decode,
            "loadavg_1m": {"start": load, "end": os.getloadavg()[0]},
            "date": date.today().isoformat()}
    return dataclasses.replace(profile, host_cores=cores(), threads_per_worker=threads,
                               host_slowdown=tuple(slowdown),
                               host_slowdown_decode=tuple(decode),
                               fit={**profile.fit, "host": host})
