"""The requests `pdserve bench serve` sends: ShareGPT chats, or a trace replayed open loop.

Owns the workload as data: `Request`s with an OpenAI body (the same body for every server
measured, only `model` filled in per server) and an arrival time (None: closed loop, sent as
soon as a slot is free). ShareGPT: seeded first user turns as single-message chats. A trace
(the Azure code CSV or the Mooncake conversation JSONL of ../shared/traces): its first
requests in timestamp order, arrivals divided by `speedup`, prompt lengths divided by
`token_scale` and sent as token ids to `/v1/completions` (Mooncake blocks with equal hash ids
get equal tokens, so shared prefixes stay shared), output lengths capped at `max_tokens`.
Every request is greedy (temperature 0) with `ignore_eos`, so it makes exactly its tokens.
Must not send anything or read a clock.
"""

from __future__ import annotations

import csv
import json
import math
import random
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any


class WorkloadError(ValueError):
    """A workload setting or trace is unusable; the message names it."""


@dataclass(frozen=True)
class Request:
    path: str  # "/v1/chat/completions" or "/v1/completions"
    body: dict[str, Any] = field(hash=False)  # without "model"
    max_tokens: int = 0
    arrival_s: float | None = None  # open loop: seconds from the replay's start


def _body(max_tokens: int, **prompt: Any) -> dict[str, Any]:
    return {**prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}


def token_request(ids: list[int], max_tokens: int, arrival_s: float | None = None) -> Request:
    """A streaming completion of the prompt token ids `ids`."""
    return Request("/v1/completions", _body(max_tokens, prompt=list(ids)), max_tokens, arrival_s)


def sharegpt_requests(n: int, max_tokens: int, seed: int = 0, min_chars: int = 16,
                      max_chars: int = 1000) -> list[Request]:
    """`n` ShareGPT first user turns (seeded) as chat requests."""
    from pdserve.engine.prompts import load_sharegpt_prompts

    return [Request("/v1/chat/completions",
                    _body(max_tokens, messages=[{"role": "user", "content": p}]), max_tokens)
            for p in load_sharegpt_prompts(n, seed=seed, min_chars=min_chars,
                                           max_chars=max_chars)]


@dataclass(frozen=True)
class TraceRow:
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...] = ()


def read_trace(path: str, limit: int) -> list[TraceRow]:
    """The first `limit` rows in timestamp order, arrivals from the first. CSV: Azure's
    TIMESTAMP, ContextTokens, GeneratedTokens; JSONL: Mooncake's timestamp (ms),
    input_length, output_length, hash_ids."""
    rows: list[TraceRow] = []
    try:
        with open(path, encoding="utf-8", newline="") as f:
            if path.endswith(".csv"):
                for i, r in enumerate(csv.DictReader(f), 2):
                    try:
                        t = datetime.fromisoformat(r["TIMESTAMP"].strip()[:26]).timestamp()
                        rows.append(TraceRow(t, int(r["ContextTokens"]),
                                             int(r["GeneratedTokens"])))
                    except (KeyError, ValueError, TypeError, AttributeError) as e:
                        raise WorkloadError(f"--trace {path}:{i}: not an Azure trace row "
                                            f"({e})") from None
            else:
                for i, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        r = json.loads(line)
                        rows.append(TraceRow(float(r["timestamp"]) / 1000.0,
                                             int(r["input_length"]), int(r["output_length"]),
                                             tuple(int(h) for h in r.get("hash_ids", ()))))
                    except (KeyError, ValueError, TypeError) as e:
                        raise WorkloadError(f"--trace {path}:{i}: not a Mooncake trace record "
                                            f"({e})") from None
    except OSError as e:
        raise WorkloadError(f"--trace: cannot read {path}: {e.strerror}") from None
    if not rows:
        raise WorkloadError(f"--trace {path}: no records")
    rows.sort(key=lambda r: r.arrival_s)
    rows = rows[:limit]
    t0 = rows[0].arrival_s
    return [TraceRow(r.arrival_s - t0, r.input_length, r.output_length, r.hash_ids)
            for r in rows]


TRACE_BLOCK_TOKENS = 512  # Mooncake: one hash id per 512-token prefix block


def trace_requests(path: str, n: int, max_tokens: int, *, token_scale: int, speedup: float,
                   vocab: tuple[int, int], max_prompt_tokens: int, seed: int = 0
                   ) -> list[Request]:
    """The trace's first `n` requests as completions of token-id prompts, open loop."""
    if token_scale < 1 or TRACE_BLOCK_TOKENS % token_scale:
        raise WorkloadError(f"--token-scale must divide {TRACE_BLOCK_TOKENS}, got {token_scale}")
    if not speedup > 0:
        raise WorkloadError(f"--speedup must be > 0, got {speedup}")
    lo, hi = vocab
    if hi - lo < 2:
        raise WorkloadError(f"vocabulary range {vocab} too small for random prompts")
    blocks: dict[int, list[int]] = {}

    def block(h: int) -> list[int]:
        if h not in blocks:
            rng = random.Random(f"pdserve-bench-serve:{seed}:{h}")
            blocks[h] = [rng.randrange(lo, hi) for _ in range(TRACE_BLOCK_TOKENS // token_scale)]
        return blocks[h]

    out = []
    for i, r in enumerate(read_trace(path, n)):
        want = min(max_prompt_tokens, max(2, math.ceil(r.input_length / token_scale)))
        ids: list[int] = []
        for h in r.hash_ids:
            if len(ids) >= want:
                break
            ids.extend(block(h))
        rng = random.Random(f"pdserve-bench-serve-pad:{seed}:{i}")
        ids.extend(rng.randrange(lo, hi) for _ in range(want - len(ids)))
        m = max(1, min(max_tokens, r.output_length))
        out.append(token_request(ids[:want], m, r.arrival_s / speedup))
    return out


def prompt_ids(req: Request, tokenizer) -> list[int]:
    """The token ids the server runs for `req` (a chat through the model's chat template)."""
    if "prompt" in req.body:
        return list(req.body["prompt"])
    return tokenizer.encode_chat(req.body["messages"])
