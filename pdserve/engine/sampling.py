"""The sampler (its parameters, validated at the boundary, are `pdserve.core.sampling_params`).

Owns the rules that turn logits into tokens: greedy, temperature, min-p, top-k, top-p, and a
per-request seed (the controls that change logits first are `pdserve.engine.logits_process`). Randomness is drawn from a generator seeded by (seed, output index), so the token at a given
position is the same whichever process samples it: the prefill worker samples the first token and
the decode worker the rest, and a seeded request still reproduces the single-process result.

Also owns log-probabilities: when a request asks for them, each sampled token is reported with its
log-probability and the top-k alternatives, from the model's raw logits (log_softmax before
temperature, top-k and top-p, as vLLM's default "raw logprobs"). Reporting never changes which
token is sampled.
"""

from __future__ import annotations

import torch

# The request-side types live in the torch-free core; re-exported for the engine's callers.
from pdserve.core.sampling_params import (  # noqa: F401
    MAX_LOGPROBS, InvalidArgumentError, SamplingParams, TokenLogprobs)


def _mix(seed: int, index: int) -> int:
    # SplitMix64 step: decorrelates neighbouring (seed, index) pairs.
    z = (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & (2**64 - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return (z ^ (z >> 31)) & (2**63 - 1)


def probs_from_logits(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution sampling draws from, after temperature, top-k and top-p: [V] fp32."""
    logits = logits.float()
    # Shift so the largest logit is 0 before scaling: a tiny temperature then gives -inf, never
    # inf, and the softmax stays finite (unshifted, 1e-40 overflows to inf - inf = nan).
    x = (logits - logits.max()) / p.temperature
    if p.min_p:
        # After temperature, as vLLM: drop what is less likely than min_p times the top token.
        probs = torch.softmax(x, dim=-1)
        x = x.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    if p.top_k and p.top_k < x.shape[-1]:
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = (torch.cumsum(probs, dim=-1) - probs) >= p.top_p
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(0, order, sorted_x)
    return torch.softmax(x, dim=-1)


def sample(logits: torch.Tensor, params: list[SamplingParams], out_index: list[int]) -> list[int]:
    """logits [n, V]; out_index[i] is the position of the token in request i's output."""
    tokens = torch.argmax(logits, dim=-1).tolist()
    for i, p in enumerate(params):
        if p.temperature == 0:
            continue
        probs = probs_from_logits(logits[i], p)
        gen = torch.Generator().manual_seed(_mix(p.seed or 0, out_index[i]))
        tokens[i] = int(torch.multinomial(probs, 1, generator=gen))
    return tokens


def token_logprobs(logits: torch.Tensor, tokens: list[int],
                   ks: list[int | None]) -> list[TokenLogprobs | None]:
    """logits [n, V] (raw, as the model gave them); per row, the sampled token's logprob and the
    top ks[i] alternatives, or None where ks[i] is None. Only the rows that ask are computed."""
    out: list[TokenLogprobs | None] = [None] * len(tokens)
    rows = [i for i, k in enumerate(ks) if k is not None]
    if not rows:
        return out
    logp = torch.log_softmax(logits[rows].float(), dim=-1)
    index = torch.tensor([[tokens[i]] for i in rows], device=logp.device)
    chosen = logp.gather(1, index).squeeze(1).tolist()
    k_max = max(ks[i] for i in rows)
    top_v, top_i = torch.topk(logp, k_max, dim=-1) if k_max else (None, None)
    for j, i in enumerate(rows):
        k = ks[i]
        top = (list(zip(top_i[j, :k].tolist(), top_v[j, :k].tolist())) if k else [])
        out[i] = TokenLogprobs(tokens[i], chosen[j], top)
    return out
