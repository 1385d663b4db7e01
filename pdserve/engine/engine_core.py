"""The engine's request API and step loop over a runner, with no model in it (no torch).

Owns a step, which reads top to bottom: the drafts it verifies, the scheduler's plan
(`Scheduler.schedule`), the runner's run of it (`execute`: for the real model, the model, the
sampler and draft verification), and `Scheduler.update_from_output`, which applies the tokens
and the stop rules; the engine reports what that returns. It also owns the requests: adding and
aborting them, their KV in and out as whole blocks (`add_prefilled_request`, `take_parked_kv`:
how the prefill and decode roles hand a request over without the engine knowing about a store),
the KV of prefill-only requests parked for export, and the stats. Single-threaded on purpose: a
worker drives it from one loop thread. It must not run the model or sample (the runner does),
nor choose what runs (the scheduler does), nor import torch: the emulated engine
(`engine/emulated.py`) is this core over a runner that models time instead of computing.
A request another engine was decoding when it died is resumed by recomputing what it emitted
(`add_request(resume_token_ids=...)`): the same tokens follow, since sampling is seeded per
output position.

With `EngineConfig.spec` set, each step first works out which requests in decode may take
drafts and how many (`_draft_room`); the runner drafts for them and verifies the drafts in the
same step. Drafts decoded on anchor-precision KV (progressive KV) are verified in the step
after `finish_anchor` brings the exact KV. With `spec` None a step is exactly the plain one.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Callable

from pdserve.core import finish
from pdserve.core.block_hash import hash_block
from pdserve.core.sampling_params import InvalidArgumentError, SamplingParams
from pdserve.engine.block_pool import BlockPool
from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.request_check import check_request, check_resume
from pdserve.engine.scheduler import (  # noqa: F401 (StepOutput re-exported for the workers)
    Scheduler, Sequence, StepOutput, StopRules)

from pdserve.engine.outputs import LayerSpansHook


@dataclass
class ParkedKV:
    """A prefilled request's KV, block by block, in prompt order."""

    block_hashes: list[bytes]  # chained hash per block (the last may cover a partial block)
    blocks: list[Any]  # each the KV cache's block: [layers, 2, block_size, kv_heads, head_dim]
    num_tokens: int


