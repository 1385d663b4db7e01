"""The workloads of `pdserve bench fluid`, and the figures computed from a run.

Owns turning the shared traces into requests (pure: seeded, no I/O beyond reading the traces
through `serve_workload.read_trace`) and the per-phase figures (TTFT/ITL percentiles, SLO
attainment, goodput). Lengths: the Azure code trace (long prompts, short answers) scaled by
`Shape.prefill_*`, the Mooncake conversation trace (short prompts once scaled far down, long
answers) by `Shape.decode_*`; clipped to the shape's bounds and to the model's context.
Every workload labels its phases (`Phase`, each `phase_s` long) so a run reports attainment
per phase:
- `two-phase`: Poisson arrivals, a prefill-heavy phase (Azure lengths) then a decode-heavy one
  (Mooncake lengths);
- `bursty`: long answers (Mooncake) at a steady rate throughout, and in the middle phase a
  burst of long prompts (Azure) on top;
- `drift`: the share of Azure-shaped requests falls linearly from all to none over three
  phases, the rate moving from `prefill_rps` to `decode_rps`: the input/output ratio drifts;
- `trace`: a trace file (Azure CSV or Mooncake JSONL), arrivals divided by `speedup`, its
  first three phases' worth of time.
The same arrivals for every configuration of a run. Must not start processes or send requests.
"""

from __future__ import annotations

import functools
import math
import os
import random
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from pdserve.bench.serve_workload import WorkloadError, read_trace
from pdserve.sim.trace import HASH_BLOCK_TOKENS

AZURE = "AzureLLMInferenceTrace_code.csv"
MOONCAKE = "mooncake_conversation_trace.jsonl"
WORKLOADS = ("two-phase", "bursty", "drift", "trace")


@dataclass(frozen=True)
class Request:
    phase: str  # the `Phase.name` its arrival falls in
    arrival_s: float
    prompt: tuple[int, ...]
    max_tokens: int


@dataclass(frozen=True)
class Phase:
    name: str
    start_s: float
    end_s: float


@dataclass(frozen=True)
class Workload:
    kind: str
    requests: tuple[Request, ...]
    phases: tuple[Phase, ...]
    # Where a decode-heavy stretch follows a prefill-heavy one: the flip-back delay is counted
    # from here. None: the workload has no such edge.
    decode_from_s: float | None

    @property
    def duration_s(self) -> float:
        return self.phases[-1].end_s


@dataclass(frozen=True)
class Shape:
    """How trace lengths become this machine's lengths (each factor is reported)."""

    prefill_prompt_scale: float = 0.25  # Azure ContextTokens x this
    prefill_output_scale: float = 1.0  # Azure GeneratedTokens x this
    decode_prompt_scale: float = 1 / 64  # Mooncake input_length x this
    decode_output_scale: float = 0.5  # Mooncake output_length x this
    max_prompt_tokens: int = 1024
    min_prompt_tokens: int = 16
    max_output_tokens: int = 256
    min_output_tokens: int = 2


def traces_dir() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    for up in (3, 4):
        d = os.path.join(here, *[".."] * up, "shared", "traces")
        if os.path.isdir(d):
            return os.path.normpath(d)
    return os.environ.get("PDSERVE_TRACES", "")


@functools.lru_cache(maxsize=4)
def _lengths(path: str) -> tuple[tuple[int, int], ...]:
    """(prompt tokens, output tokens) per record, in timestamp order (each file read once)."""
    return tuple((r.input_length, r.output_length) for r in read_trace(path, sys.maxsize))


def _clip(x: float, lo: int, hi: int) -> int:
    return max(lo, min(hi, int(round(x))))


@dataclass(frozen=True)
class _Lengths:
    """One trace's (prompt, output) pool and the factors that bring it to this machine."""

    pool: tuple[tuple[int, int], ...]
    prompt_scale: float
    output_scale: float


