"""The clients and the arithmetic of `pdserve bench migrate`: the requests, one streaming
`Generate` per thread that keeps the arrival time of every message, and the stall figures.

Owns the workload (`workload`: distinct prompts, even requests greedy, odd ones seeded
sampling), `TimedStream` (tokens, message times on the monotonic clock, finish, error) and
the figures read from those times (`stall_s`, `gaps_s`, `percentiles`).
Must not start clusters or call workers (`migrate.py` does).
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass

from pdserve import rpc
from pdserve.core.stats import percentile
from pdserve.proto import api_pb2, api_pb2_grpc, common_pb2

PROMPT_TOKENS = (20, 60)  # each prompt's length lies in this range


class WorkloadError(ValueError):
    """The flags ask for a workload the model cannot give (the message names them)."""


@dataclass(frozen=True)
class Request:
    prompt: tuple[int, ...]
    max_tokens: int
    seed: int | None = None  # None: greedy; else sampled (temperature 0.8, top-p 0.9)

    def message(self) -> api_pb2.GenerateRequest:
        sampling = common_pb2.SamplingParams(max_tokens=self.max_tokens, ignore_eos=True)
        if self.seed is not None:
            sampling.temperature, sampling.top_p, sampling.seed = 0.8, 0.9, self.seed
        req = api_pb2.GenerateRequest(sampling=sampling)
        req.token_ids.ids.extend(self.prompt)
        return req


def workload(sets: int, n: int, max_tokens: int, vocab: int, seed: int) -> list[list[Request]]:
    """`sets` lists of `n` requests; no token id appears twice in any prompt of any set, so no
    request shares a cached block with another. In a set even requests are greedy, odd ones
    sampled with a seed of their own."""
    lo, hi = PROMPT_TOKENS
    rng = random.Random(seed)
    lengths = [[rng.randint(lo, hi) for _ in range(n)] for _ in range(sets)]
    need = sum(map(sum, lengths))
    if need > vocab - 100:
        raise WorkloadError(f"--requests x --runs: {need} distinct prompt tokens needed "
                            f"({sets} sets of {n}), the model's vocabulary has {vocab}")
    ids = iter(rng.sample(range(100, vocab), need))
    return [[Request(tuple(next(ids) for _ in range(length)), max_tokens,
                     None if i % 2 == 0 else 5000 + 97 * k + i)
             for i, length in enumerate(row)] for k, row in enumerate(lengths)]


class TimedStream(threading.Thread):
    """One request streamed through the router: `ids`, and in `times` the arrival of each
    message that carried tokens (time.monotonic(), taken as it is read)."""

    def __init__(self, router: str, request: Request, timeout_s: float) -> None:
        super().__init__(daemon=True)
        self.router, self.request, self.timeout_s = router, request, timeout_s
        self.ids: list[int] = []
        self.times: list[float] = []
        self.finish: int | None = None
        self.error: str | None = None

    def run(self) -> None:
        try:
            with rpc.make_channel(self.router, rpc.PUBLIC) as ch:
                stream = api_pb2_grpc.GenerationStub(ch).Generate(self.request.message(),
                                                                  timeout=self.timeout_s)
                for r in stream:
                    if r.token_ids:
                        self.times.append(time.monotonic())
                        self.ids.extend(r.token_ids)
                    if r.finish_reason:
                        self.finish = r.finish_reason
        except Exception as e:  # recorded and counted, never hidden
            details = getattr(e, "details", None)
            self.error = f"{type(e).__name__}: {details() if callable(details) else e}"
        if self.error is None and len(self.ids) != self.request.max_tokens:
            self.error = f"{len(self.ids)} of {self.request.max_tokens} tokens"


def run_all(router: str, requests: list[Request], timeout_s: float) -> list[TimedStream]:
    """Every request streamed at once; returns the streams once all ended."""
    streams = start(router, requests, timeout_s)
    for s in streams:
        s.join(timeout_s + 30)
    return streams


def start(router: str, requests: list[Request], timeout_s: float) -> list[TimedStream]:
    streams = [TimedStream(router, r, timeout_s) for r in requests]
    for s in streams:
        s.start()
    return streams


def gaps_s(times: list[float]) -> list[float]:
    """Seconds between consecutive messages."""
    return [b - a for a, b in zip(times, times[1:])]


def stall_s(times: list[float], moved_at: float) -> float | None:
    """The longest gap between consecutive messages that ends after `moved_at` (the move
    started): one that begins before it counts too, since the source stops the stream between
    two steps and the client may be waiting on the first of them when the call starts. None:
    no message came after it."""
    ends = [b - a for a, b in zip(times, times[1:]) if b > moved_at]
    return max(ends) if ends else None


def percentiles(xs: list[float], ps=(50, 90, 99)) -> dict[str, float | None]:
    """Percentiles `ps` (`core.stats.percentile`'s rule) and the max (None when `xs` is
    empty)."""
    return {**{f"p{p}": percentile(xs, p) for p in ps}, "max": max(xs) if xs else None}
