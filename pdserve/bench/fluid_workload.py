"""The phase-shifting workload of `pdserve bench fluid`, and the figures computed from a run.

Owns turning the shared traces into requests (pure: seeded, no I/O beyond reading the traces)
and the per-phase figures (TTFT/ITL percentiles, SLO attainment, goodput). Phase "prefill":
prompt and answer lengths from the Azure code trace (long prompts, short answers); phase
"decode": from the Mooncake conversation trace with prompts scaled far down and answers kept
long (short prompts, long answers). Arrivals are Poisson at a fixed rate per phase (open loop),
the same for every configuration of a run. Must not start processes or send requests.
"""

from __future__ import annotations

import csv
import json
import math
import os
import random
from dataclasses import dataclass
from typing import Any

AZURE = "AzureLLMInferenceTrace_code.csv"
MOONCAKE = "mooncake_conversation_trace.jsonl"


@dataclass(frozen=True)
class Request:
    phase: str  # "prefill" or "decode"
    arrival_s: float
    prompt: tuple[int, ...]
    max_tokens: int


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


def _lengths(path: str) -> list[tuple[int, int]]:
    """(prompt tokens, output tokens) per record of the Azure CSV or the Mooncake JSONL."""
    if path.endswith(".csv"):
        with open(path, newline="") as f:
            return [(int(r["ContextTokens"]), int(r["GeneratedTokens"]))
                    for r in csv.DictReader(f)]
    with open(path) as f:
        return [(r["input_length"], r["output_length"])
                for r in (json.loads(line) for line in f if line.strip())]


def _clip(x: float, lo: int, hi: int) -> int:
    return max(lo, min(hi, int(round(x))))


def make_workload(folder: str, shape: Shape, *, phase_s: float, prefill_rps: float,
                  decode_rps: float, vocab: tuple[int, int], seed: int) -> list[Request]:
    """Poisson arrivals, `phase_s` seconds of the prefill phase then as long of the decode
    phase; lengths drawn (seeded) from each trace; random token ids in [vocab)."""
    rng = random.Random(seed)
    azure = _lengths(os.path.join(folder, AZURE))
    moon = _lengths(os.path.join(folder, MOONCAKE))
    out: list[Request] = []
    for phase, start, rps, pool, ps, os_ in (
            ("prefill", 0.0, prefill_rps, azure, shape.prefill_prompt_scale,
             shape.prefill_output_scale),
            ("decode", phase_s, decode_rps, moon, shape.decode_prompt_scale,
             shape.decode_output_scale)):
        t = start + rng.expovariate(rps)
        while t < start + phase_s:
            n_in, n_out = pool[rng.randrange(len(pool))]
            n_in = _clip(n_in * ps, shape.min_prompt_tokens, shape.max_prompt_tokens)
            n_out = _clip(n_out * os_, shape.min_output_tokens, shape.max_output_tokens)
            prompt = tuple(rng.randrange(*vocab) for _ in range(n_in))
            out.append(Request(phase, t, prompt, n_out))
            t += rng.expovariate(rps)
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
