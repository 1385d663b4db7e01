"""Continuous batching with chunked prefill under a per-step token budget (vLLM v1 style).

Owns the waiting and running queues and, each step, which sequences run how many tokens: running
sequences first (a decode is one token, an unfinished prefill its next chunk), then new ones while
budget, sequence slots and KV blocks last. Prefill chunks and decode tokens share one batch, so a
decode worker can take a prefill chunk too. When blocks run out the newest running sequence is
preempted and later recomputed. It must not run the model or sample, and never imports torch.

A step crosses one seam: `schedule()` plans a `ScheduledBatch`, something runs it (the engine's
model and sampler, or a simulator that only models the step's time), and
`update_from_output(batch, ModelRunnerOutput)` takes the tokens drawn: it advances what has KV,
indexes completed blocks, appends tokens, applies the stop rules (EOS, stop token ids,
max_tokens, context length), finishes and frees, and returns one `StepOutput` per sequence that
produced tokens. `simulated_output` makes the runner's side without a model.

Speculative decoding: a running sequence may carry draft tokens (`spec_token_ids`, set by the
engine before `schedule`); they run after its last token in the same step, so they take budget
and KV slots like any token. Drafts are cut to fit the budget and dropped when the free blocks
cannot hold them (nothing is preempted to make room for a sequence's own drafts; drafts taken
earlier in the loop can still leave a later sequence short, which preempts as usual).
"""

from __future__ import annotations

from collections import deque

