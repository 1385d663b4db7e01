"""Routing policies as pure cores: a `RouteInput` in, a `RouteDecision` out; no I/O, no clock.

The controller's simulator runs these unchanged. A policy sees only the router's view of each
worker (`WorkerLoad`: requests and predicted prefill tokens in flight, how many of the prompt's
leading blocks the worker caches, what the worker last reported about its KV blocks and batch),
never sockets, stubs or the block index itself. Randomness comes from an injected
`random.Random`, so a seeded policy makes the same choices every run.

Policies:
- `RoundRobin`, `LeastLoaded` (fewest requests in flight), `PowerOfTwo` (two random workers, the
  less loaded of them; Mitzenmacher's power of two choices).
- `KvAware` (prefill): cost = overlap_weight x prefill cost + queue load, after NVIDIA Dynamo's
  KV router (`cost = overlap_score_weight x prefill_blocks + active_blocks`). The prefill cost
  counts the prompt tokens the worker must compute, plus `fetch_weight` x the tokens it would
  fetch from the shared store (cached there but not on the worker: read, not recomputed). The
  queue load is the predicted prefill work already in flight to the worker (the same units)
  plus `request_cost_tokens` per request in flight (the fixed per-request cost in token units).
  Defaults from this repo's CPU measurements (docs/benchmarks.md, bench route): fetching a block
  from the store costs about 0.2x computing it; a request's fixed cost about 50-60 tokens.
- `DecodeChooser` (decode): among workers whose reported free KV blocks fit the request, the one
  with the smallest running batch; if none fits, the one with the most free blocks.
- `choose_offload`: which decode worker, if any, prefills a prompt itself within the offload
  budget the controller gave it (FluidPD's prefill offload).

`KvAware.decide_sparse` and `DecodeChooser.decide_sparse` make the same choice as `decide`
from workers kept in `LoadOrder`s by the caller (plus, for KV-aware, the workers caching part
of the prompt), so a choice among a thousand workers does not score them all.
"""

from __future__ import annotations

import builtins
import math
import random
from bisect import bisect_right, insort
from dataclasses import dataclass, field, replace
from collections.abc import Sequence
from typing import Protocol

from pdserve.core.errors import NoWorkerError  # noqa: F401 - raised here, re-exported


# The records below are values: built for one choice and never changed (build a new one, or
# `dataclasses.replace`). Each spells out its `__init__`: one the dataclass decorator generates
# runs as interpreted Python even where this module is compiled, ten times the cost of the
# compiled one, and the simulator builds millions (so they are not `frozen`, which would
# forbid that `__init__`'s assignments; they hash by value all the same).


@dataclass(unsafe_hash=True)  # hashed by value, as when it was frozen
class WorkerLoad:
    """The router's view of one worker at the moment of a choice."""

    address: str
    in_flight: int  # requests the router has sent and not yet seen finish
    healthy: bool = True
    in_flight_tokens: float = 0  # predicted prefill work (token units) summed over in_flight
    cached_blocks: int = 0  # leading blocks of this prompt in the worker's own prefix cache
    # Last reported by the worker (GetStats); None before the first report.
    free_blocks: int | None = None
    running: int = 0  # requests in the worker's running batch
    waiting: int = 0  # requests queued for admission

    def __init__(self, address: str, in_flight: int, healthy: bool = True,
                 in_flight_tokens: float = 0, cached_blocks: int = 0,
                 free_blocks: int | None = None, running: int = 0, waiting: int = 0) -> None:
        self.address = address
        self.in_flight = in_flight
        self.healthy = healthy
        self.in_flight_tokens = in_flight_tokens
        self.cached_blocks = cached_blocks
        self.free_blocks = free_blocks
        self.running = running
        self.waiting = waiting


