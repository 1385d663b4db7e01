"""Several choices for one request (`n`, `best_of`): the rules, and the fan-out of one stream.

Owns what `GenerateRequest.n` and `best_of` mean: choice i is the request with seed
`seed + i` (the router picks the seed when a sampled request sends none), so greedy choices
are equal and any seeded choice can be reproduced alone; `best_of` choices are generated and
the `n` with the highest sum of token logprobs are returned, best first. It also owns how the
choices share one prefill: the first choice (the leader) runs as any request does, and says
which decode worker holds its prompt once that worker streams (`Leader`); the others then
prefill there, where the prompt's full blocks are already cached and held by reference, so
each computes only the prompt's last partial block and samples its own first token. And it
merges the choices' streams into one, each message tagged with its choice's index.
Must not route or call workers: the service runs each choice as a request of its own.
"""

from __future__ import annotations

import queue
import secrets
import threading
from collections.abc import Callable, Iterator

from pdserve.core.errors import InvalidArgumentError
from pdserve.proto import api_pb2

MAX_CHOICES = 16  # n and best_of, each; every choice is a sequence on a worker
_INT64 = 2**64


def check(request: api_pb2.GenerateRequest) -> tuple[int, int]:
    """(n, best_of) of a request, validated (INVALID_ARGUMENT naming the field)."""
    n = request.n or 1
    if not 1 <= n <= MAX_CHOICES:
        raise InvalidArgumentError("n", f"must be in [1, {MAX_CHOICES}], got {request.n}")
    best_of = request.best_of or n
    if not n <= best_of <= MAX_CHOICES:
        raise InvalidArgumentError("best_of", f"must be in [n, {MAX_CHOICES}] (n = {n}), got "
                                   f"{request.best_of}")
    return n, best_of


def choice_requests(request: api_pb2.GenerateRequest, rid: str,
                    count: int) -> list[api_pb2.GenerateRequest]:
    """One single-choice request per choice: ids `rid.i`, seeds `seed + i` (wrapping within
    int64) when the request samples, and token logprobs kept when `best_of` ranks by them."""
    sampled = request.sampling.HasField("temperature") and request.sampling.temperature > 0
    seed = request.sampling.seed if request.sampling.HasField("seed") else secrets.randbits(62)
    rank = (request.best_of or 0) > (request.n or 1)
    out = []
    for i in range(count):
        r = api_pb2.GenerateRequest()
        r.CopyFrom(request)
        r.request_id = f"{rid}.{i}"
        r.n = 0
        r.best_of = 0
        if sampled:
            r.sampling.seed = (seed + i + 2**63) % _INT64 - 2**63
        if rank and not r.sampling.HasField("logprobs"):
            r.sampling.logprobs = 0
        out.append(r)
    return out


class Leader:
    """Where the first choice's prompt is decoded: published once (an address, or None when
    it will not be decoded anywhere the others could share), awaited by the other choices."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self.address: str | None = None

    def publish(self, address: str | None) -> None:
        if not self._done.is_set():
            self.address = address
            self._done.set()

    def wait(self, timeout_s: float) -> str | None:
        self._done.wait(timeout_s)
        return self.address


def merge(streams: list[Callable[[], Iterator[api_pb2.GenerateResponse]]]
          ) -> Iterator[tuple[int, api_pb2.GenerateResponse]]:
    """Run every stream on its own thread; yield (stream index, message) as they come. An
    exception in any stream is raised here (the others end when the call ends)."""
    q: queue.Queue = queue.Queue()
    done = object()

    def run(i: int, stream) -> None:
        try:
            for msg in stream():
                q.put((i, msg))
        except BaseException as e:  # re-raised in the caller's thread, gRPC's aborts included
            q.put((i, e))
            return
        q.put((i, done))

    threads = [threading.Thread(target=run, args=(i, s), daemon=True,
                                name=f"choice-{i}") for i, s in enumerate(streams)]
    for t in threads:
        t.start()
    live = len(threads)
    while live:
        i, item = q.get()
        if item is done:
            live -= 1
        elif isinstance(item, BaseException):
            raise item
        else:
            yield i, item


def serve(streams: list[Callable[[], Iterator[api_pb2.GenerateResponse]]], rid: str, n: int,
          keep_logprobs: bool) -> Iterator[api_pb2.GenerateResponse]:
    """The request's stream: every choice's messages, tagged with its index, as they come; or,
    with more streams than `n` (best_of), the best n once all are done, re-indexed by rank
    (their logprobs dropped unless the client asked for them)."""
    if len(streams) == n:
        for i, msg in merge(streams):
            msg.request_id, msg.index = rid, i
            yield msg
        return
    got: dict[int, list[api_pb2.GenerateResponse]] = {i: [] for i in range(len(streams))}
    for i, msg in merge(streams):
        got[i].append(msg)
    for rank, i in enumerate(ranked(got, n)):
        for msg in got[i]:
            msg.request_id, msg.index = rid, rank
            if not keep_logprobs:
                del msg.logprobs[:]
            yield msg


def ranked(messages: dict[int, list[api_pb2.GenerateResponse]], n: int) -> list[int]:
    """The n choices with the highest sum of their tokens' logprobs, best first (ties: the
    lower index)."""
    def score(i: int) -> float:
        return sum(lp.logprob for m in messages[i] for lp in m.logprobs)
    return sorted(messages, key=lambda i: (-score(i), i))[:n]
