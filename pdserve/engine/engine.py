"""The in-process engine: one model, one paged cache, one scheduler, stepped by its owner.

Owns a step: schedule, build the flat batch, run the model, sample, and hand the tokens back to
the scheduler (`Scheduler.update_from_output`), which applies them and the stop rules; the engine
reports what it returns. It is single-threaded on purpose; a worker process drives it from one
loop thread. It also owns moving a request's KV in and out as whole blocks (`take_parked_kv`,
`add_prefilled_request`), which is how the prefill and decode roles hand a request over without
the engine knowing about a store.
A request another engine was decoding when it died is resumed by recomputing what it emitted
(`add_request(resume_token_ids=...)`): the same tokens follow, since sampling is seeded per
output position.

With `EngineConfig.spec` set, each step first asks the drafter for draft tokens for every
request in decode; the drafts run after the request's last token in the same forward, the
token the target draws at every position (argmax, or a sample from that position's seeded
generator) decides how many are accepted (`spec.verify_greedy`; see `_verify` for why this is
the lossless rejection rule), and the scheduler gives back the slots of rejected drafts.
Drafters that read the target's hidden states get each request's last rows (`_keep_hidden`).
With `spec` None a step is exactly the plain one.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Callable

import torch

from pdserve.core import finish
from pdserve.core.block_hash import hash_block
from pdserve.engine.attention import SHORT_SPAN, PagedKVCache, build_attention_metadata
from pdserve.engine.block_pool import BlockPool
from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.device import check_quantization, resolve_device, resolve_dtype
from pdserve.engine.loader import load_checkpoint
from pdserve.engine.model import LlamaModel, StepInput
from pdserve.engine.request_check import check_request, check_resume
from pdserve.engine.sampling import InvalidArgumentError, SamplingParams, sample, token_logprobs
from pdserve.engine.scheduler import (  # noqa: F401 (StepOutput re-exported for the workers)
    ModelRunnerOutput, ScheduledBatch, Scheduler, Sequence, StepOutput, StopRules)
from pdserve.engine.spec import DraftRequest, SpecStats, make_drafter, verify_greedy
from pdserve.engine.spec.schedule import (AcceptanceEstimator, StepCostTable, plan_draft_lengths,
                                          profile_step_costs)

# Per step without drafts, the acceptance evidence is scaled by this (about 70 steps to halve).
_FORGET_WHEN_IDLE = 0.99

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _both(first: Callable[[int], None] | None,
          then: Callable[[int], None]) -> Callable[[int], None]:
    """One layer hook calling `first` (if any), then `then`."""
    if first is None:
        return then

    def hook(li: int) -> None:
        first(li)
        then(li)
    return hook


@dataclass
class ParkedKV:
    """A prefilled request's KV, block by block, in prompt order."""

    block_hashes: list[bytes]  # chained hash per block (the last may cover a partial block)
    blocks: list[torch.Tensor]  # each [layers, 2, block_size, kv_heads, head_dim]
    num_tokens: int


