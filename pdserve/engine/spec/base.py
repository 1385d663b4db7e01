"""The drafter interface, greedy verification and the acceptance counters.

A drafter only proposes; it never decides what is emitted. Verification is pure: given the
draft and the target's argmax at every verified position it says how many drafts are accepted
(the longest prefix equal to the argmaxes) and which tokens come out (those drafts plus the
target's own next token), so greedy output is exactly the no-speculation output (invariant 2).
This module must not touch tensors or the engine's state.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.engine.config import SpecConfig

if TYPE_CHECKING:
    import torch


@dataclass
class DraftRequest:
    """What a drafter may look at for one request.

    `token_ids` is the prompt plus the output so far; its last token has not yet run through the
    target. `hidden` (only for drafters with `needs_hidden`) holds the target's final hidden
    states (before the final norm) at the w positions before the last token's: row j was
    computed at position len(token_ids) - 1 - w + j, so the token that followed it is
    token_ids[len(token_ids) - w + j]. w may be 0 (a request just handed over by a prefill
    worker has no hidden states yet)."""

    token_ids: list[int]
    k: int  # most draft tokens wanted
    hidden: "torch.Tensor | None" = None  # [w, hidden_size]


@dataclass
class Draft:
    """A drafter's proposal for one request.

    `confidence[i]`, when the drafter predicts it, is the probability that draft i is accepted
    given that drafts 0..i-1 were. Drafts are deterministic proposals (the drafter's argmax), so
    the verifier treats the draft distribution as a point mass on each token."""

    tokens: list[int]
    confidence: list[float] | None = None


class Drafter(ABC):
    """Proposes draft tokens for a batch of requests."""

    needs_hidden: bool = False  # wants the target's hidden states (DraftRequest.hidden)
    has_confidence: bool = False  # fills Draft.confidence
    window: int = 0  # how many hidden rows per request it reads at most

    @abstractmethod
    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        """Per request, up to `k` draft tokens to follow its history; a request may get fewer
        or none."""


def verify_greedy(draft: list[int], target: list[int]) -> tuple[int, list[int]]:
    """draft [k]; target [k + 1]: the target's argmax after the last real token and after each
    draft token. Returns (accepted drafts, tokens to emit = accepted drafts + one target token)."""
    if len(target) != len(draft) + 1:
        raise ValueError(f"need {len(draft) + 1} target tokens, got {len(target)}")
    a = 0
    while a < len(draft) and draft[a] == target[a]:
        a += 1
    return a, list(draft[:a]) + [target[a]]


@dataclass
class SpecStats:
    """Counters over every verification with at least one draft token.

    `accepted_tokens` counts drafts equal to the target's argmax, before stop rules cut a run
    short; `accepted_per_position[i]` counts verifications whose draft i was accepted."""

    num_speculative_tokens: int
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.accepted_per_position:
            self.accepted_per_position = [0] * self.num_speculative_tokens

    def record(self, num_draft: int, num_accepted: int) -> None:
        if num_draft == 0:
            return
        self.drafts += 1
        self.draft_tokens += num_draft
        self.accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    def as_dict(self) -> dict[str, int | list[int]]:
        return {
            "spec_decode_num_drafts": self.drafts,
            "spec_decode_num_draft_tokens": self.draft_tokens,
            "spec_decode_num_accepted_tokens": self.accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_position),
        }


def make_drafter(cfg: SpecConfig, target=None) -> Drafter:
    """The drafter `cfg` names; model drafters share the target's (a LlamaModel) embeddings,
    final norm and LM head."""
    if cfg.method == "ngram":
        from pdserve.engine.spec.ngram import NgramDrafter

        return NgramDrafter(min_n=cfg.ngram_min, max_n=cfg.ngram_max)
    if cfg.method in ("eagle", "dflash", "dspark"):
        from pdserve.engine.spec.draft_model import load_drafter

        if cfg.draft_path is None or target is None:
            raise ValueError(f"spec.method {cfg.method!r} needs spec.draft_path and the target")
        return load_drafter(cfg.draft_path, target, expect_kind=cfg.method)
    raise ValueError(f"unknown speculative method {cfg.method!r}")
