"""The model runner: runs a planned batch through the model and draws its tokens.

Owns the model, the paged KV cache's tensors (which blocks a request holds is the scheduler's
block pool), the sampler and, with `EngineConfig.spec` set, the drafter and the verification
of drafts. `execute(ScheduledBatch) -> ModelRunnerOutput` builds the flat batch, runs the
model and samples every sequence that computes its last token; `propose_drafts` drafts for the
sequences the engine says may take drafts, and how many each. It must not schedule, hold or
free blocks, or append tokens: the scheduler does that with what `execute` returns.

Speculative decoding: a sequence's drafts (`spec_token_ids`) run after its last token in the
same forward; the token the target draws at every position (argmax, or a sample from that
position's seeded generator) decides how many are accepted (`spec.verify_greedy`; see
`_verify` for why this is the lossless rejection rule), and the scheduler gives back the slots
of rejected drafts. Drafters that read the target's hidden states get each sequence's last
rows (`_keep_hidden`). Without drafts a step is exactly the plain one.
"""

from __future__ import annotations

import functools
import time
from typing import Callable

import torch

from pdserve.core.structured import Grammars
from pdserve.engine.attention import PagedKVCache, build_attention_metadata
from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.guided import Guides
from pdserve.engine.loader import load_checkpoint
from pdserve.engine.logits_process import Row
from pdserve.engine.logits_process import apply as apply_controls
from pdserve.engine.model import LlamaModel, StepInput
from pdserve.engine.outputs import LayerSpansHook, ModelRunnerOutput
from pdserve.engine.sampling import sample, token_logprobs
from pdserve.engine.sequence import ScheduledBatch, Sequence
from pdserve.engine.spec import DraftRequest, SpecStats, make_drafter, verify_greedy
from pdserve.engine.spec.schedule import (AcceptanceEstimator, StepCostTable, plan_draft_lengths,
                                          profile_step_costs)

# Per step without drafts, the acceptance evidence is scaled by this (about 70 steps to halve).
_FORGET_WHEN_IDLE = 0.99

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}



def _grammars(tokenizer, model_path: str, model_config: ModelConfig) -> Grammars:
    """The grammars over the model's vocabulary (its logits' width, which may exceed the
    tokenizer's)."""
    if tokenizer is None:
        from pdserve.engine.tokenizer import Tokenizer  # only for structured outputs
        tokenizer = Tokenizer.from_path(model_path)
    return Grammars(tokenizer.backend.to_str(), model_config.vocab_size,
                    list(model_config.eos_token_ids))


def _both(first: Callable[[int], None] | None,
          then: Callable[[int], None]) -> Callable[[int], None]:
    """One layer hook calling `first` (if any), then `then`."""
    if first is None:
        return then

    def hook(li: int) -> None:
        first(li)
        then(li)
    return hook


# Rows of logits made at once for prompt logprobs (each row is a vocabulary of floats).
_PROMPT_LOGITS_ROWS = 256