class EngineCore:
    """The engine over any runner: the real model's (`LLMEngine`) or an emulated one."""

    def __init__(self, cfg: EngineConfig, runner: Any, model_config: ModelConfig, *,
                 max_anchor_drafts: int, tokenizer=None) -> None:
        """`runner` runs a scheduled batch (`execute`) and holds the KV cache (`kv`: blocks
        read and written whole); `cfg` with its device and dtype resolved."""
        self.cfg = cfg
        # Progressive KV: most tokens drafted on anchor precision before the exact KV lands.
        self.max_anchor_drafts = max_anchor_drafts
        self.runner = runner
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.max_model_len = min(cfg.max_model_len_tokens or model_config.max_position_embeddings,
                                 model_config.max_position_embeddings)
        self.block_size = cfg.cache.block_size_tokens
        self.pool = BlockPool(cfg.cache.num_blocks)
        self.scheduler = Scheduler(cfg.scheduler, self.pool, self.block_size,
                                   cfg.cache.enable_prefix_caching)
        self.seqs: dict[str, Sequence] = {}
        self.parked: dict[str, Sequence] = {}
        self.eos_ids = set(model_config.eos_token_ids)
        self.steps = 0
        self.last_step_decoded = False
        self._ids = itertools.count()

    # ---- the runner's parts its owner reaches (the layer hooks: see ModelRunner) ---------
    @property
    def kv(self):
        return self.runner.kv

    @property
    def on_prefill_layer(self) -> LayerSpansHook | None:  # it reads with `read_layer_kv`
        return self.runner.on_prefill_layer

    @on_prefill_layer.setter
    def on_prefill_layer(self, hook: LayerSpansHook | None) -> None:
        self.runner.on_prefill_layer = hook

    @property
    def between_layers(self) -> Callable[[int], None] | None:
        return self.runner.between_layers

    @between_layers.setter
    def between_layers(self, hook: Callable[[int], None] | None) -> None:
        self.runner.between_layers = hook

    # ---- requests in -------------------------------------------------------------------
    @functools.cached_property
    def stop_rules(self) -> StopRules:
        """The model's stop rules, which every sequence of this engine carries."""
        return StopRules(frozenset(self.eos_ids), self.max_model_len, self.max_anchor_drafts)

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        check_request(prompt_ids, params, vocab_size=self.model_config.vocab_size,
                      max_model_len=self.max_model_len, block_size=self.block_size,
                      num_blocks=self.pool.num_blocks)
        if params.structured_output is not None:  # compiled once, cached: the runner's too
            self.runner.check_structured(params.structured_output)

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

    def read_cached_blocks(self, block_hashes: list[bytes]) -> list[tuple[bytes, Any]]:
        """Copies of the leading blocks of this chain the local pool holds, with their hashes:
        what another worker may import (`import_cached_blocks`) instead of computing them."""
        out = []
        for h in block_hashes:
            bid = self.pool.lookup(h)
            if bid is None:
                break
            out.append((h, self.kv.read_block(bid)))
        return out

    def import_cached_blocks(self, blocks: list[tuple[bytes, Any]]) -> int:
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
                              params: SamplingParams, blocks: list[tuple[bytes, Any | None]],
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
                      blocks: list[tuple[bytes, Any | None]]) -> int:
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
        """One step: the drafts it verifies, the scheduler's plan, the runner's run of it,
        and the scheduler taking the tokens back (it applies them and the stop rules)."""
        self._take_drafts()
        batch = self.scheduler.schedule()
        # Whether this step decodes (some sequence is past its prompt): its owner times those.
        self.last_step_decoded = any(s.num_computed >= len(s.prompt_ids) for s in batch.seqs)
        if batch.empty:
            return []
        result = self.runner.execute(batch)
        self.steps += 1
        outputs = self.scheduler.update_from_output(batch, result)
        self._settle(outputs)
        return outputs

    def _settle(self, outputs: list[StepOutput]) -> None:
        """Finished requests leave; a prefill-only one's KV is parked for export."""
        for out in outputs:
            if out.prefill_done:
                self.parked[out.request_id] = self.seqs.pop(out.request_id)
            elif out.finished:
                self.seqs.pop(out.request_id, None)

    def _take_drafts(self) -> None:
        """Set the drafts this step verifies: the drafter's, for the requests in decode that
        may take some, and those decoded on anchor KV whose exact KV has landed."""
        if self.runner.drafter is not None:
            wanted, base = self._draft_room()
            if wanted:
                self.runner.propose_drafts(wanted, base)
        for seq in self.scheduler.running:
            if seq.forced_drafts:  # drafts made on anchor KV, verified now on exact KV
                seq.spec_token_ids = seq.forced_drafts
                seq.forced_drafts = []
                seq.verifying_anchor = True

    def _draft_room(self) -> tuple[list[tuple[Sequence, int]], int]:
        """The running requests in decode that may take drafts, each with how many (at most k,
        never past max_tokens with the bonus token on top, nor the context, nor the blocks left
        once every running request holds its next token's: a draft the pool cannot hold would
        be dropped after the drafter paid for it), and the tokens the step runs anyway (every
        decode's own token, prefill chunks; at most the budget). Clears the old drafts."""
        sched = self.scheduler
        blocks_for = sched.blocks_needed
        k = self.runner.num_speculative_tokens
        wanted: list[tuple[Sequence, int]] = []
        base = 0
        spare = self.pool.num_free - sum(blocks_for(s, s.num_tokens) for s in sched.running)
        for seq in sched.running:
            seq.spec_token_ids = []
            base += max(1, seq.num_tokens - seq.num_computed)
            if (seq.prefill_only or seq.anchor_from or seq.forced_drafts
                    or seq.num_computed != seq.num_tokens - 1):
                continue
            room = min(k, seq.params.max_tokens - seq.num_output_tokens - 1,
                       self.max_model_len - seq.num_tokens)
            own = blocks_for(seq, seq.num_tokens)
            while room > 0 and blocks_for(seq, seq.num_tokens + room) - own > spare:
                room -= 1
            if room <= 0 or not self.runner.can_draft(seq):
                continue  # (no hidden window yet, say: just handed over, or recomputed)
            spare -= blocks_for(seq, seq.num_tokens + room) - own
            wanted.append((seq, room))
        return wanted, min(base, self.cfg.scheduler.max_num_batched_tokens)

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

    def read_layer_kv(self, request_id: str, layer: int, start: int, end: int):
        """Copies of one layer's K and V [end - start, kv_heads, head_dim] at a running or parked
        request's positions [start, end); for streaming a layer as soon as it is computed."""
        seq = self.seqs.get(request_id) or self.parked[request_id]
        bs = self.block_size
        return self.kv.read_slots(layer, [seq.block_table[p // bs] * bs + p % bs
                                          for p in range(start, end)])

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

    def prompt_logits(self, ids: list[int]):
        """Logits [len(ids), vocab] at every position of `ids`, one prefill through the paged
        cache in blocks held only for it (no request is queued; the prefix cache is untouched)."""
        table = self.pool.allocate(-(-len(ids) // self.block_size))
        try:
            return self.runner.prompt_logits(ids, table)
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
        out.update(self.runner.stats())
        return out