@dataclass(unsafe_hash=True)  # hashed by value, as when it was frozen
class RouteInput:
    """One request's routing question. Block counts are of full blocks of the reusable prompt
    (all tokens but the last: one token is always computed)."""

    workers: Sequence[WorkerLoad]  # a tuple, or a list the caller keeps current
    prompt_tokens: int = 0
    block_size_tokens: int = 16
    store_cached_blocks: int = 0  # leading blocks of this prompt in the shared store
    need_blocks: int = 0  # KV blocks the request will hold on a decode worker

    def __init__(self, workers: Sequence[WorkerLoad], prompt_tokens: int = 0,
                 block_size_tokens: int = 16, store_cached_blocks: int = 0,
                 need_blocks: int = 0) -> None:
        self.workers = workers
        self.prompt_tokens = prompt_tokens
        self.block_size_tokens = block_size_tokens
        self.store_cached_blocks = store_cached_blocks
        self.need_blocks = need_blocks


@dataclass(unsafe_hash=True)  # hashed by value, as when it was frozen
class WorkerScore:
    """Why a worker got its cost (KV-aware): for logs and tests."""

    index: int
    local_blocks: int  # reused from the worker's own cache
    fetch_blocks: int  # fetched from the store
    compute_tokens: int  # prompt tokens to compute
    work_tokens: float  # compute + fetch_weight x fetched tokens
    load_tokens: float  # queue load in token units
    cost: float

    def __init__(self, index: int, local_blocks: int, fetch_blocks: int, compute_tokens: int,
                 work_tokens: float, load_tokens: float, cost: float) -> None:
        self.index = index
        self.local_blocks = local_blocks
        self.fetch_blocks = fetch_blocks
        self.compute_tokens = compute_tokens
        self.work_tokens = work_tokens
        self.load_tokens = load_tokens
        self.cost = cost


@dataclass(unsafe_hash=True)  # hashed by value, as when it was frozen
class RouteDecision:
    index: int
    scores: tuple[WorkerScore, ...] = ()  # KV-aware only, one per healthy worker
    # KV-aware: the chosen worker's predicted prefill work in token units (compute plus
    # fetch_weight x fetched tokens); the pool adds it to the worker's in-flight tokens.
    work_tokens: float | None = None
    fits: bool | None = None  # decode only: the chosen worker reported room for the request

    def __init__(self, index: int, scores: tuple[WorkerScore, ...] = (),
                 work_tokens: float | None = None, fits: bool | None = None) -> None:
        self.index = index
        self.scores = scores
        self.work_tokens = work_tokens
        self.fits = fits


def _live(workers) -> list[int]:
    live = [i for i, w in enumerate(workers) if w.healthy]
    if not live:
        raise NoWorkerError("no healthy worker")
    return live


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, workers: list[WorkerLoad]) -> int:
        live = _live(workers)
        pick = live[self._next % len(live)]
        self._next += 1
        return pick

    def decide(self, inp: RouteInput) -> RouteDecision:
        return RouteDecision(self.choose(list(inp.workers)))


class LeastLoaded:
    """Fewest requests in flight; ties go to the lowest index, so the choice is deterministic."""

    name = "least_loaded"

    def choose(self, workers: list[WorkerLoad]) -> int:
        return min((workers[i].in_flight, i) for i in _live(workers))[1]

    def decide(self, inp: RouteInput) -> RouteDecision:
        return RouteDecision(self.choose(list(inp.workers)))


class PowerOfTwo:
    """Two distinct healthy workers drawn at random; the one with fewer requests in flight
    (then fewer tokens in flight; then the first drawn)."""

    name = "power_of_two"

    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng if rng is not None else random.Random(0)

    def choose(self, workers: list[WorkerLoad]) -> int:
        live = _live(workers)
        if len(live) == 1:
            return live[0]
        a, b = self.rng.sample(live, 2)
        key = lambda i: (workers[i].in_flight, workers[i].in_flight_tokens)  # noqa: E731
        return b if key(b) < key(a) else a

    def decide(self, inp: RouteInput) -> RouteDecision:
        return RouteDecision(self.choose(list(inp.workers)))


def prefill_parts(inp: RouteInput, w: WorkerLoad) -> tuple[int, int, int]:
    """(local blocks, fetched blocks, tokens to compute) of the prompt on worker `w`."""
    return _parts(inp, w.cached_blocks)


def _parts(inp: RouteInput, cached_blocks: int) -> tuple[int, int, int]:
    bs = inp.block_size_tokens
    reusable = max(0, inp.prompt_tokens - 1) // bs
    local = min(cached_blocks, reusable)
    fetch = max(0, min(inp.store_cached_blocks, reusable) - local)
    return local, fetch, inp.prompt_tokens - (local + fetch) * bs


