"""The Mooncake conversation trace as token prompts for `pdserve bench route`, and its ideal.

Trace: `mooncake_conversation_trace.jsonl` from the Mooncake (FAST '25) release traces,
conversation workload, Apache-2.0; 12,031 requests over about one hour; fields `timestamp` (ms
from start), `input_length`, `output_length`, `hash_ids` (one id per 512-token prefix block;
equal ids = shared prefix). Read in place, numbers never rewritten.

Owns the scaling (one stated factor): a trace block of 512 tokens becomes 512 / `token_scale`
synthetic token ids, drawn deterministically from (run seed, hash id), so equal hash ids give
identical token blocks and shared prefixes stay shared; a prompt is its blocks' tokens cut at
ceil(input_length / token_scale). A different run seed gives every block different tokens, so
runs on one cluster never hit each other's cache. Also owns the ideal: one unbounded prefix
cache fed the same prompts in order, counted exactly as the engine counts hits (whole blocks
of all prompt tokens but the last; every full prompt block cached after), and an exact LRU
cache of a given size counted the same way. Pure: no I/O besides reading the trace, no clock.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass

from pdserve.bench.kvstore_trace import (  # noqa: F401 (TraceError, default_trace_path re-exported)
    TraceError, default_trace_path, read_records,
)
from pdserve.core.block_hash import prompt_block_hashes

TRACE_BLOCK_TOKENS = 512
# Token ids drawn for synthetic blocks: clear of the low ids where tokenizers keep specials.
TOKEN_LOW, TOKEN_HIGH = 1000, 30000


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float  # from the trace's first request, unscaled
    input_length: int  # tokens, unscaled
    hash_ids: tuple[int, ...]


def load_requests(path: str, limit: int | None = None) -> list[TraceRequest]:
    """The first `limit` requests (all if None) in timestamp order, arrivals from the first."""
    records = read_records(path, limit)
    t0 = records[0].timestamp_s
    return [TraceRequest(r.timestamp_s - t0, r.input_length, r.hash_ids) for r in records]


class PromptMaker:
    """Token prompts of trace requests for one run (`seed`), `token_scale` x shorter."""

    def __init__(self, token_scale: int, seed: int, max_prompt_tokens: int) -> None:
        if token_scale < 1 or TRACE_BLOCK_TOKENS % token_scale:
            raise ValueError(f"token_scale must divide {TRACE_BLOCK_TOKENS}, got {token_scale}")
        if max_prompt_tokens < 2:
            raise ValueError(f"max_prompt_tokens must be >= 2, got {max_prompt_tokens}")
        self.token_scale = token_scale
        self.block_tokens = TRACE_BLOCK_TOKENS // token_scale
        self.seed = seed
        self.max_prompt_tokens = max_prompt_tokens
        self._blocks: dict[int, list[int]] = {}

    def block(self, hash_id: int) -> list[int]:
        b = self._blocks.get(hash_id)
        if b is None:
            rng = random.Random(f"pdserve-bench-route:{self.seed}:{hash_id}")
            b = self._blocks[hash_id] = [rng.randrange(TOKEN_LOW, TOKEN_HIGH)
                                         for _ in range(self.block_tokens)]
        return b

    def prompt(self, req: TraceRequest) -> list[int]:
        n = min(self.max_prompt_tokens, max(2, -(-req.input_length // self.token_scale)))
        out: list[int] = []
        for h in req.hash_ids:
            if len(out) >= n:
                break
            out.extend(self.block(h))
        if len(out) < n:  # a record whose hash ids cover less than its length: pad uniquely
            rng = random.Random(f"pdserve-bench-route-pad:{self.seed}:{req.hash_ids}")
            out.extend(rng.randrange(TOKEN_LOW, TOKEN_HIGH) for _ in range(n - len(out)))
        return out[:n]


def ideal_hit_tokens(prompts: list[list[int]], block_size_tokens: int) -> tuple[int, int]:
    """(prompt tokens an unbounded prefix cache serves, all prompt tokens), in arrival order."""
    seen: set[bytes] = set()
    hits = total = 0
    for p in prompts:
        n = 0
        for h in prompt_block_hashes(p[:-1], block_size_tokens):
            if h not in seen:
                break
            n += 1
        hits += n * block_size_tokens
        total += len(p)
        seen.update(prompt_block_hashes(p, block_size_tokens))
    return hits, total


def lru_hit_tokens(prompts: list[list[int]], block_size_tokens: int, capacity_blocks: int) -> int:
    """Prompt tokens one exact-LRU prefix cache of `capacity_blocks` serves (counted as
    `ideal_hit_tokens` counts; every prompt block is touched after)."""
    lru: OrderedDict[bytes, None] = OrderedDict()
    hits = 0
    for p in prompts:
        n = 0
        for h in prompt_block_hashes(p[:-1], block_size_tokens):
            if h not in lru:
                break
            n += 1
        hits += n * block_size_tokens
        for h in prompt_block_hashes(p, block_size_tokens):
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > capacity_blocks:
            lru.popitem(last=False)
    return hits
