"""The clients of a chaos run: streaming requests that a user's client library would send, and a
probe that records what the router's health said over time.

Owns: one streaming gRPC `Generate` per thread, retried on UNAVAILABLE (the router itself died
or restarted: the stream is gone, so the client sends the same request again, as an OpenAI client
with `max_retries` does, and checks that the tokens it already showed come back first: output
at position i is a function of (prompt, seed, i), so a resent request never changes what the
user saw); and a health probe thread.
Must not: kill processes or judge results (`chaos.py` does both).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve import rpc
from pdserve.proto import api_pb2, api_pb2_grpc, common_pb2

# Statuses a client retries: the server (or a hop it depends on) was unreachable.
_RETRIED = (grpc.StatusCode.UNAVAILABLE,)


@dataclass(frozen=True)
class RequestSpec:
    """One request of the workload: prompt token ids and its sampling parameters."""

    prompt: tuple[int, ...]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    request_id: str = ""  # "": the router picks one (an emulated engine's tokens follow it)

    def message(self) -> api_pb2.GenerateRequest:
        sampling = common_pb2.SamplingParams(max_tokens=self.max_tokens, ignore_eos=True,
                                             temperature=self.temperature, top_p=self.top_p)
        if self.seed is not None:
            sampling.seed = self.seed
        req = api_pb2.GenerateRequest(sampling=sampling, request_id=self.request_id)
        req.token_ids.ids.extend(self.prompt)
        return req


def workload(n: int, prompt_tokens: int, max_tokens: int, vocab: int, seed: int = 0,
             ids: str = "") -> list[RequestSpec]:
    """`n` requests: even ones greedy, odd ones sampled (temperature 0.9, top-p 0.95) with
    their own seed; prompts of `prompt_tokens` ids drawn below `vocab`, distinct per request;
    with `ids`, request i is called `ids` + i."""
    import random

    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = tuple(rng.randrange(10, vocab) for _ in range(prompt_tokens + i % 7))
        rid = f"{ids}{i}" if ids else ""
        if i % 2 == 0:
            out.append(RequestSpec(prompt, max_tokens, request_id=rid))
        else:
            out.append(RequestSpec(prompt, max_tokens, 0.9, 0.95, 1000 + i, request_id=rid))
    return out


class StreamClient(threading.Thread):
    """One request, streamed; resent on UNAVAILABLE until `deadline_s` (monotonic) passes.

    `ids` holds what the user saw, each token once: a resent stream's first tokens must equal
    them (else `error` says so) and only the tokens past them are appended."""

    def __init__(self, router: str, spec: RequestSpec, deadline_s: float,
                 retry_wait_s: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.router, self.spec, self.deadline_s = router, spec, deadline_s
        self.retry_wait_s = retry_wait_s
        self.ids: list[int] = []
        self.finish: int | None = None
        self.error: str | None = None
        self.resends = 0
        self.started_s = 0.0
        self.ended_s = 0.0

    def run(self) -> None:
        self.started_s = time.monotonic()
        try:
            while True:
                try:
                    self._attempt()
                    return
                except grpc.RpcError as e:
                    left = self.deadline_s - time.monotonic()
                    if e.code() not in _RETRIED or left <= self.retry_wait_s:
                        self.error = f"{e.code().name}: {e.details()}"
                        return
                    self.resends += 1
                    time.sleep(self.retry_wait_s)
        finally:
            self.ended_s = time.monotonic()

    def _attempt(self) -> None:
        seen = 0  # tokens of this attempt
        with rpc.make_channel(self.router, rpc.PUBLIC) as ch:
            stream = api_pb2_grpc.GenerationStub(ch).Generate(
                self.spec.message(), timeout=max(0.1, self.deadline_s - time.monotonic()))
            for r in stream:
                for t in r.token_ids:
                    if seen < len(self.ids):
                        if self.ids[seen] != t:
                            raise _Diverged(seen, self.ids[seen], t)
                    else:
                        self.ids.append(t)
                    seen += 1
                if r.finish_reason:
                    self.finish = r.finish_reason


class _Diverged(grpc.RpcError):
    """A resent stream disagreed with what the user already saw: never retried."""

    def __init__(self, i: int, had: int, got: int) -> None:
        super().__init__()
        self._text = f"resent stream diverged at token {i}: had {had}, got {got}"

    def code(self):
        return grpc.StatusCode.DATA_LOSS

    def details(self):
        return self._text


@dataclass
class HealthProbe:
    """Polls the router's gRPC health every `interval_s`; `samples` are (t, serving?) with
    t on the monotonic clock; an unreachable router counts as not serving."""

    address: str
    interval_s: float = 0.1
    samples: list[tuple[float, bool]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> "HealthProbe":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        req = health_pb2.HealthCheckRequest(service="")
        while not self._stop.is_set():
            try:
                with rpc.make_channel(self.address, rpc.PUBLIC) as ch:
                    while not self._stop.is_set():
                        try:
                            r = health_pb2_grpc.HealthStub(ch).Check(req, timeout=1.0)
                            ok = r.status == health_pb2.HealthCheckResponse.SERVING
                        except grpc.RpcError:
                            ok = False
                        self.samples.append((time.monotonic(), ok))
                        self._stop.wait(self.interval_s)
            except Exception:  # noqa: BLE001 - a channel that cannot open is "not serving"
                self.samples.append((time.monotonic(), False))
                self._stop.wait(self.interval_s)

    def not_serving_s(self) -> float:
        """Seconds the probe saw the router not serving (sum of sample intervals)."""
        total = 0.0
        for (t0, ok), (t1, _) in zip(self.samples, self.samples[1:]):
            if not ok:
                total += t1 - t0
        return total