from pdserve.core.block_hash import iter_block_hashes
from pdserve.core.sampling_params import TokenLogprobs
from pdserve.engine.block_pool import BlockPool
from pdserve.engine.config import SchedulerConfig
# The seam's types; importable from here, where the seam is.
from pdserve.engine.outputs import ModelRunnerOutput, StepOutput, StopRules  # noqa: F401
from pdserve.engine.sequence import (  # noqa: F401
    QueueFullError, ScheduledBatch, Sequence, SeqStatus, check_stop, simulated_output)


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, pool: BlockPool, block_size: int,
                 enable_prefix_caching: bool = True) -> None:
        self.cfg = cfg
        self.pool = pool
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.prefix_queries_tokens = 0
        self.prefix_hits_tokens = 0
        self.prompt_tokens_computed = 0  # run through the model, not served from a cache
        self.preemptions = 0  # sequences sent back to waiting to free their blocks

    def add(self, seq: Sequence) -> None:
        if len(seq.known_hashes) > len(seq.prompt_ids) // self.block_size:
            raise ValueError(f"known_hashes: {len(seq.known_hashes)} hashes for a prompt of "
                             f"{len(seq.prompt_ids) // self.block_size} full blocks")
        self._check_room()
        self.waiting.append(seq)

    def _hashes(self, seq: Sequence, end_block: int, first: int = 0,
                parent: bytes | None = None):
        """The chained hashes of seq's full blocks `first` .. `end_block` - 1 (`parent`: the
        hash of block `first` - 1): the caller's `known_hashes` where they reach, then hashed
        from the token ids. Lazy, so a prefix lookup stops at its first miss."""
        known = seq.known_hashes
        k = min(end_block, len(known))
        for i in range(first, k):
            yield known[i]
        if end_block > max(first, k):
            if k > first:
                first, parent = k, known[k - 1]
            yield from iter_block_hashes(seq.token_ids, self.block_size, seq.salt, first=first,
                                         parent=parent, end_block=end_block)

    def _check_room(self) -> None:
        if len(self.waiting) >= self.cfg.max_waiting:
            raise QueueFullError(f"waiting queue is full ({self.cfg.max_waiting} requests)")

    def add_prefilled(self, seq: Sequence, block_hashes: list[bytes],
                      has_data: list[bool], *, approximate: bool = False) -> list[tuple[int, int]]:
        """Queue a sequence whose prompt was prefilled elsewhere (its first token appended),
        holding the leading run of its prompt's blocks that can be placed here: a full block
        the pool already caches by its hash, else one with data (`has_data[i]`) while blocks
        are free. Whatever is not placed is recomputed, so a lost block costs time, never a
        wrong token. Returns (index in `block_hashes`, block id) of the blocks whose data the
        caller writes.

        If the first token already ends the sequence it is finished and freed at once (its
        `finish_reason` says why). `approximate` (anchor-precision data) keeps its blocks out of
        the prefix cache and makes it decode drafts on them until the exact KV lands."""
        self._check_room()  # before taking blocks, so that a refusal holds none
        full = seq.prompt_len // self.block_size
        table, writes = self.pool.place(block_hashes, has_data, full,
                                        self.enable_prefix_caching and not approximate)
        seq.block_table.extend(table)
        seq.block_hashes.extend(block_hashes[:min(len(table), full)])
        # A trailing partial block is only valid up to the prompt's end; it is never treated
        # as cached (no hash is registered for it).
        seq.num_computed = min(len(seq.block_table) * self.block_size, seq.prompt_len)
        seq.num_cached_tokens = seq.num_computed
        self.waiting.append(seq)
        if check_stop(seq, seq.token_ids[-1]):
            self.finish(seq, seq.finish_reason)
            self.free(seq)
        elif approximate:
            seq.anchor_from = seq.num_tokens
        return writes

    def has_work(self) -> bool:
        return bool(self.waiting) or any(not s.paused for s in self.running)

    def blocks_needed(self, seq: Sequence, upto_tokens: int) -> int:
        """New blocks `seq` needs to hold positions [0, upto_tokens)."""
        return max(0, -(-upto_tokens // self.block_size) - len(seq.block_table))

    @staticmethod
    def _chunk(seq: Sequence, remaining: int, budget: int) -> int:
        """Own tokens `seq` runs this step: its remaining ones, within the budget and its cap."""
        n = min(remaining, budget)
        return min(n, seq.max_chunk_tokens) if seq.max_chunk_tokens > 0 else n

    def _preempt(self, seq: Sequence) -> None:
        self.preemptions += 1
        self.running.remove(seq)
        self.free(seq)
        self._reset_to_recompute(seq)
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)

    def _release_waiting(self, head: Sequence, want_free: int) -> bool:
        """Nothing runs and the head of the queue cannot get its blocks because sequences
        queued behind it hold them (KV placed when they were handed over): those give their
        blocks back, newest first, and will recompute (their full blocks stay in the prefix
        cache, so mostly they find them again). Without this the queue would wait forever.
        Returns whether the head fits now."""
        for seq in reversed(self.waiting):
            if self.pool.num_free >= want_free:
                break
            if seq is head or not seq.block_table:
                continue
            self.free(seq)
            self._reset_to_recompute(seq)
        return self.pool.num_free >= want_free

    @staticmethod
    def _reset_to_recompute(seq: Sequence) -> None:
        seq.num_computed = 0
        seq.spec_token_ids = []
        if seq.anchor_from:  # recomputing makes the KV exact: drafts made on the anchor go
            del seq.token_ids[seq.anchor_from:]
            seq.anchor_from = 0
            seq.paused = False
        seq.forced_drafts = []

    def free(self, seq: Sequence) -> None:
        self.pool.release(seq.block_table)
        seq.block_table = []
        seq.block_hashes = []

    def _match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks for the longest cached prefix; at least one token is left to compute."""
        hits: list[int] = []
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return hits  # prompt logprobs need every prompt position computed
        max_blocks = (seq.num_tokens - 1) // self.block_size
        for h in self._hashes(seq, max_blocks):
            bid = self.pool.lookup(h)
            if bid is None:
                break
            hits.append(bid)
        return hits

    def schedule(self) -> ScheduledBatch:
        budget = self.cfg.max_num_batched_tokens
        out = ScheduledBatch([], [], [])
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SeqStatus.RUNNING or seq.paused:
                continue  # preempted earlier in this loop, or waiting for its exact KV
            n = self._chunk(seq, seq.num_tokens - seq.num_computed, budget)
            if seq.spec_token_ids:
                keep = min(len(seq.spec_token_ids), budget - n)
                if self.blocks_needed(seq, seq.num_computed + n + keep) > self.pool.num_free:
                    keep = 0
                seq.spec_token_ids = seq.spec_token_ids[:keep]
                n += keep
            need = self.blocks_needed(seq, seq.num_computed + n)
            while need > self.pool.num_free:
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                continue
            if need:  # most decode steps need none
                seq.block_table.extend(self.pool.allocate(need))
            out.seqs.append(seq)
            out.num_new.append(n)
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            seq = self.waiting[0]
            hits: list[int] = []
            if not seq.block_table:
                hits = self._match_prefix(seq)
            start = seq.num_computed if seq.block_table else len(hits) * self.block_size
            n = self._chunk(seq, seq.num_tokens - start, budget)
            need = max(0, -(-(start + n) // self.block_size) - len(seq.block_table) - len(hits))
            # Cached hits with no holder sit in the free list; taking them uses that room.
            idle_hits = sum(1 for b in hits if self.pool.ref[b] == 0)
            if need > self.pool.num_free - idle_hits and not (
                    not self.running and not out.seqs
                    and self._release_waiting(seq, need + idle_hits)):
                break
            self.waiting.popleft()
            if not seq.block_table:
                for b in hits:
                    self.pool.take_cached(b)
                seq.block_table = list(hits)
                seq.num_computed = start
                self._note_prefix(seq, len(hits))
            seq.block_table.extend(self.pool.allocate(need))
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            out.seqs.append(seq)
            out.num_new.append(n)
            budget -= n
        return out

    def _note_prefix(self, seq: Sequence, n_hit_blocks: int) -> None:
        prompt_len = len(seq.prompt_ids)
        self.prefix_queries_tokens += prompt_len
        hit_tokens = min(n_hit_blocks * self.block_size, prompt_len)
        self.prefix_hits_tokens += hit_tokens
        if not seq.num_output_tokens:  # a recompute after preemption is not a user-visible cache hit
            seq.num_cached_tokens = hit_tokens
        # The hit blocks' hashes are the first entries of the chain.
        seq.block_hashes = list(self._hashes(seq, n_hit_blocks))

    def trim_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Release the blocks past those holding positions [0, num_tokens): after verification,
        the slots of rejected drafts. Those blocks were allocated for the drafts this step, so
        they are never cached or shared."""
        keep = -(-num_tokens // self.block_size)
        if len(seq.block_table) > keep:
            self.pool.release(seq.block_table[keep:])
            del seq.block_table[keep:]

    def advance(self, seq: Sequence, n: int) -> None:
        """After a step: `n` more of seq's tokens have KV. Counts the prompt's among them and
        indexes the blocks they completed."""
        done, prompt_len = seq.num_computed, seq.prompt_len
        if done < prompt_len:
            self.prompt_tokens_computed += min(done + n, prompt_len) - done
        seq.num_computed = done = done + n
        if done // self.block_size > len(seq.block_hashes):  # most decode steps complete none
            self.register_full_blocks(seq)

    def register_full_blocks(self, seq: Sequence) -> None:
        """After a step: index every newly completed block so later prompts can share it."""
        n_full = seq.num_computed // self.block_size
        first = len(seq.block_hashes)
        if n_full <= first:  # most decode steps complete no block
            return
        hashes, table = seq.block_hashes, seq.block_table
        parent = hashes[-1] if hashes else None
        register = self.pool.register if self.enable_prefix_caching and not seq.anchor_from \
            else None  # approximate KV: not cached
        for i, h in enumerate(self._hashes(seq, n_full, first, parent), start=first):
            # Hashes are kept even with caching off: exporting KV names blocks by them.
            hashes.append(h)
            if register is not None:
                register(table[i], h)

    def finish(self, seq: Sequence, reason: str | None) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        seq.spec_token_ids = []

    # ---- the result of a step ----------------------------------------------------------
    def update_from_output(self, batch: ScheduledBatch,
                           output: ModelRunnerOutput) -> list[StepOutput]:
        """Take what running `batch` produced: every entry's own tokens now have KV (drafts
        count once accepted), and the tokens drawn are appended under the stop rules. Returns
        one StepOutput per sequence that emitted tokens; a sequence decoding drafts on anchor
        KV emits nothing. Finished sequences leave the queues and free their blocks, except a
        prefill-only one, whose blocks stay held for export (`prefill_done`)."""
        sampled = output.sampled_token_ids
        if len(sampled) != len(batch.seqs):
            raise ValueError(f"sampled_token_ids: {len(sampled)} entries for a batch of "
                             f"{len(batch.seqs)} sequences")
        if output.logprobs is not None and len(output.logprobs) != len(sampled):
            raise ValueError(f"logprobs: {len(output.logprobs)} entries for a batch of "
                             f"{len(sampled)} sequences")
        # A sequence that left (aborted) between the plan and its result is skipped.
        live = [seq.status is SeqStatus.RUNNING for seq in batch.seqs]
        for i, (seq, n, ok) in enumerate(zip(batch.seqs, batch.num_new, live)):
            if ok:
                self.advance(seq, n - len(seq.spec_token_ids))
                got = output.prompt_logprobs[i] if output.prompt_logprobs else None
                if got is not None and got[0] <= 1 + len(seq.prompt_lps):
                    seq.prompt_lps.extend(got[1][1 + len(seq.prompt_lps) - got[0]:])
        outputs: list[StepOutput] = []
        for i, (seq, toks, ok) in enumerate(zip(batch.seqs, sampled, live)):
            if not ok or not toks:
                continue
            if seq.anchor_from:
                self._draft_on_anchor(seq, toks[0])
                continue
            lps = output.logprobs[i] if output.logprobs is not None else None
            outputs.append(self._emit(seq, list(toks), lps))
        return outputs

    def _emit(self, seq: Sequence, toks: list[int],
              lps: list[TokenLogprobs] | None) -> StepOutput:
        drafts = len(seq.spec_token_ids)
        if not 1 <= len(toks) <= drafts + 1:
            raise ValueError(f"sampled_token_ids: {len(toks)} tokens for {seq.request_id!r}, "
                             f"which ran {drafts} drafts")
        seq.spec_token_ids = []
        new: list[int] = []
        for tok in toks:
            seq.token_ids.append(tok)
            new.append(tok)
            if check_stop(seq, tok):
                break
        done = seq.finish_reason is not None
        out = StepOutput(seq.request_id, new, done, seq.finish_reason, seq.prompt_len,
                         seq.num_cached_tokens, prefill_done=seq.prefill_only,
                         logprobs=list(lps[:len(new)]) if lps is not None else None)
        if seq.params.prompt_logprobs is not None and seq.num_output_tokens == len(new):
            out.prompt_logprobs, seq.prompt_lps = seq.prompt_lps, []
        if seq.prefill_only:
            self.finish(seq, seq.finish_reason)  # its blocks stay held: the KV waits for export
        elif done:
            self.finish(seq, seq.finish_reason)
            self.free(seq)
        elif drafts:
            seq.num_computed += len(toks) - 1  # accepted drafts' KV was computed on the true prefix
            self.register_full_blocks(seq)
            self.trim_blocks(seq, seq.num_computed)
        return out

    @staticmethod
    def _draft_on_anchor(seq: Sequence, tok: int) -> None:
        """A token decoded on anchor-precision KV: kept as a draft, not emitted. Drafting
        pauses at a stop token or once the verification could not take more."""
        seq.token_ids.append(tok)
        p, rules = seq.params, seq.stop_rules
        n = seq.num_tokens - seq.anchor_from
        if (n >= rules.max_anchor_drafts or (tok in rules.eos_ids and not p.ignore_eos)
                or tok in p.stop_token_ids
                or seq.num_output_tokens >= p.max_tokens
                or seq.num_tokens >= rules.max_model_len):
            seq.paused = True