@dataclass
class KvAware:
    """Lowest cost = overlap_weight x (compute + fetch_weight x fetch tokens) + queue load.

    `temperature` > 0 samples from softmax(-cost / (temperature x mean |cost|)) with `rng`
    instead of taking the minimum (Dynamo's router temperature); 0 is deterministic, ties going
    to fewer requests in flight, then the lowest index.
    """

    overlap_weight: float = 1.0
    fetch_weight: float = 0.2
    request_cost_tokens: float = 64.0
    temperature: float = 0.0
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    name = "kv_aware"  # (a class attribute: not a field)

    def __post_init__(self) -> None:
        for f in ("overlap_weight", "fetch_weight", "request_cost_tokens", "temperature"):
            if getattr(self, f) < 0:
                raise ValueError(f"{f} must be >= 0, got {getattr(self, f)}")

    def load_of(self, w: WorkerLoad) -> float:
        """A worker's queue load in token units (the `LoadOrder` key's first part)."""
        return w.in_flight_tokens + self.request_cost_tokens * w.in_flight

    def _score_one(self, inp: RouteInput, i: int, w: WorkerLoad,
                   cached_blocks: int | None = None) -> WorkerScore:
        local, fetch, compute = _parts(
            inp, w.cached_blocks if cached_blocks is None else cached_blocks)
        load = self.load_of(w)
        work = compute + self.fetch_weight * fetch * inp.block_size_tokens
        return WorkerScore(i, local, fetch, compute, work, load,
                           self.overlap_weight * work + load)

    def _score_holders(self, inp: RouteInput, cached: dict[int, int]
                       ) -> tuple[list[WorkerScore], set[int]]:
        """(scores, indices) of the healthy workers caching part of the prompt: their indices,
        and the score of the cheapest of them per cached-block count (by cost, requests in
        flight, index, as `decide` ranks), the only one of its count that can win. The parts
        and work depend only on the count, so they are computed once per count (many workers
        often hold the same shared prefix) and a score is made only for a count's best."""
        workers, ow, rc = inp.workers, self.overlap_weight, self.request_cost_tokens
        parts_of: dict[int, tuple[int, int, int, float]] = {}
        weighted: dict[int, float] = {}  # count -> overlap_weight x work
        best: dict[int, list] = {}  # count -> [cost, in flight, index, load] of its cheapest
        held: set[int] = set()
        for i, c in cached.items():
            w = workers[i]
            if c <= 0 or not w.healthy:
                continue
            held.add(i)
            base = weighted.get(c)
            if base is None:
                local, fetch, compute = _parts(inp, c)
                work = compute + self.fetch_weight * fetch * inp.block_size_tokens
                parts_of[c] = (local, fetch, compute, work)
                base = weighted[c] = ow * work
            n = w.in_flight
            load = w.in_flight_tokens + rc * n  # `load_of`
            cost = base + load
            b = best.get(c)
            # Ranked by (cost, in flight, index); the indices come in no set order.
            if b is None or cost < b[0] or (cost == b[0] and (n, i) < (b[1], b[2])):
                best[c] = [cost, n, i, load]
        out = []
        for c, (cost, _, i, load) in best.items():
            local, fetch, compute, work = parts_of[c]
            out.append(WorkerScore(i, local, fetch, compute, work, load, cost))
        return out, held

    def score(self, inp: RouteInput) -> tuple[WorkerScore, ...]:
        return tuple(self._score_one(inp, i, inp.workers[i]) for i in _live(inp.workers))

    def decide_sparse(self, inp: RouteInput, cached: dict[int, int],
                      order: LoadOrder) -> RouteDecision:
        """The same choice as `decide` on `inp` with `cached_blocks` set from `cached`
        (worker index -> its cached leading blocks; absent means none), without scoring every
        worker: a worker caching nothing differs from the others caching nothing only in its
        load, so only the cheapest of them by `order` (healthy workers keyed by `load_of` and
        requests in flight, kept current by the caller) can win. Work: the holders plus a
        search of the order. `scores` holds only the candidates: per count of cached blocks
        the cheapest holder, and that one."""
        if self.temperature > 0:  # sampling weighs every worker
            workers = list(inp.workers)
            for i, c in cached.items():
                workers[i] = replace(workers[i], cached_blocks=c)
            return self.decide(replace(inp, workers=tuple(workers)))
        cands, skip = self._score_holders(inp, cached)
        _, fetch0, compute0 = _parts(inp, 0)
        cost0 = self.overlap_weight * (compute0 + self.fetch_weight * fetch0
                                       * inp.block_size_tokens)
        other = order.cheapest(lambda load: cost0 + load, skip)
        if other is not None:
            cands.append(self._score_one(inp, other, inp.workers[other], 0))
        if not cands:
            raise NoWorkerError("no healthy worker")
        best = min(cands, key=lambda s: (s.cost, inp.workers[s.index].in_flight, s.index))
        return RouteDecision(best.index, tuple(sorted(cands, key=lambda s: s.index)),
                             best.work_tokens)

    def decide(self, inp: RouteInput) -> RouteDecision:
        scores = self.score(inp)
        if self.temperature > 0 and len(scores) > 1:
            best = self._sample(scores)
        else:
            best = min(scores, key=lambda s: (s.cost, inp.workers[s.index].in_flight, s.index))
        return RouteDecision(best.index, scores, best.work_tokens)

    def _sample(self, scores: tuple[WorkerScore, ...]) -> WorkerScore:
        scale = self.temperature * max(1e-9, sum(abs(s.cost) for s in scores) / len(scores))
        low = min(s.cost for s in scores)
        weights = [math.exp(-(s.cost - low) / scale) for s in scores]
        return self.rng.choices(scores, weights=weights)[0]


