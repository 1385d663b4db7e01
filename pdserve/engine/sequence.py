"""A request as the scheduler sees it, a planned step, and the rules a token is checked by.

Owns `Sequence` (a request's tokens, blocks and state), `ScheduledBatch` (what one step runs),
the stop check applied after every token, and `simulated_output` (a step's tokens without a
model, for a simulator). It must not schedule, run the model or import torch.
"""

from __future__ import annotations

import collections.abc
import enum
from dataclasses import dataclass, field
from typing import Any

from pdserve.core import finish
from pdserve.core.errors import QueueFullError  # noqa: F401 - re-exported
from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.outputs import ModelRunnerOutput, StopRules


# A sequence's token ids: a list, or what reads as one (`len`, indexing and slices, iteration,
# `append`, `extend`, `del` of a tail, `copy`), as the simulator's compact `RunTokens` does.
TokenIds = Any


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # an entity: equal only to itself (queues search it by identity)
class Sequence:
    request_id: str
    prompt_ids: TokenIds
    params: SamplingParams
    salt: str = ""
    stop_rules: StopRules = StopRules()
    prefill_only: bool = False  # prefill role: stop after the first token, keep the KV for export
    max_chunk_tokens: int = 0  # most of its own tokens per step (0: only the step budget bounds it)
    token_ids: TokenIds = field(default_factory=list)
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # of the full blocks registered so far
    # The chained hashes of the prompt's leading full blocks, when the caller already has them
    # (the router and the prefill role compute them; a simulator derives them from its trace):
    # the scheduler hashes token ids only past them. Empty: it hashes every block itself. Any
    # sequence of them (a simulator's may be made when first read).
    known_hashes: collections.abc.Sequence[bytes] = ()
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache or an import
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None
    # Draft tokens to verify this step (after the last token); empty without speculation.
    spec_token_ids: list[int] = field(default_factory=list)
    # For drafters that read the target's hidden states: the last rows computed (a tensor
    # [w, d], positions hidden_end - w .. hidden_end - 1), kept by the engine.
    hidden: Any = None
    hidden_end: int = 0
    # Progressive KV: >0 while the prompt's KV is anchor precision (approximate). Tokens from
    # this index on are drafts decoded on it, never emitted; `paused` stops scheduling when
    # enough are drafted. `forced_drafts` are verified next step, once the exact KV is in.
    anchor_from: int = 0
    paused: bool = False
    forced_drafts: list[int] = field(default_factory=list)
    verifying_anchor: bool = False
    # A structured output's matcher (`engine.guided.GuideState`), made by the runner on the
    # request's first sampled step; it follows token_ids by itself.
    guide: Any = None
    # Prompt logprobs gathered so far (prompt tokens 1..), while the request asks for them and
    # has emitted nothing; handed out with its first token.
    prompt_lps: list = field(default_factory=list)
    # len(prompt_ids), kept: read for every sequence at every step (the prompt never changes).
    prompt_len: int = field(init=False, repr=False, compare=False)
    # params.max_tokens, kept: a simulator's bulk decode reads it for every running sequence
    # at every run (one attribute here, where the compiled build reads a field, not a dict).
    max_tokens: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.prompt_len = len(self.prompt_ids)
        self.max_tokens = self.params.max_tokens
        if not self.token_ids:
            self.token_ids = list(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def num_output_tokens(self) -> int:  # without copying them: checked after every token
        return len(self.token_ids) - self.prompt_len


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_new: list[int]  # tokens each sequence runs this step (its drafts included)
    preempted: list[Sequence]

    # Spelled out: a generated `__init__` runs interpreted even where this module is compiled.
    def __init__(self, seqs: list[Sequence], num_new: list[int],
                 preempted: list[Sequence]) -> None:
        self.seqs = seqs
        self.num_new = num_new
        self.preempted = preempted

    @property
    def empty(self) -> bool:
        return not self.seqs

    def samples(self, i: int) -> bool:
        """Whether entry i computes its sequence's last token this step, so that a token is
        drawn for it (a prefill chunk that is not the last draws none). Valid until
        `update_from_output`."""
        seq, n = self.seqs[i], self.num_new[i]
        return seq.num_computed + n - len(seq.spec_token_ids) == len(seq.token_ids)


def check_stop(seq: Sequence, tok: int) -> bool:
    """Whether `tok`, just appended, ends `seq`; sets its finish reason if so."""
    p, rules = seq.params, seq.stop_rules
    n = len(seq.token_ids)
    if (tok in rules.eos_ids and not p.ignore_eos) or tok in p.stop_token_ids:
        seq.finish_reason = finish.STOP
    elif n - seq.prompt_len >= p.max_tokens or n >= rules.max_model_len:
        seq.finish_reason = finish.LENGTH
    return seq.finish_reason is not None


def simulated_output(batch: ScheduledBatch, token_id: int = 0,
                     accepted_drafts: int = 0) -> ModelRunnerOutput:
    """A runner's output without a model: every entry that samples emits `token_id`, after
    its first `accepted_drafts` drafts (a speculating sequence). For a simulator, which models
    a step's time and needs only the token accounting to be the real scheduler's."""
    out: list[list[int]] = []
    for i, seq in enumerate(batch.seqs):
        out.append(seq.spec_token_ids[:accepted_drafts] + [token_id] if batch.samples(i) else [])
    return ModelRunnerOutput(out)
