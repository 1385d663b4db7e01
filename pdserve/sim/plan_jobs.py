"""Running a plan's candidates in worker processes, as many at once as memory and cores allow.

Owns the memory one candidate's simulation is estimated to take (`job_memory_bytes`: the
workers' KV block pools and prefix caches, the store, the router's and the per-request
records, at sizes measured on the simulator), how many jobs fit (`choose_jobs`, pure), what
this machine has (`available_memory_bytes`), and `run_jobs`: each candidate simulated in a
spawned process of its own (so its peak resident memory is its own: `peak_rss_bytes` in its
row), progress sent back on a queue, and a process that raises or dies (the kernel's
out-of-memory killer) reported as `JobFailed` naming the candidate, the others stopped.
Must not build or rank candidates, nor draw.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import resource
import signal
import time
import traceback
from dataclasses import dataclass
from typing import Any

from pdserve.sim.plan_progress import PlanProgress, duration

GB = 1e9
# Bytes of simulator state (peak resident memory, fragmentation included), fitted to 1,000
# workers on the Mooncake trace: 9.5 GB with 20.8 million blocks cached and the store full at
# 16-token blocks, 0.94 GB with 4.1 million blocks stored at 512-token blocks.
BASE_BYTES = 200 * 2**20  # the interpreter, the modules, the trace, the router's tables
POOL_BLOCK_BYTES = 24  # per KV block of a worker: its holder count, hash, reuse-order links
CACHED_BLOCK_BYTES = 350  # per block a prefix cache holds: its hash, the by-hash map, the
# router's index of prefill caches and the count of decode caches holding it
STORE_BLOCK_BYTES = 140  # per block the shared store holds (least recently used order)
REQUEST_BYTES = 900  # per request: its records and trace columns, and its state while it
# waits in an overloaded pool's queue (a candidate whose pool is too small queues most)
HEADROOM = 0.9  # of the memory available, what the jobs may take together


class JobFailed(RuntimeError):
    """A candidate's process raised or died; the message names the candidate and why
    (`detail`: the process's traceback, if it raised)."""

    def __init__(self, message: str, detail: str = "") -> None:
        super().__init__(message)
        self.detail = detail


@dataclass(frozen=True)
class JobSize:
    """What a candidate's memory grows with."""
    workers: int
    blocks_per_worker: int  # KV blocks of each worker's pool
    store_blocks: int  # the shared store's capacity
    requests: int
    prompt_blocks: float  # full blocks of a prompt, on average


def job_memory_bytes(z: JobSize) -> int:
    """About the most resident memory one candidate's simulation takes: every pool's blocks,
    the prefix caches filled (each prompt's blocks in a prefill and a decode cache, up to the
    pools' size), the store filled with the prompts' blocks up to its capacity, and the
    per-request state."""
    pool = z.workers * z.blocks_per_worker
    put = z.requests * z.prompt_blocks
    cached = min(pool, 2 * put)
    stored = min(z.store_blocks, put)
    return int(BASE_BYTES + pool * POOL_BLOCK_BYTES + cached * CACHED_BLOCK_BYTES
               + stored * STORE_BLOCK_BYTES + z.requests * REQUEST_BYTES)


def choose_jobs(available_bytes: int | None, per_job_bytes: int, cpus: int,
                candidates: int) -> int:
    """Candidates to simulate at once: as many as fit in `HEADROOM` of the memory available
    at `per_job_bytes` each (any number if it is not known), at most one per cpu and per
    candidate, at least one; 0 when not even one fits."""
    fit = cpus if available_bytes is None else int(HEADROOM * available_bytes
                                                   // max(1, per_job_bytes))
    if fit < 1:
        return 0
    return max(1, min(fit, cpus, candidates))


def available_memory_bytes(meminfo: str = "/proc/meminfo") -> int | None:
    """MemAvailable of `meminfo` (what can be allocated without swapping), or None."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


# ---- in the job's process ---------------------------------------------------------------------
def _job(k: int, candidate: Any, requests: Any, s: dict[str, Any], out: Any) -> None:
    """Simulate candidate `k` and put its row (with the process's peak resident memory) on
    `out`, after a "start" and "tick"s of simulated time; an exception is put as "error"."""
    out.put(("start", k, os.getpid()))
    try:
        from pdserve.sim.plan import run_candidate

        last = [0.0]

        def progress(now_s: float, done: int, total: int) -> None:
            t = time.monotonic()
            if t - last[0] >= 0.5:
                last[0] = t
                out.put(("tick", k, now_s))

        row = run_candidate(candidate, requests, s["profile"], s, progress)
        row["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        out.put(("row", k, row))
    except BaseException as e:  # MemoryError too: the parent names the candidate
        out.put(("error", k, f"{type(e).__name__}: {e}", traceback.format_exc()))


def _how_it_ended(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        why = " (on Linux most likely the out-of-memory killer)" if -exitcode == 9 else ""
        return f"was killed by {name}{why}"
    return f"ended with exit code {exitcode} and no result"


# ---- in the plan's process --------------------------------------------------------------------
def run_jobs(candidates: list[Any], requests: Any, s: dict[str, Any], jobs: int,
             progress: PlanProgress, hint: str = "") -> list[dict[str, Any]]:
    """Each candidate's row (in order), simulated `jobs` at a time in spawned processes.
    `hint` ends the message of a process that dies (what to try)."""
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    todo = list(enumerate(candidates))
    running: dict[int, Any] = {}
    rows: dict[int, dict[str, Any]] = {}

    def take(msg) -> None:
        kind, k = msg[0], msg[1]
        if kind == "tick":
            progress.tick(k, msg[2])
        elif kind == "row":
            rows[k] = msg[2]
        elif kind == "error":
            raise JobFailed(f"candidate {candidates[k].name!r} failed: {msg[2]}",
                            "" if msg[2].startswith("MemoryError") else msg[3])

    def drain(wait_s: float) -> None:
        try:
            msg = out.get(timeout=wait_s)
            while True:
                take(msg)
                msg = out.get_nowait()
        except queue.Empty:
            pass

    try:
        while todo or running:
            while todo and len(running) < jobs:
                k, c = todo.pop(0)
                p = ctx.Process(target=_job, args=(k, c, requests, s, out), daemon=True)
                p.start()
                running[k] = p
                progress.start(k, c.name)
            drain(0.5)
            for k, p in list(running.items()):
                if k not in rows and p.exitcode is not None:
                    drain(1.0)  # its row may still be on its way
                if k in rows:
                    p.join()
                    del running[k]
                    wall = progress.end(k)
                    r = rows[k]
                    progress.say(f"{r['name']}: attainment {r['attainment']:.3f} "
                                 f"({r['sim_wall_s']:.1f} s simulating, {duration(wall)} in "
                                 f"all, peak {r['peak_rss_bytes'] / GB:.2f} GB)")
                elif p.exitcode is not None:
                    wall = progress.end(k)
                    raise JobFailed(f"candidate {candidates[k].name!r}: its process "
                                    f"{_how_it_ended(p.exitcode)} after {duration(wall)}"
                                    + (f"; {hint}" if hint else ""))
    finally:
        for p in running.values():
            if p.is_alive():
                p.terminate()
            p.join()
        out.close()
    return [rows[k] for k in range(len(candidates))]
