"""One policy's replay for `pdserve bench route`: requests sent at their times, answers kept.

Owns the client side of a run: a thread per request in flight (bounded; requests past the bound
wait in the client, and that wait counts in their TTFT, which runs from the scheduled arrival),
the workers' counters before and after (GetStats), and the CPU each process used (psutil).
Must not start or stop processes: `route.py` does.
"""

from __future__ import annotations

import math
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 1]) of a non-empty list."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


class Replay:
    """Sends prompts through one router at their (scaled) arrival times; records each answer."""

    def __init__(self, address: str, prompts: list[list[int]], arrivals_s: list[float],
                 max_in_flight: int, timeout_s: float, on_done=None, max_tokens: int = 1) -> None:
        self.address, self.prompts, self.arrivals_s = address, prompts, arrivals_s
        self.max_in_flight, self.timeout_s, self.on_done = max_in_flight, timeout_s, on_done
        self.max_tokens = max_tokens
        self.ttft_s: list[float | None] = [None] * len(prompts)
        # Each request's ending: "OK" or the gRPC status name it failed with.
        self.codes: list[str] = ["OK"] * len(prompts)
        self.cached: list[int] = [0] * len(prompts)
        self.errors: list[str] = []
        self._lock = threading.Lock()

    def _one(self, stub, i: int, t_arrival: float) -> None:
        from pdserve.proto import api_pb2, common_pb2

        req = api_pb2.GenerateRequest(
            request_id=uuid.uuid4().hex, token_ids=api_pb2.TokenIds(ids=self.prompts[i]),
            sampling=common_pb2.SamplingParams(max_tokens=self.max_tokens, temperature=0.0))
        try:
            for resp in stub.Generate(req, timeout=self.timeout_s):
                if self.ttft_s[i] is None:
                    self.ttft_s[i] = time.perf_counter() - t_arrival
                if resp.HasField("usage"):
                    self.cached[i] = resp.usage.cached_prompt_tokens
        except Exception as e:  # any failure is recorded and counted, never hidden
            code = getattr(e, "code", None)
            self.codes[i] = code().name if callable(code) else type(e).__name__
            with self._lock:
                self.errors.append(f"request {i}: {type(e).__name__}: {e}")
        if self.on_done is not None:
            self.on_done()

    def run(self) -> float:
        """Replay everything; returns the wall time in seconds."""
        from pdserve import rpc
        from pdserve.proto import api_pb2_grpc

        with rpc.make_channel(self.address, rpc.PUBLIC) as ch, \
                ThreadPoolExecutor(self.max_in_flight, thread_name_prefix="replay") as pool:
            stub = api_pb2_grpc.GenerationStub(ch)
            t0 = time.perf_counter()
            for i, at in enumerate(self.arrivals_s):
                delay = t0 + at - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                pool.submit(self._one, stub, i, t0 + at)
        return time.perf_counter() - t0


def worker_stats(addresses: list[str]) -> list[Any]:
    from pdserve import rpc
    from pdserve.proto import worker_pb2 as wpb
    from pdserve.proto import worker_pb2_grpc as wpb_grpc

    out = []
    for a in addresses:
        with rpc.make_channel(a, "worker") as ch:
            out.append(wpb_grpc.WorkerStub(ch).GetStats(wpb.GetStatsRequest(), timeout=60))
    return out


def cpu_s(cluster) -> dict[str, float]:
    """CPU seconds (user + system) used so far by each child of the cluster and this process."""
    import psutil

    me = psutil.Process().cpu_times()
    out = {"bench-client": me.user + me.system}
    for c in cluster.children:
        try:
            t = psutil.Process(c.proc.pid).cpu_times()
        except psutil.Error:
            continue
        out[c.name] = t.user + t.system
    return out