class LoadOrder:
    """Worker indices kept sorted by a two-part key and the index: (queue load, requests in
    flight) for `KvAware.decide_sparse`, `DecodeChooser.by_batch` / `by_free` for
    `DecodeChooser.decide_sparse`. The caller sets a worker's key whenever it changes and
    discards a worker that stops being a healthy candidate."""

    def __init__(self) -> None:
        self._keys: list[tuple[float, float, int]] = []
        self._of: dict[int, tuple[float, float, int]] = {}

    def __len__(self) -> int:
        return len(self._keys)

    def set(self, index: int, load: float, in_flight: float) -> None:
        key = (load, in_flight, index)
        old = self._of.get(index)
        if old == key:
            return
        if old is not None:
            self._remove(old)
        self._of[index] = key
        insort(self._keys, key)

    def discard(self, index: int) -> None:
        old = self._of.pop(index, None)
        if old is not None:
            self._remove(old)

    def _remove(self, key: tuple[float, float, int]) -> None:
        del self._keys[bisect_right(self._keys, key) - 1]

    def first(self) -> int | None:
        return self._keys[0][2] if self._keys else None

    def __iter__(self):
        return (key[2] for key in self._keys)

    def cheapest(self, cost_of, skip: builtins.set[int]) -> int | None:
        """The index with the least (cost_of(load), in flight, index), not in `skip`;
        `cost_of` must not decrease as load grows. Within one load value the order's first is
        that value's best; the next values are tried only while their cost can still tie
        (rounding can make two loads cost the same)."""
        keys, pos, best = self._keys, 0, None
        while pos < len(keys):
            load, in_flight, i = keys[pos]
            if i in skip:
                pos += 1
                continue
            c = cost_of(load)
            if best is not None and c > best[0]:
                break
            if best is None or (c, in_flight, i) < best:
                best = (c, in_flight, i)
            pos = bisect_right(keys, (load, math.inf, math.inf), pos)
        return None if best is None else best[2]


