"""The one place the simulator touches the engine's scheduler and block pool.

Owns the adapter between simulated workers and the REAL `pdserve.engine.scheduler.Scheduler`
and `BlockPool`, driven through the engine's own step seam: `plan` is the scheduler's
`schedule()`, `complete` hands the batch back through `update_from_output` with
`simulated_output` (the runner's side without a model), so token accounting, stop rules,
finishing, freeing and parking a prefill-only request's KV are the scheduler's. Also: queueing a
prompt, placing KV blocks computed elsewhere (a store fetch; a hand-over through the scheduler's
`add_prefilled`), a running request taken off and queued on another worker with its tokens (a
migration: `stop`, `resume`), and the bulk form of pure decode steps (`decode_run` /
`run_decode`). Token ids are synthesized from a request's prefix ids, and the prompt's block
hashes derived from those ids (`prompts.prompt_hashes_of`, handed to the scheduler as known),
so equal prefixes name equal blocks and the real prefix cache hits where the trace says it
should, with no token hashed.

A long queue stays small: a prompt queued behind `held` others (more than one step can take)
waits outside the scheduler as its `RequestPrompt` (a few hundred bytes, made into a sequence
as the queue drains), one behind `long_queue` others forgets its hashes until it is scheduled;
the scheduler sees the same queue in the same order, so it decides the same. With many
workers the decode workers' caches are counted per block (`_Recorder.holders`).

Must not model time (the worker does, from the profile) and must not import the engine at
module import: the scheduler module is loaded on first use.

Bulk decode: when every running sequence is one token behind (a pure decode step), nothing is
waiting and no sequence finishes or needs a block the pool lacks within the next k steps, those
k steps change the scheduler exactly as k single steps would (same tokens, same blocks
allocated from the same free list, same blocks registered); `run_decode(k)` applies them at once
(the scheduler has no bulk form: it allocates, appends and `advance`s each sequence by k, and
finishes and frees those that reach max_tokens, as `update_from_output` would).
"""

from __future__ import annotations

import itertools
from collections import deque
from typing import TYPE_CHECKING, Any

from pdserve.core.errors import QueueFullError
from pdserve.core.step_profile import step_work
from pdserve.router.kv_index import STORED
from pdserve.sim.prompts import RequestPrompt

if TYPE_CHECKING:
    from pdserve.engine.sequence import TokenIds

SAMPLED_TOKEN = 1  # the simulator's sampled token: only its count and position matter
# A `RequestPrompt` queued behind this many others forgets its hashes until it is scheduled.
LONG_QUEUE = 8
# Sampling parameters by output length, shared by every engine and request of that length
# (frozen, so sharing is safe; one per length a trace has).
_PARAMS: dict[int, Any] = {}


def leading_run(items, holds) -> int:
    """How many of the first `items` satisfy `holds`, up to the first that does not."""
    return sum(1 for _ in itertools.takewhile(holds, items))


class _Recorder:
    """Stands in for the block pool's `BlockEventLog` (`append(kind, hash)`): keeps the events
    for the router's KV index, or (`keep` False) drops them; and, given a `holders` map shared
    by several pools, counts in it how many of them cache each hash (for whoever must ask many
    pools whether any holds a block; a hash none holds leaves it)."""

    __slots__ = ("events", "keep", "holders")

    def __init__(self, keep: bool) -> None:
        self.events: list[tuple[str, bytes]] = []
        self.keep = keep
        self.holders: dict[bytes, int] | None = None

    def append(self, kind: str, block_hash: bytes) -> None:
        if self.keep:
            self.events.append((kind, block_hash))
        holders = self.holders
        if holders is not None:
            if kind == STORED:  # the pool's kinds are the index's
                holders[block_hash] = holders.get(block_hash, 0) + 1
            else:
                left = holders[block_hash] - 1
                if left:
                    holders[block_hash] = left
                else:
                    del holders[block_hash]


class PlannedStep:
    """One scheduled step: the scheduler's batch and the sizes the step-time model needs."""

    __slots__ = ("batch", "prefill_tokens", "decode_batch", "context_tokens", "cached_tokens",
                 "attn_pairs")

    def __init__(self, batch: Any, prefill_tokens: int, decode_batch: int, context_tokens: int,
                 cached_tokens: int, attn_pairs: float = 0.0) -> None:
        self.batch = batch
        self.prefill_tokens = prefill_tokens
        self.decode_batch = decode_batch
        self.context_tokens = context_tokens
        self.cached_tokens = cached_tokens
        self.attn_pairs = attn_pairs  # prefill (query, key) pairs, summed per sequence