class LLMEngine:
    def __init__(self, cfg: EngineConfig, *, model_config: ModelConfig | None = None,
                 weights: dict[str, torch.Tensor] | None = None, tokenizer=None) -> None:
        device = resolve_device(cfg.device)
        self.cfg = cfg = dataclasses.replace(cfg, device=device,
                                             dtype=resolve_dtype(cfg.dtype, device))
        check_quantization(cfg.quantization, cfg.device, cfg.dtype)  # as resolved
        dtype = DTYPES[cfg.dtype]
        if weights is None:
            model_config, weights = load_checkpoint(cfg.model_path, dtype)
        assert model_config is not None
        self.model_config = model_config
        self.model = LlamaModel(model_config, weights, dtype=dtype, device=cfg.device,
                                quantization=cfg.quantization)
        del weights
        self.tokenizer = tokenizer
        self.max_model_len = min(cfg.max_model_len_tokens or model_config.max_position_embeddings,
                                 model_config.max_position_embeddings)
        self.block_size = cfg.cache.block_size_tokens
        self.kv = PagedKVCache(model_config.num_hidden_layers, cfg.cache.num_blocks,
                               self.block_size, model_config.num_key_value_heads,
                               model_config.head_dim, dtype, torch.device(cfg.device))
        self.pool = BlockPool(cfg.cache.num_blocks)
        self.scheduler = Scheduler(cfg.scheduler, self.pool, self.block_size,
                                   cfg.cache.enable_prefix_caching)
        self.seqs: dict[str, Sequence] = {}
        self.parked: dict[str, Sequence] = {}
        self.eos_ids = set(model_config.eos_token_ids)
        self.steps = 0
        self.last_step_decoded = False
        self._ids = itertools.count()
        self.drafter = make_drafter(cfg.spec, self.model) if cfg.spec is not None else None
        self.spec_stats = (SpecStats(cfg.spec.num_speculative_tokens)
                           if cfg.spec is not None else None)
        # Confidence scheduling: measured acceptance per draft position, the target's step
        # cost per batch size (profiled here, a few seconds, so no request waits for it), and
        # the drafter's own time per request.
        self.spec_schedule = cfg.spec is not None and cfg.spec.schedule
        self.spec_estimator = (AcceptanceEstimator()
                               if self.spec_schedule else None)
        self.step_costs: StepCostTable | None = (
            profile_step_costs(self.model, block_size=self.block_size,
                               max_tokens=cfg.scheduler.max_num_batched_tokens)
            if self.spec_schedule else None)
        # Progressive KV: most tokens drafted on anchor precision before the exact KV lands,
        # and the verifications of those drafts.
        self.max_anchor_drafts = SHORT_SPAN - 1
        # Layer-wise KV streaming (prefill role): called as on_prefill_layer(layer, spans) the
        # moment a layer's K/V are in the cache, spans = [(request id, start, end)] of the
        # prefill-only requests' positions computed this step; read them with `read_layer_kv`.
        self.on_prefill_layer: Callable[[int, list[tuple[str, int, int]]], None] | None = None
        # Called as between_layers(layer) after each layer's K/V are written, on every step: the
        # worker's core sharing uses it to give borrowed threads back midway
        # (`worker/cores.py`). Must not touch the engine.
        self.between_layers: Callable[[int], None] | None = None
        self.anchor_stats = SpecStats(self.max_anchor_drafts)
        self._draft_s_per_req = 0.0

    # ---- requests in -------------------------------------------------------------------
    @functools.cached_property
    def stop_rules(self) -> StopRules:
        """The model's stop rules, which every sequence of this engine carries."""
        return StopRules(frozenset(self.eos_ids), self.max_model_len, self.max_anchor_drafts)

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        check_request(prompt_ids, params, vocab_size=self.model_config.vocab_size,
                      max_model_len=self.max_model_len, block_size=self.block_size,
                      num_blocks=self.pool.num_blocks)

    def add_request(self, request_id: str | None, prompt_ids: list[int], params: SamplingParams,
                    *, salt: str = "", prefill_only: bool = False,
                    max_chunk_tokens: int = 0, resume_token_ids: Iterable[int] = ()) -> str:
        """Queue a request; it is prefilled here, in chunks.

        `resume_token_ids`: the tokens this request already emitted elsewhere (a decode worker
        that died mid-request), in order. They are computed with the prompt, counted in
        max_tokens, never emitted again, and sampling goes on from output position
        len(resume_token_ids): seeded by (seed, position), so the continuation is exactly the
        one the first worker would have produced."""
        self.validate(prompt_ids, params)
        if max_chunk_tokens < 0:
            raise InvalidArgumentError("max_chunk_tokens", "must be >= 0 (0: no cap)")
        resume = list(resume_token_ids)
        if resume:
            check_resume(resume, params, prefill_only,
                         vocab_size=self.model_config.vocab_size, eos_ids=self.eos_ids)
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self.seqs or rid in self.parked:
            raise InvalidArgumentError("request_id", f"{rid!r} is already in flight")
        seq = Sequence(rid, list(prompt_ids), params.with_seed(), salt=salt,
                       stop_rules=self.stop_rules, prefill_only=prefill_only, max_chunk_tokens=max_chunk_tokens,
                       token_ids=list(prompt_ids) + resume)
        self.scheduler.add(seq)
        self.seqs[rid] = seq
        return rid

    def cached_prefix_blocks(self, block_hashes: list[bytes]) -> int:
        """How many leading blocks of this chain the local pool already holds."""
        n = 0
        for h in block_hashes:
            if self.pool.lookup(h) is None:
                break
            n += 1
        return n

    def read_cached_blocks(self, block_hashes: list[bytes]) -> list[tuple[bytes, torch.Tensor]]:
        """Copies of the leading blocks of this chain the local pool holds, with their hashes:
        what another worker may import (`import_cached_blocks`) instead of computing them."""
        out = []
        for h in block_hashes:
            bid = self.pool.lookup(h)
            if bid is None:
                break
            out.append((h, self.kv.read_block(bid)))
        return out

    def import_cached_blocks(self, blocks: list[tuple[bytes, torch.Tensor]]) -> int:
        """Place full blocks computed elsewhere into the local prefix cache (unheld, evictable).

        A following `add_request` whose prompt starts with these blocks finds them as ordinary
        prefix-cache hits. Blocks already cached are skipped; returns how many were placed.
        """
        placed = 0
        for h, data in blocks:
            if self.pool.lookup(h) is not None or self.pool.num_free == 0:
                continue
            bid = self.pool.allocate(1)[0]
            self.kv.write_block(bid, data)
            self.pool.register(bid, h)
            self.pool.release([bid])
            placed += 1
        return placed

    def add_prefilled_request(self, request_id: str, prompt_ids: list[int], first_token: int,
                              params: SamplingParams, blocks: list[tuple[bytes, torch.Tensor | None]],
                              *, salt: str = "", approximate: bool = False) -> str | None:
        """Join a request whose prompt was prefilled elsewhere; returns a finish reason if the
        first token already ends it (then nothing runs), else None.

        `blocks` are the prompt's KV blocks in order: (hash, data), with data None where the
        local pool should already hold that hash. Only the leading run of blocks that can be
        placed is used; whatever is missing is recomputed here, so a lost block costs time,
        never a wrong token.

        `approximate`: the data is anchor precision (progressive transfer). The request then
        decodes drafts on it, emitting nothing, until `finish_anchor` brings the exact KV and
        the drafts are verified; its blocks are never shared through the prefix cache before.
        """
        self.validate(prompt_ids, params)
        if request_id in self.seqs:
            raise InvalidArgumentError("request_id", f"{request_id!r} is already in flight")
        seq = Sequence(request_id, list(prompt_ids), params.with_seed(), salt=salt,
                       stop_rules=self.stop_rules)
        seq.token_ids.append(first_token)
        writes = self.scheduler.add_prefilled(seq, [h for h, _ in blocks],
                                              [d is not None for _, d in blocks],
                                              approximate=approximate)
        for i, bid in writes:
            self.kv.write_block(bid, blocks[i][1])
        if seq.finish_reason is None:
            self.seqs[request_id] = seq
        return seq.finish_reason

    def finish_anchor(self, request_id: str,
                      blocks: list[tuple[bytes, torch.Tensor | None]]) -> int:
        """The exact KV of a request joined with `approximate=True` has arrived: write it over
        the anchor-precision blocks (data None: that block was exact already), drop the KV
        computed on the approximation, and queue the drafts made on it for verification in the
        next step. Returns how many drafts will be verified (0 if the request is gone or was
        recomputed exactly meanwhile)."""
        seq = self.seqs.get(request_id)
        if seq is None or not seq.anchor_from:
            return 0
        n_prompt = len(seq.prompt_ids)
        for bid, (_h, data) in zip(seq.block_table, blocks):
            if data is not None:
                self.kv.write_block(bid, data)
        drafts = seq.token_ids[seq.anchor_from:]
        del seq.token_ids[seq.anchor_from:]
        seq.anchor_from = 0
        seq.paused = False
        # Every position from the first token on was computed on approximate KV: redo them.
        seq.num_computed = min(seq.num_computed, n_prompt)
        full = seq.num_computed // self.block_size
        del seq.block_hashes[full:]
        if self.cfg.cache.enable_prefix_caching:
            for bid, h in zip(seq.block_table, seq.block_hashes):
                if self.pool.lookup(h) is None:
                    self.pool.register(bid, h)
        self.scheduler.trim_blocks(seq, seq.num_tokens)
        room = min(len(drafts), seq.params.max_tokens - seq.num_output_tokens - 1,
                   self.max_model_len - seq.num_tokens)
        seq.forced_drafts = drafts[:max(0, room)]
        return len(seq.forced_drafts)

    def abort(self, request_id: str) -> bool:
        seq = self.seqs.get(request_id) or self.parked.pop(request_id, None)
        if seq is None:
            return False
        self._finish(seq, finish.ABORT)
        return True

    # ---- one step ----------------------------------------------------------------------
    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def num_requests(self) -> tuple[int, int]:
        """Requests the scheduler holds (running and waiting; not those parked for export),
        and how many of them have no first token yet (their prompts not wholly computed)."""
        sched = self.scheduler
        fresh = len(sched.waiting) + sum(1 for s in sched.running
                                         if s.num_computed < len(s.prompt_ids))
        return len(sched.running) + len(sched.waiting), fresh

    def step(self) -> list[StepOutput]:
        """One step: plan (scheduler), run the model and sample (`_execute`), then hand the
        tokens back to the scheduler, which applies them and the stop rules."""
        if self.drafter is not None:
            self._propose_drafts()
        for seq in self.scheduler.running:
            if seq.forced_drafts:  # drafts made on anchor KV, verified now on exact KV
                seq.spec_token_ids = seq.forced_drafts
                seq.forced_drafts = []
                seq.verifying_anchor = True
        batch = self.scheduler.schedule()
        # Whether this step decodes (some sequence is past its prompt): its owner times those.
        self.last_step_decoded = any(s.num_computed >= len(s.prompt_ids) for s in batch.seqs)
        if batch.empty:
            return []
        result = self._execute(batch)
        self.steps += 1
        outputs = self.scheduler.update_from_output(batch, result)
        for out in outputs:
            if out.prefill_done:  # its KV waits for export
                self.parked[out.request_id] = self.seqs.pop(out.request_id)
            elif out.finished:
                self.seqs.pop(out.request_id, None)
        return outputs

    def _execute(self, batch: ScheduledBatch) -> ModelRunnerOutput:
        """Run the batch through the model and draw each sampling sequence's tokens; with
        drafts, verify them here (the accepted ones and the target's next token are sampled)."""
        ids: list[int] = []
        pos: list[int] = []
        meta_in = []
        logit_rows: list[int] = []
        samplers: list[int] = []  # batch entries that draw tokens
        row = 0
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new)):
            start = seq.num_computed
            n_spec = len(seq.spec_token_ids)  # drafts run after the sequence's own tokens
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
        on_layer = None
        if self.on_prefill_layer is not None:
            spans = [(s.request_id, s.num_computed, s.num_computed + n)
                     for s, n in zip(batch.seqs, batch.num_new) if s.prefill_only]
            if spans:
                def on_layer(li: int, spans=spans) -> None:
                    self.on_prefill_layer(li, spans)
        if self.between_layers is not None:
            on_layer = _both(on_layer, self.between_layers)
        hidden = self.model.forward(step, self.kv, on_layer)
        keep_hidden = self.drafter is not None and self.drafter.needs_hidden
        if keep_hidden:  # drafts' rows are added once verified (below)
            row = 0
            for seq, n in zip(batch.seqs, batch.num_new):
                self._keep_hidden(seq, hidden[row:row + n - len(seq.spec_token_ids)],
                                  seq.num_computed)
                row += n
        result = ModelRunnerOutput([[] for _ in batch.seqs],
                                   [None for _ in batch.seqs])
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
        tokens = sample(logits, params, index)
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

    # ---- speculative decoding ----------------------------------------------------------
    def _propose_drafts(self) -> None:
        """Drafts for every running request whose next step is a decode.

        With scheduling on, each request's draft length is planned twice: before drafting,
        from the measured acceptance per position (a busy machine drafts nothing and pays no
        drafter time), and after, from the drafter's own confidences when it predicts them."""
        assert self.drafter is not None and self.cfg.spec is not None
        k = self.cfg.spec.num_speculative_tokens
        seqs: list[Sequence] = []
        reqs: list[DraftRequest] = []
        base = 0  # tokens this step runs anyway: every decode's own token, prefill chunks
        # Blocks left for drafts once every running request has its own next token's block:
        # a draft the pool cannot hold would be dropped after the drafter paid for it.
        spare = self.pool.num_free - sum(
            self.scheduler.blocks_needed(s, s.num_tokens) for s in self.scheduler.running)
        for seq in self.scheduler.running:
            seq.spec_token_ids = []
            base += max(1, seq.num_tokens - seq.num_computed)
            if (seq.prefill_only or seq.anchor_from or seq.forced_drafts
                    or seq.num_computed != seq.num_tokens - 1):
                continue
            # Never draft past max_tokens (the bonus token comes on top) or the context length.
            room = min(k, seq.params.max_tokens - seq.num_output_tokens - 1,
                       self.max_model_len - seq.num_tokens)
            blocks_for = self.scheduler.blocks_needed
            own = blocks_for(seq, seq.num_tokens)
            while room > 0 and blocks_for(seq, seq.num_tokens + room) - own > spare:
                room -= 1
            if room <= 0:
                continue
            hidden = None
            if self.drafter.needs_hidden:
                hidden = seq.hidden if seq.hidden_end == seq.num_computed else None
                if hidden is None:
                    continue  # no window yet (just handed over, or recomputed): next step
            spare -= blocks_for(seq, seq.num_tokens + room) - own
            seqs.append(seq)
            reqs.append(DraftRequest(seq.token_ids, room, hidden))
        if not seqs:
            return
        base = min(base, self.cfg.scheduler.max_num_batched_tokens)
        if self.spec_schedule:
            assert self.spec_estimator is not None
            est = self.spec_estimator.probs(k)
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

    def _finish(self, seq: Sequence, reason: str | None) -> None:
        self.scheduler.finish(seq, reason)
        self.scheduler.free(seq)
        self.seqs.pop(seq.request_id, None)

    # ---- KV out (prefill role) ---------------------------------------------------------
    def take_parked_kv(self, request_id: str, *, release: bool = True) -> ParkedKV:
        """The prompt's KV of a prefill-only request, block by block; frees it unless told not to."""
        seq = self.parked[request_id]
        n_prompt = len(seq.prompt_ids)
        n_blocks = -(-n_prompt // self.block_size)
        hashes = list(seq.block_hashes[:n_blocks])
        if len(hashes) < n_blocks:  # the trailing partial block: hash its tokens for a stable key
            start = (n_blocks - 1) * self.block_size
            hashes.append(hash_block(hashes[-1] if hashes else None,
                                     seq.token_ids[start:n_prompt], seq.salt))
        blocks = [self.kv.read_block(b) for b in seq.block_table[:n_blocks]]
        if release:
            self.release_parked(request_id)
        return ParkedKV(hashes, blocks, n_prompt)

    def read_layer_kv(self, request_id: str, layer: int, start: int, end: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of one layer's K and V [end - start, kv_heads, head_dim] at a running or parked
        request's positions [start, end); for streaming a layer as soon as it is computed."""
        seq = self.seqs.get(request_id) or self.parked[request_id]
        bs = self.block_size
        slots = torch.tensor([seq.block_table[p // bs] * bs + p % bs for p in range(start, end)],
                             dtype=torch.long, device=self.kv.k.device)
        k, v = self.kv.layer(layer)
        return k.index_select(0, slots), v.index_select(0, slots)

    def release_parked(self, request_id: str) -> None:
        seq = self.parked.pop(request_id, None)
        if seq is not None:
            self.scheduler.free(seq)

    # ---- convenience -------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        """Run prompts to completion in one batch; returns each prompt's output token ids."""
        rids = [self.add_request(None, p, params) for p in prompts]
        outs: dict[str, list[int]] = {r: [] for r in rids}
        while self.has_work():
            for o in self.step():
                outs[o.request_id].extend(o.new_token_ids)
        return [outs[r] for r in rids]

    def prompt_logits(self, ids: list[int]) -> torch.Tensor:
        """Logits [len(ids), vocab] at every position of `ids`, one prefill through the paged
        cache in blocks held only for it (no request is queued; the prefix cache is untouched)."""
        table = self.pool.allocate(-(-len(ids) // self.block_size))
        device = torch.device(self.cfg.device)
        try:
            with torch.inference_mode():
                step = StepInput(torch.tensor(ids, device=device),
                                 torch.arange(len(ids), device=device),
                                 build_attention_metadata([(0, len(ids), table)],
                                                          self.block_size, device))
                return self.model.compute_logits(self.model.forward(step, self.kv))
        finally:
            self.pool.release(table)

    def stats(self) -> dict[str, int | list[int]]:
        ps = self.pool.stats()
        out: dict[str, int | list[int]] = {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_free_blocks": ps.num_free,
            "num_total_blocks": ps.num_blocks,
            "num_cached_blocks": ps.num_cached,
            "prefix_cache_queries_tokens": self.scheduler.prefix_queries_tokens,
            "prefix_cache_hits_tokens": self.scheduler.prefix_hits_tokens,
            "prompt_tokens_computed": self.scheduler.prompt_tokens_computed,
            "evictions": ps.evictions,
        }
        if self.spec_stats is not None:
            out.update(self.spec_stats.as_dict())
        a = self.anchor_stats
        out.update(anchor_num_drafts=a.drafts, anchor_num_draft_tokens=a.draft_tokens,
                   anchor_num_accepted_tokens=a.accepted_tokens)
        return out

