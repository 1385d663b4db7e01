"""Logits processing: the request controls that change a row's logits before sampling.

Owns, for a batch of rows, in vLLM's order: the structured output's mask (tokens the grammar
forbids get -inf), `min_tokens` (end-of-sequence and stop token ids forbidden until that many
output tokens; yielding where nothing else is left, as after a complete grammar),
`logit_bias` (added), then the penalties: `repetition_penalty` over every token
of the prompt and the output (a positive logit divided by it, a negative one multiplied),
`frequency_penalty` times each token's count in the output, `presence_penalty` once per token
present in the output. `min_p` acts after temperature and lives with the sampler.

A row's history is its own: the prompt, every output token before it wherever it was sampled
(the prefill worker's first token, a dead worker's tokens replayed on resume), and, for a
speculative row, the drafts before it, so that a draft's row is processed exactly as if the
drafts before it had been emitted. Batched: counts come from one scatter over all rows' token
ids, never a Python loop over the vocabulary. Must not sample, nor keep state between steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence as Seq

import torch

from pdserve.core.sampling_params import SamplingParams


@dataclass
class Row:
    """One logits row to process: its request's params and history at that row."""

    params: SamplingParams
    prompt_ids: Seq[int]
    output_ids: Seq[int]  # every output token before this row (drafts before it included)
    stop_ids: Seq[int] = ()  # the ids min_tokens forbids (EOS unless ignored, stop ids)


def apply(logits: torch.Tensor, rows: list[Row | None]) -> torch.Tensor:
    """logits [R, V] fp32, modified in place and returned; rows[i] None: left as is."""
    todo = [i for i, r in enumerate(rows) if r is not None and r.params.processed]
    if not todo:
        return logits
    vocab = logits.shape[-1]
    # min_tokens and logit_bias: index lists, one index_put each.
    ban_r: list[int] = []
    ban_t: list[int] = []
    bias_r: list[int] = []
    bias_t: list[int] = []
    bias_v: list[float] = []
    for i in todo:
        r = rows[i]
        p = r.params
        if p.min_tokens and len(r.output_ids) < p.min_tokens:
            ids = [t for t in r.stop_ids if 0 <= t < vocab]
            ban_r.extend([i] * len(ids))
            ban_t.extend(ids)
        for t, b in p.logit_bias:
            bias_r.append(i)
            bias_t.append(t)
            bias_v.append(b)
    dev = logits.device
    if ban_r:
        where = (torch.tensor(ban_r, device=dev), torch.tensor(ban_t, device=dev))
        kept = logits[where]
        logits[where] = float("-inf")
        # A row the ban leaves with no token at all (a structured output whose grammar is
        # complete allows only the end of sequence) keeps its stop tokens: the grammar's end
        # wins over min_tokens, as nothing else could be sampled there.
        empty = torch.isneginf(logits[where[0]]).all(dim=-1)  # per banned entry, its row's
        logits[where] = torch.where(empty, kept, float("-inf"))  # (no device sync)
    if bias_r:
        logits.index_put_((torch.tensor(bias_r, device=dev), torch.tensor(bias_t, device=dev)),
                          torch.tensor(bias_v, dtype=logits.dtype, device=dev), accumulate=True)
    pen = [i for i in todo if rows[i].params.presence_penalty
           or rows[i].params.frequency_penalty or rows[i].params.repetition_penalty != 1.0]
    if pen:
        _penalties(logits, [rows[i] for i in pen], torch.tensor(pen, device=dev))
    return logits


def _penalties(logits: torch.Tensor, rows: list[Row], where: torch.Tensor) -> None:
    n, vocab = len(rows), logits.shape[-1]
    dev = logits.device
    out_r = [j for j, r in enumerate(rows) for _ in range(len(r.output_ids))]
    out_t = [t for r in rows for t in r.output_ids]
    counts = torch.zeros(n, vocab, dtype=logits.dtype, device=dev)
    if out_t:
        counts.index_put_((torch.tensor(out_r, device=dev), torch.tensor(out_t, device=dev)),
                          torch.ones(len(out_t), dtype=logits.dtype, device=dev),
                          accumulate=True)
    x = logits[where]
    rep = [j for j, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    if rep:
        seen = counts[rep] > 0
        pr_r = [k for k, j in enumerate(rep) for _ in range(len(rows[j].prompt_ids))]
        pr_t = [t for j in rep for t in rows[j].prompt_ids]
        if pr_t:
            seen[torch.tensor(pr_r, device=dev), torch.tensor(pr_t, device=dev)] = True
        penalty = torch.tensor([rows[j].params.repetition_penalty for j in rep],
                               dtype=x.dtype, device=dev).unsqueeze(1)
        xr = x[rep]
        x[rep] = torch.where(seen, torch.where(xr > 0, xr / penalty, xr * penalty), xr)
    freq = torch.tensor([r.params.frequency_penalty for r in rows], dtype=x.dtype,
                        device=dev).unsqueeze(1)
    pres = torch.tensor([r.params.presence_penalty for r in rows], dtype=x.dtype,
                        device=dev).unsqueeze(1)
    x -= freq * counts + pres * (counts > 0).to(x.dtype)
    logits[where] = x
