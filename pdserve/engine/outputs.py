"""The data that crosses the step's seam, torch-free: what a model runner hands back to the
scheduler (`ModelRunnerOutput`), what the scheduler reports per request (`StepOutput`), and the
model's stop rules every sequence carries (`StopRules`).

Owns these types only. Must not hold logic or import torch: the engine fills a
`ModelRunnerOutput` from its sampler, a simulator from `scheduler.simulated_output`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from pdserve.core.sampling_params import TokenLogprobs


@dataclass(frozen=True)
class StopRules:
    """What ends or pauses a sequence beyond its sampling parameters: its model's end-of-sequence
    ids and context length, and how many drafts it may decode on anchor-precision KV before it
    waits for the exact KV. The defaults stop nothing (a simulated request ends by max_tokens)."""

    eos_ids: frozenset[int] = frozenset()
    max_model_len: int = 1 << 62
    max_anchor_drafts: int = 15  # an engine sets its own (one short attention span, less one)


@dataclass
class ModelRunnerOutput:
    """What running a `ScheduledBatch` produced, one entry per scheduled sequence, in order.

    `sampled_token_ids[i]`: the tokens entry i emits this step: empty when it drew none (a
    prefill chunk short of the prompt's end), one token for a plain step, and for a sequence
    that ran drafts the accepted drafts followed by the target's own next token (so at most
    1 + its draft count). `logprobs[i]`: parallel to it when the request asked for logprobs
    (opaque records, passed through), else None; the whole list may be None when none asked."""

    sampled_token_ids: list[list[int]]
    logprobs: list[list[TokenLogprobs] | None] | None = None
    # Entry i: (position p, records) when it asked for prompt logprobs and computed prompt
    # positions this step: records for the prompt tokens at p, p + 1, ...; else None.
    prompt_logprobs: list[tuple[int, list[TokenLogprobs]] | None] | None = None


@dataclass
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None  # a `pdserve.core.finish` reason; None while running
    num_prompt_tokens: int
    num_cached_tokens: int
    prefill_done: bool = False  # prefill-only request: first token sampled, KV parked for export
    # Parallel to new_token_ids when the request asked for logprobs, else None.
    logprobs: list[TokenLogprobs] | None = None
    # On the first output of a request that asked for prompt logprobs: one per prompt token
    # after the first.
    prompt_logprobs: list[TokenLogprobs] | None = None

# on_prefill_layer(layer, spans): spans = [(request id, start, end)] computed this step.
LayerSpansHook = Callable[[int, list[tuple[str, int, int]]], None]
