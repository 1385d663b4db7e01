"""Workload traces for the simulator: the Mooncake JSONL, the Azure LLM inference CSV, and
synthetic Poisson or gamma arrivals, with the transforms a capacity planner needs.

Owns `SimRequest` and the readers and transforms: rate scaling (time compression), length
scaling, tiling in time to a target duration and overlaying copies of a trace (each with its
own prefix namespace, at a seeded offset) to load a larger cluster (`for_cluster`), held as
columns that make each request when it is read (`TiledTrace`; `OwnIdsTrace` for generated
requests with prefixes of their own). Must not
know about workers or policies; randomness comes from the `seed` given.

Prefixes: `SimRequest.block_hashes` holds one id per `HASH_BLOCK_TOKENS` (512) prompt tokens,
equal ids meaning an equal prefix (the Mooncake trace's `hash_ids`). Azure and synthetic
requests get ids of their own (no shared prefix).
"""

from __future__ import annotations

import csv
import json
import math
import random
from abc import abstractmethod
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path

from pdserve.core.errors import ConfigError

HASH_BLOCK_TOKENS = 512


class TraceError(ConfigError):
    """A trace or trace spec that cannot be read; the message names the field or line."""


@dataclass(frozen=True, slots=True)
class SimRequest:
    request_id: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    block_hashes: tuple[int, ...] = ()