class ModelRunner:
    def __init__(self, cfg: EngineConfig, model_config: ModelConfig | None = None,
                 weights: dict[str, torch.Tensor] | None = None, *,
                 max_anchor_drafts: int, tokenizer=None) -> None:
        """`cfg` with its device and dtype resolved; the checkpoint at `cfg.model_path` is
        loaded unless `model_config` and `weights` are given. `tokenizer` (else the one at
        `cfg.model_path`, loaded on the first structured request) gives the grammars their
        vocabulary."""
        dtype = DTYPES[cfg.dtype]
        if weights is None:
            model_config, weights = load_checkpoint(cfg.model_path, dtype)
        assert model_config is not None
        self.model_config = model_config
        self.model = LlamaModel(model_config, weights, dtype=dtype, device=cfg.device,
                                quantization=cfg.quantization)
        del weights
        self.device = torch.device(cfg.device)
        self.eos_ids = list(model_config.eos_token_ids)
        self.guides = Guides(functools.partial(_grammars, tokenizer, cfg.model_path,
                                               model_config), self.eos_ids)
        self.block_size = cfg.cache.block_size_tokens
        self.kv = PagedKVCache(model_config.num_hidden_layers, cfg.cache.num_blocks,
                               self.block_size, model_config.num_key_value_heads,
                               model_config.head_dim, dtype, self.device)
        spec = cfg.spec
        self.drafter = make_drafter(spec, self.model) if spec is not None else None
        self.num_speculative_tokens = spec.num_speculative_tokens if spec is not None else 0
        self.spec_stats = SpecStats(spec.num_speculative_tokens) if spec is not None else None
        # Confidence scheduling: measured acceptance per draft position, the target's step
        # cost per batch size (profiled here, a few seconds, so no request waits for it), and
        # the drafter's own time per request.
        self.spec_schedule = spec is not None and spec.schedule
        self.spec_estimator = AcceptanceEstimator() if self.spec_schedule else None
        self.step_costs: StepCostTable | None = (
            profile_step_costs(self.model, block_size=self.block_size,
                               max_tokens=cfg.scheduler.max_num_batched_tokens)
            if self.spec_schedule else None)
        self._draft_s_per_req = 0.0
        # Progressive KV: the verifications of drafts decoded on anchor-precision KV.
        self.anchor_stats = SpecStats(max_anchor_drafts)
        # Layer-wise KV streaming (prefill role): called as on_prefill_layer(layer, spans) the
        # moment a layer's K/V are in the cache, spans = [(request id, start, end)] of the
        # prefill-only requests' positions computed this step.
        self.on_prefill_layer: LayerSpansHook | None = None
        # Called as between_layers(layer) after each layer's K/V are written, on every step: the
        # worker's core sharing uses it to give borrowed threads back midway
        # (`worker/cores.py`). Must not touch the engine.
        self.between_layers: Callable[[int], None] | None = None

    def check_structured(self, so) -> None:
        """Compile-check a structured output (cached: the request's matcher reuses it)."""
        self.guides.grammars.check(so)

    # ---- one batch ---------------------------------------------------------------------
    def execute(self, batch: ScheduledBatch) -> ModelRunnerOutput:
        """Run the batch through the model and draw each sampling sequence's tokens; with
        drafts, verify them here (the accepted ones and the target's next token are sampled)."""
        ids: list[int] = []
        pos: list[int] = []
        meta_in = []
        logit_rows: list[int] = []
        samplers: list[int] = []  # batch entries that draw tokens
        prompt_spans: list[tuple[int, int, int, int]] = []  # (entry, row, first, end position)
        row = 0
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new)):
            start = seq.num_computed
            n_spec = len(seq.spec_token_ids)  # drafts run after the sequence's own tokens
            if seq.params.prompt_logprobs is not None and seq.num_output_tokens == 0:
                end = min(start + n - n_spec, seq.prompt_len - 1)
                if end > start:  # position p's logits score the prompt token at p + 1
                    prompt_spans.append((i, row, start, end))
            ids.extend(seq.token_ids[start:start + n - n_spec])
            ids.extend(seq.spec_token_ids)
            pos.extend(range(start, start + n))
            meta_in.append((start, n, seq.block_table))
            row += n
            if batch.samples(i):
                logit_rows.extend(range(row - 1 - n_spec, row))
                samplers.append(i)
        dev = self.model.device
        step = StepInput(torch.tensor(ids, dtype=torch.long, device=dev),
                         torch.tensor(pos, dtype=torch.long, device=dev),
                         build_attention_metadata(meta_in, self.block_size, dev))
        hidden = self.model.forward(step, self.kv, self._layer_hook(batch))
        keep_hidden = self.drafter is not None and self.drafter.needs_hidden
        if keep_hidden:  # drafts' rows are added once verified (below)
            row = 0
            for seq, n in zip(batch.seqs, batch.num_new):
                self._keep_hidden(seq, hidden[row:row + n - len(seq.spec_token_ids)],
                                  seq.num_computed)
                row += n
        result = ModelRunnerOutput([[] for _ in batch.seqs],
                                   [None for _ in batch.seqs])
        if prompt_spans:
            result.prompt_logprobs = self._prompt_logprobs(batch, hidden, prompt_spans)
        if not samplers:
            return result
        rows = torch.tensor(logit_rows, dtype=torch.long, device=dev)
        sel = hidden[rows]
        logits = self.model.compute_logits(sel)
        seqs = [batch.seqs[i] for i in samplers]
        # One row per sampler, plus one per draft token of a speculating one.
        params = [s.params for s in seqs for _ in range(1 + len(s.spec_token_ids))]
        index = [s.num_output_tokens + j for s in seqs for j in range(1 + len(s.spec_token_ids))]
        # Each row is sampled with its own output position's seeded generator, so a
        # draft is accepted exactly when the target draws the same token (see _verify).
        # Logprobs stay the model's raw ones (vLLM's default); the controls and the grammar
        # shape what is sampled.
        tokens = sample(self._processed(logits, seqs), params, index)
        lps = token_logprobs(logits, tokens, [p.logprobs for p in params])
        r = 0
        for i, seq in zip(samplers, seqs):
            n_rows = 1 + len(seq.spec_token_ids)
            emit = tokens[r:r + 1]
            if n_rows > 1:
                emit = self._verify(seq, tokens[r:r + n_rows])
                if keep_hidden:
                    n_own = batch.num_new[i] - len(seq.spec_token_ids)
                    self._keep_hidden(seq, sel[r + 1:r + len(emit)], seq.num_computed + n_own)
            result.sampled_token_ids[i] = emit
            if seq.params.logprobs is not None:
                result.logprobs[i] = lps[r:r + len(emit)]
            r += n_rows
        return result

    def _prompt_logprobs(self, batch: ScheduledBatch, hidden: torch.Tensor,
                         spans: list[tuple[int, int, int, int]]) -> list:
        """Per batch entry, (position, records) for the prompt tokens its computed positions
        score, or None. The logits are made a slice of rows at a time: a whole prompt's would
        take prompt length x vocabulary floats at once."""
        out: list = [None] * len(batch.seqs)
        for i, row, first, end in spans:
            seq = batch.seqs[i]
            k = seq.params.prompt_logprobs
            records = []
            for a in range(first, end, _PROMPT_LOGITS_ROWS):
                b = min(a + _PROMPT_LOGITS_ROWS, end)
                logits = self.model.compute_logits(hidden[row + a - first:row + b - first])
                nxt = seq.token_ids[a + 1:b + 1]
                records.extend(token_logprobs(logits, nxt, [k] * len(nxt)))
            out[i] = (first + 1, records)
        return out

    def _processed(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """The logits to sample from: the raw ones, or (when a request asks for a structured
        output or a logits control) a copy with its grammar's masks and controls applied, each
        row with its own history (a draft's row as if the drafts before it were emitted)."""
        if not any(s.params.structured_output is not None or s.params.processed for s in seqs):
            return logits
        out = logits.float().clone()
        rows: list[Row | None] = []
        guided = []
        for s in seqs:
            drafts = s.spec_token_ids
            so = s.params.structured_output
            emitted = s.output_ids
            if so is not None:
                if s.guide is None:
                    s.guide = self.guides.state(so)
                s.guide.sync(emitted)
                guided.append((s.guide, drafts, len(rows)))
            if s.params.processed:
                stop = [*(() if s.params.ignore_eos else self.eos_ids), *s.params.stop_token_ids]
                rows.extend(Row(s.params, s.prompt_ids, emitted + drafts[:j], stop)
                            for j in range(1 + len(drafts)))
            else:
                rows.extend([None] * (1 + len(drafts)))
        if guided:
            idx, allowed = self.guides.masks(guided, len(rows), out.shape[-1])
            idx = idx.to(out.device)
            out[idx] = out[idx].masked_fill(~allowed.to(out.device), float("-inf"))
        return apply_controls(out, rows)

    def _layer_hook(self, batch: ScheduledBatch) -> Callable[[int], None] | None:
        """What runs after each layer of this batch: the prefill streaming hook (when the
        batch holds prefill-only requests), then the core-sharing one."""
        on_layer = None
        if self.on_prefill_layer is not None:
            spans = [(s.request_id, s.num_computed, s.num_computed + n)
                     for s, n in zip(batch.seqs, batch.num_new) if s.prefill_only]
            if spans:
                def on_layer(li: int, spans=spans) -> None:
                    self.on_prefill_layer(li, spans)
        if self.between_layers is not None:
            on_layer = _both(on_layer, self.between_layers)
        return on_layer

    def _keep_hidden(self, seq: Sequence, rows: torch.Tensor, start: int) -> None:
        """Append the target's hidden states at positions start.. to the request's window
        (a drafter reads them); a gap (preemption, imported KV) restarts the window."""
        n = rows.shape[0]
        if n == 0:
            return
        w = max(1, self.drafter.window if self.drafter is not None else 1)
        rows = rows[-w:]
        if seq.hidden is not None and seq.hidden_end == start:
            seq.hidden = torch.cat([seq.hidden[-(w - rows.shape[0]):] if rows.shape[0] < w
                                    else seq.hidden[:0], rows])  # a new tensor already
        else:
            seq.hidden = rows.clone()  # rows view the step's hidden states: keep a copy only
        seq.hidden_end = start + n

    def prompt_logits(self, ids: list[int], block_table: list[int]) -> torch.Tensor:
        """Logits [len(ids), vocab] at every position of `ids`, one prefill into the blocks of
        `block_table` (held by the caller for this call only)."""
        device = self.device
        with torch.inference_mode():
            step = StepInput(torch.tensor(ids, device=device),
                             torch.arange(len(ids), device=device),
                             build_attention_metadata([(0, len(ids), block_table)],
                                                      self.block_size, device))
            return self.model.compute_logits(self.model.forward(step, self.kv))

    # ---- speculative decoding ----------------------------------------------------------
    def _window(self, seq: Sequence) -> torch.Tensor | None:
        """The hidden rows a drafter that reads them gets for `seq`: None when it has none
        up to its last computed position (just handed over, or recomputed)."""
        assert self.drafter is not None
        if not self.drafter.needs_hidden:
            return None
        return seq.hidden if seq.hidden_end == seq.num_computed else None

    def can_draft(self, seq: Sequence) -> bool:
        """Whether the drafter has what it reads to draft for `seq` now."""
        assert self.drafter is not None
        return not self.drafter.needs_hidden or self._window(seq) is not None

    def propose_drafts(self, wanted: list[tuple[Sequence, int]], base: int) -> None:
        """Drafts (`spec_token_ids`) for these sequences, at most `room` each, for the next
        step; `base`: the tokens that step runs anyway.

        With scheduling on, each request's draft length is planned twice: before drafting,
        from the measured acceptance per position (a busy machine drafts nothing and pays no
        drafter time), and after, from the drafter's own confidences when it predicts them."""
        assert self.drafter is not None
        seqs = [seq for seq, _ in wanted]
        reqs = [DraftRequest(seq.token_ids, room, self._window(seq)) for seq, room in wanted]
        if self.spec_schedule:
            assert self.spec_estimator is not None
            est = self.spec_estimator.probs(self.num_speculative_tokens)
            plan = self._plan([est[:r.k] for r in reqs], base, len(reqs))
            keep = [i for i, n in enumerate(plan) if n > 0]
            if not keep:
                # Nothing measured while nothing is drafted: let old evidence fade so that
                # drafting is tried again after a while (the load, or the text, may change).
                self.spec_estimator.forget(_FORGET_WHEN_IDLE)
                return
            seqs = [seqs[i] for i in keep]
            reqs = [reqs[i] for i in keep]
            if not self.drafter.has_confidence:
                for r, i in zip(reqs, keep):
                    r.k = plan[i]
        t0 = time.perf_counter()
        drafts = self.drafter.propose(reqs)
        spent = time.perf_counter() - t0
        self._draft_s_per_req = 0.8 * self._draft_s_per_req + 0.2 * spent / len(reqs)
        lengths = [min(len(d.tokens), r.k) for d, r in zip(drafts, reqs)]
        if self.spec_schedule and self.drafter.has_confidence:
            conf = [list(d.confidence or [])[:n] for d, n in zip(drafts, lengths)]
            lengths = self._plan(conf, base, 0)
        for seq, d, n in zip(seqs, drafts, lengths):
            seq.spec_token_ids = list(d.tokens[:n])

    def _plan(self, probs: list[list[float]], base: int, drafting: int) -> list[int]:
        """Draft lengths that maximise expected tokens per second of step (plus `drafting`
        requests' drafter time when the drafter has yet to run)."""
        assert self.step_costs is not None
        return plan_draft_lengths(probs, base, self.step_costs,
                                  draft_cost_s=self._draft_s_per_req * drafting)

    def _verify(self, seq: Sequence, target: list[int]) -> list[int]:
        """The tokens a speculating sequence emits: the drafts the target agrees with, then the
        target's next token (the scheduler cuts them at a stop rule and gives back the slots of
        the rest). Records the acceptance.

        `target[j]` is the token the target draws at draft position j with that output
        position's own seeded generator (the argmax when greedy). Accepting a draft exactly when
        it equals that token is the standard lossless rule (accept with probability
        min(1, p/q), else draw from the residual max(p - q, 0)) for a draft that is a point
        mass q: a token x is accepted with probability p(x), and when it is not, the emitted
        token is distributed as p without x, renormalised, which is the residual. It also
        makes a seeded request's output identical with and without speculation."""
        draft = seq.spec_token_ids
        accepted, emit = verify_greedy(draft, target)
        if seq.verifying_anchor:
            seq.verifying_anchor = False
            self.anchor_stats.record(len(draft), accepted)
        else:
            assert self.spec_stats is not None
            self.spec_stats.record(len(draft), accepted)
            if self.spec_estimator is not None:
                self.spec_estimator.update(len(draft), accepted)
        return emit

    def stats(self) -> dict[str, int | list[int]]:
        """The acceptance counters: speculation's (with a drafter) and progressive KV's."""
        out: dict[str, int | list[int]] = {}
        if self.spec_stats is not None:
            out.update(self.spec_stats.as_dict())
        a = self.anchor_stats
        out.update(anchor_num_drafts=a.drafts, anchor_num_draft_tokens=a.draft_tokens,
                   anchor_num_accepted_tokens=a.accepted_tokens)
        return out