class DecodeChooser:
    """Decode workers by free KV blocks and running batch (both as last reported).

    A worker fits when its reported free blocks cover `need_blocks`; among those that fit, the
    smallest batch wins (running + waiting as reported, or the router's own requests in flight
    if more: a report is up to one poll old), then the most free blocks, then the lowest index.
    If none fits (or nothing was reported yet), the worker with the most free blocks is taken
    (unknown counts as zero) with the same tie-breaks: it queues the request rather than fail.
    """

    name = "free_kv"

    def decide(self, inp: RouteInput) -> RouteDecision:
        live = _live(inp.workers)

        def batch(i: int) -> int:
            w = inp.workers[i]
            return max(w.running + w.waiting, w.in_flight)

        def free(i: int) -> int:
            return inp.workers[i].free_blocks or 0

        fits = [i for i in live if inp.workers[i].free_blocks is not None
                and free(i) >= inp.need_blocks]
        if fits:
            return RouteDecision(min(fits, key=lambda i: (batch(i), -free(i), i)), fits=True)
        return RouteDecision(min(live, key=lambda i: (-free(i), batch(i), i)), fits=False)

    @staticmethod
    def by_batch(w: WorkerLoad) -> tuple[int, int]:
        """A worker's key in the batch order `decide_sparse` reads (then its index)."""
        return max(w.running + w.waiting, w.in_flight), -(w.free_blocks or 0)

    @staticmethod
    def by_free(w: WorkerLoad) -> tuple[int, int]:
        """A worker's key in the free-blocks order `decide_sparse` reads (then its index)."""
        return -(w.free_blocks or 0), max(w.running + w.waiting, w.in_flight)

    def decide_sparse(self, inp: RouteInput, batch_order: LoadOrder,
                      free_order: LoadOrder) -> RouteDecision:
        """The same choice as `decide`, from the healthy workers kept in two orders (by
        `by_batch` and by `by_free`, index last) instead of a pass over all: if the worker with
        the most free blocks cannot fit the request, none can and it is the choice; otherwise
        the first in batch order that fits."""
        top = free_order.first()
        if top is None:
            raise NoWorkerError("no healthy worker")
        if (inp.workers[top].free_blocks or 0) >= inp.need_blocks:  # some worker may fit
            for i in batch_order:
                w = inp.workers[i]
                if w.free_blocks is not None and w.free_blocks >= inp.need_blocks:
                    return RouteDecision(i, fits=True)
        return RouteDecision(top, fits=False)


class OffloadSlot(Protocol):
    """What `choose_offload` reads of a decode worker (`membership.Member` has it)."""

    address: str
    offload_tokens: int  # prompt tokens of offloaded requests in flight to it
    offload_budget: int  # the most it may hold (the controller's budget)


def choose_offload(candidates: Sequence[OffloadSlot], prompt_tokens: int) -> int | None:
    """The index of the decode worker to prefill a `prompt_tokens` prompt locally, or None.

    A candidate fits when its offload tokens in flight plus this prompt stay within its
    budget. Among those that fit, the most budget left wins (it spreads offloaded work over
    the idle workers instead of filling one), ties going to the lowest address (deterministic).
    None when nothing fits: the request takes the normal prefill path.
    """
    fits = [i for i, c in enumerate(candidates)
            if c.offload_budget > 0 and c.offload_tokens + prompt_tokens <= c.offload_budget]
    if not fits:
        return None
    return min(fits, key=lambda i: (-(candidates[i].offload_budget - candidates[i].offload_tokens),
                                    candidates[i].address))


PREFILL_POLICIES = ("round_robin", "least_loaded", "power_of_two", "kv_aware")
DECODE_POLICIES = ("free_kv", "least_loaded", "round_robin", "power_of_two")


def make_policy(name: str, *, seed: int = 0, overlap_weight: float = 1.0,
                fetch_weight: float = 0.2, request_cost_tokens: float = 64.0):
    """A fresh policy by name (see PREFILL_POLICIES / DECODE_POLICIES)."""
    if name == "round_robin":
        return RoundRobin()
    if name == "least_loaded":
        return LeastLoaded()
    if name == "power_of_two":
        return PowerOfTwo(random.Random(seed))
    if name == "kv_aware":
        return KvAware(overlap_weight, fetch_weight, request_cost_tokens, rng=random.Random(seed))
    if name == "free_kv":
        return DecodeChooser()
    raise ValueError(f"unknown routing policy {name!r}; choose from "
                     f"{sorted(set(PREFILL_POLICIES) | set(DECODE_POLICIES))}")


POLICIES = {"round_robin": RoundRobin, "least_loaded": LeastLoaded, "power_of_two": PowerOfTwo,
            "kv_aware": KvAware, "free_kv": DecodeChooser}