def _blocks_for(tokens: int) -> int:
    return -(-tokens // HASH_BLOCK_TOKENS)


def read_mooncake(path: str | Path) -> list[SimRequest]:
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
                out.append(SimRequest(f"r{n - 1}", float(r["timestamp"]) / 1000.0,
                                      int(r["input_length"]), int(r["output_length"]),
                                      tuple(int(h) for h in r.get("hash_ids", ()))))
            except (ValueError, KeyError, TypeError) as e:
                raise TraceError(f"{path}:{n}: need timestamp, input_length, output_length "
                                 f"(and hash_ids): {e}") from None
    return out


def _parse_time(text: str) -> datetime:
    date, _, frac = text.strip().partition(".")
    return datetime.fromisoformat(f"{date}.{(frac + '000000')[:6]}" if frac else date)


def read_azure(path: str | Path) -> list[SimRequest]:
    out: list[SimRequest] = []
    first = None
    next_id = 0
    with open(path, newline="") as f:
        rows = csv.DictReader(f)
        for n, row in enumerate(rows, 2):
            try:
                t = _parse_time(row["TIMESTAMP"])
                prompt, gen = int(row["ContextTokens"]), int(row["GeneratedTokens"])
            except (ValueError, KeyError, TypeError) as e:
                raise TraceError(f"{path}:{n}: need TIMESTAMP, ContextTokens, GeneratedTokens: "
                                 f"{e}") from None
            first = first or t
            k = _blocks_for(prompt)
            out.append(SimRequest(f"r{n - 2}", (t - first).total_seconds(), prompt, max(1, gen),
                                  tuple(range(next_id, next_id + k))))
            next_id += k
    return out


def _spec_fields(spec: str) -> tuple[str, dict[str, float]]:
    parts = spec.split(":")
    if len(parts) < 2 or parts[0] != "synthetic" or parts[1] not in ("poisson", "gamma"):
        raise TraceError(f"trace spec {spec!r}: expected synthetic:poisson:k=v,... or "
                         "synthetic:gamma:k=v,...")
    fields: dict[str, float] = {}
    for item in filter(None, ",".join(parts[2:]).split(",")):
        key, eq, value = item.partition("=")
        try:
            fields[key.strip()] = float(value)
        except ValueError:
            raise TraceError(f"trace spec {spec!r}: field {key!r} needs a number") from None
        if not eq:
            raise TraceError(f"trace spec {spec!r}: field {key!r} needs =value")
    known = {"rate", "n", "in", "out", "cv", "fixed"}
    for key in fields:
        if key not in known:
            raise TraceError(f"trace spec {spec!r}: unknown field {key!r} "
                             f"(known: {', '.join(sorted(known))})")
    return parts[1], fields


def synthetic(spec: str, seed: int = 0) -> list[SimRequest]:
    """`synthetic:poisson:rate=R,n=N,in=MEAN,out=MEAN` or `synthetic:gamma:cv=C,...`: arrivals
    at R per second (gamma inter-arrivals with coefficient of variation C: bursty above 1),
    prompt and output lengths exponential around their means (`fixed=1`: exactly the means)."""
    kind, f = _spec_fields(spec)
    rate, n = f.get("rate", 1.0), int(f.get("n", 100))
    mean_in, mean_out, cv = f.get("in", 512.0), f.get("out", 128.0), f.get("cv", 1.0)
    for key, value in (("rate", rate), ("n", n), ("in", mean_in), ("out", mean_out), ("cv", cv)):
        if not value > 0:
            raise TraceError(f"trace spec {spec!r}: {key} must be > 0")
    rng = random.Random(seed)
    shape = 1.0 / (cv * cv) if kind == "gamma" else 1.0

    def length(mean: float) -> int:
        return int(mean) if f.get("fixed") else max(1, round(rng.expovariate(1.0 / mean)))

    out, t, next_id = [], 0.0, 0
    for i in range(n):
        t += rng.gammavariate(shape, 1.0 / (rate * shape))
        prompt, gen = length(mean_in), length(mean_out)
        k = _blocks_for(prompt)
        out.append(SimRequest(f"r{i}", t, prompt, gen, tuple(range(next_id, next_id + k))))
        next_id += k
    return out


def scale(requests: list[SimRequest], *, rate: float = 1.0, lengths: float = 1.0
          ) -> list[SimRequest]:
    """Arrivals `rate` times as fast (times divided by it); prompt and output lengths times
    `lengths` (at least one token; prefix ids kept, trimmed to the new prompt)."""
    if not rate > 0 or not lengths > 0:
        raise TraceError(f"rate and lengths scale must be > 0, got {rate}, {lengths}")
    out = []
    for r in requests:
        p = max(1, round(r.prompt_tokens * lengths)) if lengths != 1 else r.prompt_tokens
        o = max(1, round(r.output_tokens * lengths)) if lengths != 1 else r.output_tokens
        out.append(replace(r, arrival_s=r.arrival_s / rate, prompt_tokens=p, output_tokens=o,
                           block_hashes=r.block_hashes[:_blocks_for(p)]))
    return out


class _ColumnTrace(Sequence[SimRequest]):
    """Requests held as columns and made when read: a subclass gives `__len__` and `_make(i)`."""

    @abstractmethod
    def _make(self, i: int) -> SimRequest:
        """Request i, made from the columns."""

    def __getitem__(self, key):  # type: ignore[override]
        if isinstance(key, slice):
            return [self._make(i) for i in range(*key.indices(len(self)))]
        if key < 0:
            key += len(self)
        if not 0 <= key < len(self):
            raise IndexError(f"{type(self).__name__} index out of range")
        return self._make(key)

    def __iter__(self) -> Iterator[SimRequest]:
        return (self._make(i) for i in range(len(self)))


class TiledTrace(_ColumnTrace):
    """What `tile` makes, held as columns: each request's arrival, the trace request it copies
    and which copy it is (16 bytes a request, where a `SimRequest` with its prefix ids takes
    about a kilobyte); a request is made when read (`[i]`, iteration). Arrivals, prompt and
    output lengths read as columns without making any (`columns`)."""

    def __init__(self, base: list[SimRequest], arrival_s: array, source: array, copy: array,
                 id_span: int, repeats: int, suffixed: bool) -> None:
        self.base, self.arrival_s, self.source, self.copy = base, arrival_s, source, copy
        self.id_span, self.repeats, self.suffixed = id_span, repeats, suffixed

    def __len__(self) -> int:
        return len(self.arrival_s)

    def _make(self, i: int) -> SimRequest:
        r, slot = self.base[self.source[i]], self.copy[i]
        ns = slot * self.id_span
        c, k = divmod(slot, self.repeats)
        return SimRequest(f"{r.request_id}.{c}.{k}" if self.suffixed else r.request_id,
                          self.arrival_s[i], r.prompt_tokens, r.output_tokens,
                          tuple(h + ns for h in r.block_hashes))

    def columns(self) -> tuple[array, array, array]:
        """(arrival s, prompt tokens, output tokens) of every request, in order."""
        prompt = array("q", (r.prompt_tokens for r in self.base))
        output = array("q", (r.output_tokens for r in self.base))
        return (self.arrival_s, array("q", (prompt[j] for j in self.source)),
                array("q", (output[j] for j in self.source)))


class OwnIdsTrace(_ColumnTrace):
    """Requests whose prompts share no prefix, held as columns (arrival, prompt and output
    tokens, first prefix id: 32 bytes a request); request i is `r<i>`, its prefix ids
    consecutive from its first, one per `HASH_BLOCK_TOKENS` prompt tokens. Made when read."""

    def __init__(self) -> None:
        self.arrival_s, self.prompt, self.output, self.first_id = (
            array("d"), array("q"), array("q"), array("q"))

    def append(self, arrival_s: float, prompt_tokens: int, output_tokens: int,
               first_id: int) -> None:
        self.arrival_s.append(arrival_s)
        self.prompt.append(prompt_tokens)
        self.output.append(output_tokens)
        self.first_id.append(first_id)

    def __len__(self) -> int:
        return len(self.arrival_s)

    def _make(self, i: int) -> SimRequest:
        p, first = self.prompt[i], self.first_id[i]
        return SimRequest(f"r{i}", self.arrival_s[i], p, self.output[i],
                          tuple(range(first, first + _blocks_for(p))))

    def __eq__(self, other) -> bool:
        if not isinstance(other, OwnIdsTrace):
            return NotImplemented
        return (self.arrival_s, self.prompt, self.output, self.first_id) == (
            other.arrival_s, other.prompt, other.output, other.first_id)

    def columns(self) -> tuple[array, array, array]:
        return self.arrival_s, self.prompt, self.output


def columns(requests: Sequence[SimRequest]) -> tuple[array, array, array]:
    """(arrival s, prompt tokens, output tokens) of `requests` as arrays."""
    if isinstance(requests, (TiledTrace, OwnIdsTrace)):
        return requests.columns()
    return (array("d", (r.arrival_s for r in requests)),
            array("q", (r.prompt_tokens for r in requests)),
            array("q", (r.output_tokens for r in requests)))


def tiled(requests: list[SimRequest], *, duration_s: float | None = None, copies: int = 1,
          seed: int = 0) -> TiledTrace:
    """`tile`'s requests as a `TiledTrace` (made when read)."""
    if not requests:
        return TiledTrace([], array("d"), array("l"), array("l"), 1, 1, False)
    if copies < 1:
        raise TraceError(f"copies must be >= 1, got {copies}")
    base = sorted(requests, key=lambda r: r.arrival_s)
    t0 = base[0].arrival_s
    span = base[-1].arrival_s - t0
    period = span + (span / max(1, len(base) - 1) if len(base) > 1 else 1.0)
    duration = float(duration_s) if duration_s is not None else period
    if not duration > 0:
        raise TraceError(f"duration_s must be > 0, got {duration_s}")
    id_span = 1 + max((h for r in base for h in r.block_hashes), default=0)
    rng = random.Random(seed)
    times, source, copy = array("d"), array("l"), array("l")
    repeats = max(1, math.ceil(duration / period))
    for c in range(copies):
        shift = 0.0 if c == 0 else rng.uniform(0.0, duration)
        for k in range(repeats):
            for i, r in enumerate(base):
                t = r.arrival_s - t0 + k * period
                if t >= duration:
                    break
                times.append((t + shift) % duration)
                source.append(i)
                copy.append(c * repeats + k)
    order = sorted(range(len(times)), key=times.__getitem__)  # stable: ties in making order
    return TiledTrace(base, array("d", (times[j] for j in order)),
                      array("l", (source[j] for j in order)), array("l", (copy[j] for j in order)),
                      id_span, repeats, (copies, repeats) != (1, 1))


def tile(requests: list[SimRequest], *, duration_s: float | None = None, copies: int = 1,
         seed: int = 0) -> list[SimRequest]:
    """Repeat the trace back to back until `duration_s` (its own span if None), then overlay
    `copies` of that, each shifted by a seeded offset (wrapping at the end) and given prefix
    ids of its own. Ordered by arrival."""
    return list(tiled(requests, duration_s=duration_s, copies=copies, seed=seed))


def for_cluster(requests: list[SimRequest], *, workers: int, workers_per_copy: int,
                duration_s: float, seed: int = 0) -> TiledTrace:
    """The trace's arrival rate scaled to a cluster of `workers`: one copy of the trace per
    `workers_per_copy` workers (the cluster size the trace's rate is taken to load), tiled to
    `duration_s`; its requests are made as they are read (`TiledTrace`)."""
    if workers < 1 or workers_per_copy < 1:
        raise TraceError("workers and workers_per_copy must be >= 1")
    return tiled(requests, duration_s=duration_s,
                 copies=max(1, round(workers / workers_per_copy)), seed=seed)


def load_trace(path_or_spec: str | Path, *, scale_rate: float = 1.0, scale_lengths: float = 1.0,
               limit: int | None = None, seed: int = 0, duration_s: float | None = None,
               copies: int = 1) -> Sequence[SimRequest]:
    """Read a trace (`.jsonl`: Mooncake; `.csv`: Azure; `synthetic:...`: generated), scale its
    rate and lengths, tile it if asked, and keep the first `limit` requests."""
    src = str(path_or_spec)
    if src.startswith("synthetic:"):
        reqs = synthetic(src, seed)
    elif src.endswith(".jsonl"):
        reqs = read_mooncake(src)
    elif src.endswith(".csv"):
        reqs = read_azure(src)
    else:
        raise TraceError(f"trace {src!r}: expected a .jsonl (Mooncake), a .csv (Azure) or a "
                         "synthetic:... spec")
    if scale_rate != 1 or scale_lengths != 1:
        reqs = scale(reqs, rate=scale_rate, lengths=scale_lengths)
    if duration_s is not None or copies != 1:
        reqs = tiled(list(reqs), duration_s=duration_s, copies=copies, seed=seed)
    if limit is not None:
        if limit < 0:
            raise TraceError(f"limit must be >= 0, got {limit}")
        reqs = list(reqs[:limit])
    return reqs
