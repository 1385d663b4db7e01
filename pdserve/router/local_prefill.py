"""Whether a prompt is prefilled on the decode worker that already caches most of it: a pure core.

Owns the rule (`choose_cached_local`): a decode worker whose prefix cache holds the leading
blocks of a prompt, so that at most `max_uncached_tokens` of it are left to compute, prefills
that rest itself and decodes on, instead of the prompt going to a prefill worker and its KV
crossing the store. Conditional disaggregation, as NVIDIA Dynamo's router does it (prefill
remotely only when the prompt's uncached part is long): a chat's next turn meets the decode
worker that holds the conversation so far (its prompt and the answer it decoded), and a tail of
a few dozen tokens costs a decode step less than the hop, the prefill worker's queue and the
KV's trip through the store. The work is bounded: only the uncached tail is computed, and only
on a worker with no decode waiting for admission and room for the request's blocks.

Must not read the block index or talk to workers: `pool.WorkerSet.cached_local` measures each
candidate's cached prefix and carries the choice out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class LocalCandidate:
    """An ACTIVE decode worker as this rule sees it."""

    address: str
    cached_tokens: int  # the prompt's leading tokens its prefix cache holds (whole blocks)
    running: int = 0  # its last reported batch
    waiting: int = 0  # requests it holds that wait to be admitted to a step
    free_blocks: int | None = None  # its last reported free KV blocks (None: not reported)


@dataclass(frozen=True)
class LocalChoice:
    index: int  # into the candidates
    uncached_tokens: int  # what the chosen worker computes before the first token
    cached_tokens: int


def choose_cached_local(candidates: Sequence[LocalCandidate], prompt_tokens: int,
                        max_uncached_tokens: int, need_blocks: int = 0) -> LocalChoice | None:
    """The decode worker to prefill a `prompt_tokens` prompt itself, or None (the normal path).

    A candidate qualifies when it caches at least one block of the prompt, leaves at most
    `max_uncached_tokens` to compute (0 turns the rule off), has no request waiting for
    admission, and reported at least `need_blocks` free blocks (or nothing yet). Among those,
    the fewest tokens to compute wins, then the smallest running batch, then the lowest address
    (deterministic)."""
    if max_uncached_tokens <= 0 or prompt_tokens <= 0:
        return None
    best: tuple[int, int, str, int] | None = None
    for i, c in enumerate(candidates):
        if c.cached_tokens <= 0 or c.waiting > 0:
            continue
        if c.free_blocks is not None and c.free_blocks < need_blocks:
            continue
        uncached = prompt_tokens - min(c.cached_tokens, prompt_tokens - 1)
        if uncached > max_uncached_tokens:
            continue
        key = (uncached, c.running, c.address, i)
        if best is None or key < best:
            best = key
    if best is None:
        return None
    i = best[3]
    return LocalChoice(i, best[0], prompt_tokens - best[0])