def scale_lengths(n_in: int, n_out: int, prompt_scale: float, output_scale: float,
                  shape: Shape, context_tokens: int | None) -> tuple[int, int]:
    """A trace record's lengths scaled and clipped: the answer to the shape's bounds, the
    prompt to the shape's bounds and to what the model's context leaves beside the answer."""
    out = _clip(n_out * output_scale, shape.min_output_tokens, shape.max_output_tokens)
    hi = shape.max_prompt_tokens if context_tokens is None else min(
        shape.max_prompt_tokens, context_tokens - out)
    return _clip(n_in * prompt_scale, min(shape.min_prompt_tokens, hi), hi), out


class _Maker:
    """Draws requests (seeded): lengths from a pool, random token ids in `vocab`."""

    def __init__(self, shape: Shape, vocab: tuple[int, int], seed: int,
                 context_tokens: int | None) -> None:
        if context_tokens is not None and context_tokens <= shape.min_output_tokens:
            raise WorkloadError(f"context_tokens {context_tokens} leaves no room for a prompt")
        self.shape, self.vocab, self.context = shape, vocab, context_tokens
        self.rng = random.Random(seed)

    def request(self, phase: str, t: float, n_in: int, n_out: int, src: _Lengths) -> Request:
        n_in, n_out = scale_lengths(n_in, n_out, src.prompt_scale, src.output_scale,
                                    self.shape, self.context)
        return Request(phase, t, tuple(self.rng.randrange(*self.vocab) for _ in range(n_in)),
                       n_out)

    def draw(self, phase: str, t: float, src: _Lengths) -> Request:
        n_in, n_out = src.pool[self.rng.randrange(len(src.pool))]
        return self.request(phase, t, n_in, n_out, src)

    def poisson(self, start: float, end: float, rps: float) -> Iterator[float]:
        t = start + self.rng.expovariate(rps)
        while t < end:
            yield t
            t += self.rng.expovariate(rps)


def _phases(names: tuple[str, ...], phase_s: float) -> tuple[Phase, ...]:
    return tuple(Phase(n, i * phase_s, (i + 1) * phase_s) for i, n in enumerate(names))


def _label(phases: tuple[Phase, ...], t: float) -> str:
    return next((p.name for p in phases if t < p.end_s), phases[-1].name)


def _two_phase(m: _Maker, azure: _Lengths, moon: _Lengths, phase_s: float, prefill_rps: float,
               decode_rps: float) -> Workload:
    phases = _phases(("prefill", "decode"), phase_s)
    out = [m.draw(p.name, t, src) for p, rps, src in ((phases[0], prefill_rps, azure),
                                                        (phases[1], decode_rps, moon))
           for t in m.poisson(p.start_s, p.end_s, rps)]
    return Workload("two-phase", tuple(out), phases, phase_s)


def _bursty(m: _Maker, azure: _Lengths, moon: _Lengths, phase_s: float, prefill_rps: float,
            decode_rps: float) -> Workload:
    phases = _phases(("before", "burst", "after"), phase_s)
    steady = [m.draw(_label(phases, t), t, moon) for t in m.poisson(0.0, 3 * phase_s,
                                                                    decode_rps)]
    burst = [m.draw("burst", t, azure) for t in m.poisson(phase_s, 2 * phase_s, prefill_rps)]
    return Workload("bursty", tuple(sorted(steady + burst, key=lambda r: r.arrival_s)), phases,
                    2 * phase_s)


def _drift(m: _Maker, azure: _Lengths, moon: _Lengths, phase_s: float, prefill_rps: float,
           decode_rps: float) -> Workload:
    phases = _phases(("early", "middle", "late"), phase_s)
    span, top = 3 * phase_s, max(prefill_rps, decode_rps)
    out = []
    for t in m.poisson(0.0, span, top):  # thinned to the rate at t
        x = t / span
        if m.rng.random() * top < prefill_rps + (decode_rps - prefill_rps) * x:
            src = moon if m.rng.random() < x else azure
            out.append(m.draw(_label(phases, t), t, src))
    return Workload("drift", tuple(out), phases, None)