class EngineModel:
    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int,
                 max_num_batched_tokens: int, max_waiting: int,
                 enable_prefix_caching: bool = True, record_events: bool = False) -> None:
        from pdserve.core import finish
        from pdserve.core.sampling_params import SamplingParams
        from pdserve.engine import block_pool, scheduler
        from pdserve.engine.config import SchedulerConfig

        self._Sequence = scheduler.Sequence
        self._Params = SamplingParams
        self._simulated_output = scheduler.simulated_output
        self._length, self._abort = finish.LENGTH, finish.ABORT
        self.pool = block_pool.BlockPool(num_blocks, max_events=1)
        # The pool's event log serves RPC readers on other threads (a lock and a condition per
        # event); one thread reads it here, so a plain recorder takes its place: same events.
        self.pool.events = self.recorder = _Recorder(keep=record_events)
        self.block_size = block_size
        self.sched = scheduler.Scheduler(
            SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_waiting), self.pool,
            block_size, enable_prefix_caching)
        self.seqs: dict[str, Any] = {}  # by request id, until they end (or leave parked)
        self.parked: dict[str, Any] = {}  # prefill-only sequences done, KV held for export
        # Prompts queued behind `held` others, kept as (request id, output tokens, prefill
        # only, max chunk tokens, prompt) and queued in the scheduler as its queue drains.
        self.backlog: deque[tuple[str, int, bool, int, RequestPrompt]] = deque()
        self.held = max_num_seqs + 1
        self.long_queue = LONG_QUEUE
        self.backlog_peak = 0  # the most prompts the backlog held at once

    # ---- requests in ---------------------------------------------------------------------------
    def _seq(self, rid: str, prompt: TokenIds, output_tokens: int, **kw):
        params = _PARAMS.get(output_tokens)
        if params is None:
            params = _PARAMS[output_tokens] = self._Params(max_tokens=output_tokens,
                                                           ignore_eos=True)
        seq = self._Sequence(rid, prompt, params,
                             token_ids=prompt.copy(), **kw)  # a `RunTokens` stays compact
        self.seqs[rid] = seq
        return seq

    def add(self, rid: str, prompt: TokenIds | RequestPrompt, output_tokens: int, *,
            prefill_only: bool = False, max_chunk_tokens: int = 0, known_hashes=()) -> None:
        """Queue a prompt; `known_hashes` (its full blocks' chained hashes, if the caller has
        them) spare the scheduler hashing its token ids. A `RequestPrompt` gives both, and
        queued behind many others it costs a few hundred bytes, not its tokens and a hash per
        block: behind `long_queue` its hashes are forgotten until the scheduler reads them,
        behind `held` it waits in `backlog` until the scheduler's queue drains (`plan`). The
        scheduler sees the same queue: it takes at most `max_num_seqs` of it in one step."""
        if isinstance(prompt, RequestPrompt):
            waiting = len(self.sched.waiting)
            if self.backlog or waiting >= self.held:
                if waiting + len(self.backlog) >= self.sched.cfg.max_waiting:
                    raise QueueFullError(f"waiting queue is full "
                                         f"({self.sched.cfg.max_waiting} requests)")
                prompt.forget()
                self.backlog.append((rid, output_tokens, prefill_only, max_chunk_tokens, prompt))
                self.backlog_peak = max(self.backlog_peak, len(self.backlog))
                return
            self._add_prompt(rid, output_tokens, prefill_only, max_chunk_tokens, prompt)
            return
        self.sched.add(self._seq(rid, prompt, 1 if prefill_only else output_tokens,
                                 prefill_only=prefill_only, max_chunk_tokens=max_chunk_tokens,
                                 known_hashes=known_hashes))

    def _add_prompt(self, rid: str, output_tokens: int, prefill_only: bool,
                    max_chunk_tokens: int, prompt: RequestPrompt) -> None:
        known: Any = prompt
        if len(self.sched.waiting) >= self.long_queue:
            prompt.forget()
        else:  # read soon: the list itself
            known = prompt.hashes()
        self.sched.add(self._seq(rid, prompt.token_ids(), 1 if prefill_only else output_tokens,
                                 prefill_only=prefill_only, max_chunk_tokens=max_chunk_tokens,
                                 known_hashes=known))

    def _drain_backlog(self, everything: bool = False) -> None:
        """Queue backlog prompts in the scheduler, until it holds `held` (or all of them)."""
        backlog, waiting = self.backlog, self.sched.waiting
        while backlog and (everything or len(waiting) < self.held):
            self._add_prompt(*backlog.popleft())

    def block_events(self) -> list[tuple[str, bytes]]:
        """The prefix cache's changes since the last call: (\"stored\" | \"removed\", hash)."""
        events, self.recorder.events = self.recorder.events, []
        return events

    def cached_blocks(self, hashes) -> int:
        """Leading blocks of the chain the local prefix cache holds (`BlockPool.lookup` of
        each, up to the first miss; read from its map: asked for every hand-over)."""
        cached, n = self.pool.by_hash, 0
        for h in hashes:
            if h not in cached:
                break
            n += 1
        return n

    def import_cached(self, hashes) -> int:
        """Full blocks fetched from the store into the local prefix cache (unheld, evictable)."""
        placed = 0
        for h in hashes:
            if self.pool.lookup(h) is not None:
                continue
            if self.pool.num_free == 0:
                break
            bid = self.pool.allocate_one()
            self.pool.register(bid, h)
            self.pool.release([bid])
            placed += 1
        return placed

    def add_prefilled(self, rid: str, prompt: TokenIds, hashes, output_tokens: int) -> bool:
        """Join a request prefilled elsewhere (its first token made there) through the
        scheduler's `add_prefilled`; its full blocks' `hashes` name the KV that arrived (all of
        it). False if the first token already ended it (nothing is queued)."""
        if output_tokens <= 1:
            return False
        self._drain_backlog(everything=True)  # it queues behind them
        full = len(prompt) // self.block_size
        # Named as the prefill named them, also when a preemption makes it recompute here.
        seq = self._seq(rid, prompt, output_tokens, known_hashes=list(hashes[:full]))
        seq.token_ids.append(SAMPLED_TOKEN)
        n_blocks = -(-len(prompt) // self.block_size)
        names = list(hashes[:n_blocks]) + [b""] * (n_blocks - min(n_blocks, len(hashes)))
        self.sched.add_prefilled(seq, names, [True] * n_blocks)
        return True

    # ---- requests moved with their KV (live migration), as the engine's abort and resume ------
    def movable(self) -> dict[str, int]:
        """Every request here (the backlog queued first, as the engine would hold it) and its
        tokens left to generate."""
        self._drain_backlog(everything=True)
        return {rid: seq.max_tokens - seq.num_output_tokens for rid, seq in self.seqs.items()}

    def full_blocks(self, rid: str) -> list[bytes]:
        """The hashes of the request's computed full blocks (what a copy reads), [] if it ended."""
        seq = self.seqs.get(rid)
        return [] if seq is None else list(seq.block_hashes)

    def stop(self, rid: str) -> tuple | None:
        """The request leaves between two steps, as the engine's `abort`: (its prompt, token
        ids, the prompt's known hashes, its full blocks' hashes); None if it ended."""
        seq = self.seqs.pop(rid, None)
        if seq is None:
            return None
        moved = (seq.prompt_ids, seq.token_ids, seq.known_hashes, list(seq.block_hashes))
        self.sched.finish(seq, self._abort)
        self.sched.free(seq)
        return moved

    def resume(self, rid: str, prompt, token_ids, known_hashes, output_tokens: int) -> None:
        """Queue a request moved here with the tokens it already has (the engine's
        `add_request(resume_token_ids=...)`): they count in its max_tokens and are computed
        with the prompt, from the blocks the prefix cache holds (`import_cached`) on."""
        self._drain_backlog(everything=True)  # it queues behind them
        seq = self._seq(rid, prompt, output_tokens, known_hashes=known_hashes)
        seq.token_ids = token_ids.copy()
        self.sched.add(seq)

    # ---- steps ---------------------------------------------------------------------------------
    def plan(self) -> PlannedStep | None:
        self._drain_backlog()
        batch = self.sched.schedule()
        if batch.empty:
            return None
        return PlannedStep(batch, *step_work(batch.seqs, batch.num_new))

    def complete(self, step: PlannedStep) -> list[tuple[str, str]]:
        """The step ran: [(request id, "first" | "done" | "parked")] for sequences that made
        their first token, ended, or (prefill-only) finished their prompt."""
        batch = step.batch
        if not step.prefill_tokens and not batch.preempted:
            # Every entry decodes one token (`plan`'s count): the bulk form, as `run_decode`.
            return [(rid, "done") for rid in self._decode(batch.seqs, 1)]
        events = []
        for out in self.sched.update_from_output(
                batch, self._simulated_output(batch, SAMPLED_TOKEN)):
            rid = out.request_id
            seq = self.seqs[rid]
            if out.prefill_done:
                self.parked[rid] = self.seqs.pop(rid)
                events.append((rid, "parked"))
                continue
            if seq.num_output_tokens == len(out.new_token_ids):
                events.append((rid, "first"))
            if out.finished:
                del self.seqs[rid]
                events.append((rid, "done"))
        return events

    def take_parked(self, rid: str) -> list[bytes]:
        """Free a parked prefill's KV (it went to the store); its full blocks' hashes."""
        seq = self.parked.pop(rid)
        hashes = seq.block_hashes[:seq.prompt_len // self.block_size]
        self.sched.free(seq)  # clears seq.block_hashes
        return hashes

    def decode_run(self, limit: int) -> tuple[int, int, int]:
        """(k, batch, context tokens): how many pure decode steps can run as one, up to
        `limit` (k < 2: take a normal step)."""
        sched = self.sched
        if sched.waiting or not sched.running:
            return 0, 0, 0
        bs = self.block_size
        k = limit
        ctx = 0
        for seq in sched.running:
            # One token behind with its prompt computed: a prompt chunk that stops one token
            # short of the end is not a decode (its next step makes the first token).
            done, n = seq.num_computed, len(seq.token_ids)
            if (seq.paused or done != n - 1 or seq.spec_token_ids or done < seq.prompt_len):
                return 0, 0, 0
            left = seq.max_tokens - (n - seq.prompt_len)
            if left < k:
                k = left
            ctx += done
        if k < 2 or len(sched.running) > sched.cfg.max_num_batched_tokens:
            return 0, 0, 0
        free = self.pool.num_free

        def blocks(steps: int) -> int:
            return sum(max(0, -(-(s.num_computed + steps) // bs) - len(s.block_table))
                       for s in sched.running)

        if blocks(k) > free:
            lo, hi = 0, k  # blocks(lo) fits, blocks(hi) does not
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if blocks(mid) <= free else (lo, mid)
            k = lo
        return (k, len(sched.running), ctx) if k >= 2 else (0, 0, 0)

    def run_decode(self, k: int) -> list[str]:
        """Apply k pure decode steps (see `decode_run`); the request ids that ended."""
        return self._decode(list(self.sched.running), k)

    def _decode(self, seqs: list, k: int) -> list[str]:
        """k decode steps of `seqs` (running, each one token behind, none speculating or
        prefill-only, none reaching max_tokens before the last): blocks as they fill, tokens,
        `advance`, and the scheduler's finish and free for those that end; their ids."""
        sched, bs = self.sched, self.block_size
        allocate, advance, sampled = self.pool.allocate, sched.advance, [SAMPLED_TOKEN] * k
        done = []
        for seq in seqs:
            need = -(-(seq.num_computed + k) // bs) - len(seq.block_table)
            if need > 0:
                seq.block_table.extend(allocate(need))
            seq.token_ids.extend(sampled)
            advance(seq, k)
            # Still one token behind: its tokens number num_computed + 1.
            if seq.num_computed + 1 - seq.prompt_len >= seq.max_tokens:
                sched.finish(seq, self._length)
                sched.free(seq)
                del self.seqs[seq.request_id]
                done.append(seq.request_id)
        return done

    # ---- stats ---------------------------------------------------------------------------------
    @property
    def running(self) -> int:
        return len(self.sched.running)

    @property
    def waiting(self) -> int:
        return len(self.sched.waiting) + len(self.backlog)

    @property
    def free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def total_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def prompt_tokens_computed(self) -> int:
        return self.sched.prompt_tokens_computed

    def has_work(self) -> bool:
        return self.sched.has_work() or bool(self.backlog)

    def idle(self) -> bool:
        return (not self.sched.running and not self.sched.waiting and not self.backlog
                and not self.parked)