def _trace(m: _Maker, path: str, shape: Shape, phase_s: float, speedup: float) -> Workload:
    if not speedup > 0:
        raise WorkloadError(f"--speedup must be > 0, got {speedup}")
    csv_ = path.endswith(".csv")  # Azure's format; else Mooncake's
    src = _Lengths((), shape.prefill_prompt_scale if csv_ else shape.decode_prompt_scale,
                   shape.prefill_output_scale if csv_ else shape.decode_output_scale)
    phases = _phases(("early", "middle", "late"), phase_s)
    out = [m.request(_label(phases, r.arrival_s / speedup), r.arrival_s / speedup,
                     r.input_length, r.output_length, src)
           for r in read_trace(path, sys.maxsize) if r.arrival_s / speedup < 3 * phase_s]
    return Workload("trace", tuple(out), phases, None)


Builder = Callable[[_Maker, _Lengths, _Lengths, float, float, float], Workload]
_BUILDERS: dict[str, Builder] = {"two-phase": _two_phase, "bursty": _bursty, "drift": _drift}


def make_workload(folder: str, shape: Shape, *, phase_s: float, prefill_rps: float,
                  decode_rps: float, vocab: tuple[int, int], seed: int, kind: str = "two-phase",
                  trace_path: str = "", speedup: float = 1.0,
                  context_tokens: int | None = None) -> Workload:
    """The `kind` workload (see the module): `folder` holds the Azure and Mooncake traces the
    synthetic kinds draw lengths from; `trace_path` is the file `trace` replays."""
    if kind not in WORKLOADS:
        raise WorkloadError(f"--workload: choose from {', '.join(WORKLOADS)}, got {kind!r}")
    if not phase_s > 0:
        raise WorkloadError(f"--phase-s must be > 0, got {phase_s}")
    m = _Maker(shape, vocab, seed, context_tokens)
    if kind == "trace":
        if not trace_path:
            raise WorkloadError("--trace: the trace workload needs a trace file")
        return _trace(m, trace_path, shape, phase_s, speedup)
    for name, rps in (("--prefill-rps", prefill_rps), ("--decode-rps", decode_rps)):
        if not rps > 0:
            raise WorkloadError(f"{name} must be > 0, got {rps}")
    azure = _Lengths(_lengths(os.path.join(folder, AZURE)), shape.prefill_prompt_scale,
                     shape.prefill_output_scale)
    moon = _Lengths(_lengths(os.path.join(folder, MOONCAKE)), shape.decode_prompt_scale,
                    shape.decode_output_scale)
    return _BUILDERS[kind](m, azure, moon, phase_s, prefill_rps, decode_rps)


def mooncake_records(wl: Workload, block_tokens: int = HASH_BLOCK_TOKENS
                     ) -> list[dict[str, Any]]:
    """The workload's arrivals as Mooncake trace records (the format `pdserve sim` reads):
    timestamp in ms, prompt and answer lengths, and hash ids of `block_tokens` per id, each
    request's its own (the bench's prompts share no prefix)."""
    out, next_id = [], 0
    for r in wl.requests:
        n = -(-len(r.prompt) // block_tokens)
        out.append({"timestamp": round(r.arrival_s * 1000.0, 3), "input_length": len(r.prompt),
                    "output_length": r.max_tokens,
                    "hash_ids": list(range(next_id, next_id + n))})
        next_id += n
    return out


def percentile(xs: list[float], q: float) -> float | None:
    """Nearest-rank percentile, q in [0, 1]; None for no data."""
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def figures(rows: list[dict[str, Any]], ttft_slo_s: float, itl_slo_s: float,
            span_s: float) -> dict[str, Any]:
    """Figures of finished-or-failed request rows (ttft_s, tpot_s, error) over `span_s`."""
    ok = [r for r in rows if r["error"] is None]
    met = [r for r in ok if r["ttft_s"] <= ttft_slo_s and r["tpot_s"] <= itl_slo_s]
    ttft = [r["ttft_s"] for r in ok]
    tpot = [r["tpot_s"] for r in ok if r["output_tokens"] > 1]
    return {
        "requests": len(rows), "errors": len(rows) - len(ok),
        "ttft_p50_s": percentile(ttft, 0.5), "ttft_p90_s": percentile(ttft, 0.9),
        "itl_p50_s": percentile(tpot, 0.5), "itl_p90_s": percentile(tpot, 0.9),
        "slo_attainment": len(met) / len(rows) if rows else None,
        "goodput_rps": len(met) / span_s if span_s > 0 else None,
    }
