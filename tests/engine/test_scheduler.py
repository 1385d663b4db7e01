"""Scheduler: continuous batching and chunked prefill under a token budget, prefix hits, preemption.

No model: `engine_step` hands a batch's result back through the seam `LLMEngine.step` uses
(`Scheduler.update_from_output`) with synthetic tokens, so every policy decision is checked on
plain data.
"""

from __future__ import annotations

import itertools
from dataclasses import fields

import pytest

from pdserve.engine.block_pool import BlockPool
from pdserve.engine.config import SchedulerConfig
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.scheduler import (
    ModelRunnerOutput,
    QueueFullError,
    ScheduledBatch,
    Scheduler,
    SeqStatus,
    Sequence,
)

_ids = itertools.count()


def make_scheduler(**overrides) -> Scheduler:
    """Defaults: 64 blocks of 4 tokens, budget 2048, 64 sequences. Overrides name a
    SchedulerConfig field, or num_blocks / block_size / enable_prefix_caching."""
    num_blocks = overrides.pop("num_blocks", 64)
    block_size = overrides.pop("block_size", 4)
    caching = overrides.pop("enable_prefix_caching", True)
    names = {f.name for f in fields(SchedulerConfig)}
    assert set(overrides) <= names, f"unknown overrides {set(overrides) - names}"
    return Scheduler(SchedulerConfig(**overrides), BlockPool(num_blocks), block_size, caching)


def make_seq(prompt: int | list[int] = 8, *, max_tokens: int = 4, salt: str = "",
             request_id: str | None = None) -> Sequence:
    """A sequence with `prompt` token ids (or that many distinct synthetic ones)."""
    if isinstance(prompt, int):
        base = 1000 * (next(_ids) + 1)
        prompt = list(range(base, base + prompt))
    rid = request_id or f"seq-{next(_ids)}"
    return Sequence(rid, list(prompt), SamplingParams(max_tokens=max_tokens), salt=salt)


def engine_step(sched: Scheduler, batch: ScheduledBatch) -> list[Sequence]:
    """Apply a scheduled batch as the engine does; returns the sequences that finished."""
    for seq, n in zip(batch.seqs, batch.num_new):
        assert n >= 1
        # The block table always covers what runs this step.
        assert len(seq.block_table) * sched.block_size >= seq.num_computed + n
    # A synthetic "sampled" token for each sequence whose last token is computed.
    sampled = [[7 + len(seq.output_ids)] if batch.samples(i) else []
               for i, seq in enumerate(batch.seqs)]
    sched.update_from_output(batch, ModelRunnerOutput(sampled))
    return [seq for seq in batch.seqs if seq.status is SeqStatus.FINISHED]


def check_pool(sched: Scheduler) -> None:
    """Every hold on a block belongs to a live sequence's block table, and vice versa."""
    held = [0] * sched.pool.num_blocks
    for seq in list(sched.running) + list(sched.waiting):
        for b in seq.block_table:
            held[b] += 1
    assert held == sched.pool.ref
    assert sched.pool.num_free == sum(1 for r in sched.pool.ref if r == 0)


def run_to_completion(sched: Scheduler, max_steps: int = 1000) -> list[ScheduledBatch]:
    batches = []
    for _ in range(max_steps):
        if not sched.has_work():
            return batches
        batch = sched.schedule()
        assert not batch.empty, "work left but nothing scheduled"
        batches.append(batch)
        engine_step(sched, batch)
        check_pool(sched)
    raise AssertionError("did not finish")


# ---- token budget, chunked prefill, mixed batches -------------------------------------------------

@pytest.mark.parametrize("budget", [1, 3, 10, 64])
def test_token_budget_respected_every_step(budget):
    sched = make_scheduler(max_num_batched_tokens=budget)
    seqs = [make_seq(n, max_tokens=3) for n in (1, 5, 17, 30, 9)]
    for s in seqs:
        sched.add(s)
    batches = run_to_completion(sched)
    for b in batches:
        assert sum(b.num_new) <= budget
        assert len(b.seqs) == len(set(id(s) for s in b.seqs))
    assert all(s.status is SeqStatus.FINISHED and len(s.output_ids) == 3 for s in seqs)
    # Every prompt token and every output token but the last ran exactly once (no preemption).
    total = sum(len(s.prompt_ids) + 2 for s in seqs)
    assert sum(sum(b.num_new) for b in batches) == total
    assert sched.pool.num_free == sched.pool.num_blocks


def test_long_prompt_is_chunked_while_running_decodes_get_a_token_each_step():
    sched = make_scheduler(max_num_batched_tokens=8)
    short = make_seq(3, max_tokens=20)
    sched.add(short)
    engine_step(sched, sched.schedule())  # short prefilled; it decodes from now on
    long = make_seq(50, max_tokens=1)
    sched.add(long)
    chunks = []
    while long.status is not SeqStatus.FINISHED:
        batch = sched.schedule()
        assert sum(batch.num_new) <= 8
        by_seq = dict(zip((s.request_id for s in batch.seqs), batch.num_new))
        assert by_seq[short.request_id] == 1  # the decode is never stalled by the prefill
        assert batch.seqs[0] is short  # running sequences are served first
        chunks.append(by_seq[long.request_id])
        engine_step(sched, batch)
    assert chunks == [7] * 7 + [1]
    assert sum(chunks) == 50 and short.status is SeqStatus.RUNNING


def test_chunked_prefill_samples_only_after_the_last_chunk():
    sched = make_scheduler(max_num_batched_tokens=4)
    seq = make_seq(10, max_tokens=2)
    sched.add(seq)
    for expect_computed in (4, 8):
        engine_step(sched, sched.schedule())
        assert seq.num_computed == expect_computed and seq.output_ids == []
    batch = sched.schedule()
    assert batch.num_new == [2]
    engine_step(sched, batch)
    assert len(seq.output_ids) == 1
    assert sched.schedule().num_new == [1]  # then a plain decode


def test_chunk_cap_bounds_a_prompt_every_step_while_a_decode_runs_every_step():
    sched = make_scheduler(max_num_batched_tokens=64)
    short = make_seq(3, max_tokens=30)
    sched.add(short)
    engine_step(sched, sched.schedule())
    capped = make_seq(50, max_tokens=3)
    capped.max_chunk_tokens = 8
    sched.add(capped)
    chunks = []
    while not capped.output_ids:
        batch = sched.schedule()
        by_seq = dict(zip((s.request_id for s in batch.seqs), batch.num_new))
        assert by_seq[short.request_id] == 1
        chunks.append(by_seq[capped.request_id])
        engine_step(sched, batch)
    # The first chunk is admitted, the rest run as a running sequence's: both capped, though
    # the budget had room for the whole prompt.
    assert chunks == [8] * 6 + [2]
    assert sched.prompt_tokens_computed == 3 + 50
    # Past its prompt the cap changes nothing: one decode token, plus its drafts.
    capped.spec_token_ids = [11, 12, 13]
    batch = sched.schedule()
    assert batch.num_new[batch.seqs.index(capped)] == 4


def test_chunk_cap_of_one_still_completes_the_prompt():
    sched = make_scheduler(max_num_batched_tokens=4)
    seq = make_seq(5, max_tokens=2)
    seq.max_chunk_tokens = 1
    sched.add(seq)
    batches = run_to_completion(sched)
    assert [b.num_new for b in batches] == [[1]] * 6
    assert seq.status is SeqStatus.FINISHED and len(seq.output_ids) == 2


def test_prompt_tokens_computed_leaves_out_prefix_hits():
    sched = make_scheduler(block_size=4)
    prefix = list(range(800, 812))  # 3 full blocks
    finish_one(sched, prefix + [1, 2])
    assert sched.prompt_tokens_computed == 14
    finish_one(sched, prefix + [3, 4, 5])
    assert sched.prompt_tokens_computed == 14 + 3


def test_max_num_seqs_respected_and_admission_is_fifo():
    sched = make_scheduler(max_num_seqs=2)
    seqs = [make_seq(4, max_tokens=2) for _ in range(5)]
    for s in seqs:
        sched.add(s)
    first = sched.schedule()
    assert first.seqs == seqs[:2] and list(sched.waiting) == seqs[2:]
    engine_step(sched, first)
    finish_order = []
    while sched.has_work():
        batch = sched.schedule()
        assert len(batch.seqs) <= 2 and len(sched.running) <= 2
        finish_order += engine_step(sched, batch)
    assert finish_order == seqs


def test_bounded_waiting_queue_raises_queue_full():
    sched = make_scheduler(max_waiting=2)
    sched.add(make_seq())
    sched.add(make_seq())
    with pytest.raises(QueueFullError, match="2"):
        sched.add(make_seq())
    assert len(sched.waiting) == 2
    engine_step(sched, sched.schedule())  # admitting frees queue room
    sched.add(make_seq())
    assert len(sched.waiting) == 1


def test_waiting_sequence_stays_queued_until_blocks_free_up():
    sched = make_scheduler(num_blocks=4)
    a = make_seq(12, max_tokens=3)  # 3 blocks, a 4th for its output
    b = make_seq(8, max_tokens=1)  # 2 blocks: does not fit next to a
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    assert batch.seqs == [a] and list(sched.waiting) == [b] and batch.preempted == []
    run_to_completion(sched)
    assert a.status is b.status is SeqStatus.FINISHED


# ---- prefix hits -----------------------------------------------------------------------------------

def finish_one(sched: Scheduler, prompt: list[int], salt: str = "") -> Sequence:
    seq = make_seq(prompt, max_tokens=1, salt=salt)
    sched.add(seq)
    run_to_completion(sched)
    return seq


def test_prefix_hit_skips_cached_full_blocks():
    sched = make_scheduler(block_size=4)
    prefix = list(range(500, 512))  # 3 full blocks
    first = finish_one(sched, prefix + [1, 2])
    assert sched.prefix_hits_tokens == 0
    second = make_seq(prefix + [3, 4, 5], max_tokens=1)
    sched.add(second)
    batch = sched.schedule()
    assert batch.num_new == [3] and second.num_computed == 12
    assert second.num_cached_tokens == 12 and sched.prefix_hits_tokens == 12
    assert sched.prefix_queries_tokens == len(first.prompt_ids) + 15
    # The hit blocks are shared (held once more), the tail gets a fresh block.
    assert all(sched.pool.ref[b] == 1 for b in second.block_table)
    assert len(second.block_table) == 4 and len(second.block_hashes) == 3
    engine_step(sched, batch)
    assert second.block_hashes[:3] == [sched.pool.block_hash[b] for b in second.block_table[:3]]


def test_prefix_hit_always_leaves_a_token_to_compute():
    sched = make_scheduler(block_size=4)
    prompt = list(range(600, 608))  # exactly 2 full blocks
    finish_one(sched, prompt)
    again = make_seq(prompt, max_tokens=1)
    sched.add(again)
    batch = sched.schedule()
    # Both blocks are cached, but the last token must run to produce logits: only block 0 is used.
    assert again.num_computed == 4 and batch.num_new == [4]
    one_more = make_seq(prompt + [9], max_tokens=1)
    sched.add(one_more)
    assert sched.schedule().num_new[-1] == 1 and one_more.num_computed == 8


def test_prefix_hit_is_per_tenant():
    sched = make_scheduler(block_size=4)
    prompt = list(range(700, 712))
    finish_one(sched, prompt + [1], salt="tenant-a")
    other = make_seq(prompt + [1], max_tokens=1, salt="tenant-b")
    sched.add(other)
    sched.schedule()
    assert other.num_computed == 0 and other.num_cached_tokens == 0
    same = make_seq(prompt + [1], max_tokens=1, salt="tenant-a")
    sched.add(same)
    sched.schedule()
    assert same.num_cached_tokens == 12


def test_prefix_caching_off_never_hits_or_indexes():
    sched = make_scheduler(block_size=4, enable_prefix_caching=False)
    prompt = list(range(800, 812))
    first = make_seq(prompt + [1], max_tokens=2)
    sched.add(first)
    engine_step(sched, sched.schedule())
    assert len(first.block_hashes) == 3  # still computed: exported KV is named by them
    assert sched.pool.stats().num_cached == 0
    run_to_completion(sched)
    again = make_seq(prompt + [1], max_tokens=1)
    sched.add(again)
    sched.schedule()
    assert again.num_computed == 0 and sched.prefix_hits_tokens == 0


def test_prefix_hit_on_evictable_blocks_counts_their_room():
    # 4 blocks, 3 of them cached and idle: a prompt hitting those 3 needs only 1 more block.
    sched = make_scheduler(num_blocks=4, block_size=4)
    prefix = list(range(900, 912))
    finish_one(sched, prefix + [1])
    seq = make_seq(prefix + [2, 3], max_tokens=2)
    sched.add(seq)
    batch = sched.schedule()
    assert batch.seqs == [seq] and seq.num_cached_tokens == 12
    assert sched.pool.evictions == 0
    run_to_completion(sched)


# ---- preemption ------------------------------------------------------------------------------------

def test_newest_running_sequence_is_preempted_when_blocks_run_out():
    sched = make_scheduler(num_blocks=4, block_size=4)
    old = make_seq(4, max_tokens=8)
    new = make_seq(4, max_tokens=8)
    sched.add(old)
    sched.add(new)
    engine_step(sched, sched.schedule())  # both prefilled: 1 block each, 2 free
    assert sched.running == [old, new]
    for _ in range(3):  # decodes fill the second block of each (positions 4..6)
        engine_step(sched, sched.schedule())
    assert len(old.block_table) == len(new.block_table) == 2 and sched.pool.num_free == 0
    new_blocks = list(new.block_table)
    batch = sched.schedule()  # position 7 fits; no preemption yet
    assert batch.preempted == []
    engine_step(sched, batch)
    batch = sched.schedule()  # position 8 needs a third block each: only old can have one
    assert batch.preempted == [new] and batch.seqs == [old]
    assert new.status is SeqStatus.WAITING and sched.waiting[0] is new
    assert new.block_table == [] and new.num_computed == 0
    # Its two blocks went back to the pool; old's third block is one of them.
    assert sched.pool.num_free == 1 and old.block_table[2] in new_blocks
    assert new.output_ids == [7, 8, 9, 10, 11]  # output so far is kept and recomputed later
    engine_step(sched, batch)
    check_pool(sched)
    run_to_completion(sched)
    assert old.output_ids == new.output_ids == list(range(7, 15))
    assert sched.pool.num_free == 4


def test_preempted_sequence_goes_to_the_front_of_the_queue():
    sched = make_scheduler(num_blocks=3, block_size=2, max_num_seqs=2)
    a, b = make_seq(2, max_tokens=4), make_seq(2, max_tokens=4)
    queued = make_seq(2, max_tokens=1)
    for s in (a, b):
        sched.add(s)
    engine_step(sched, sched.schedule())  # 1 block each, 1 free
    sched.add(queued)  # max_num_seqs keeps it waiting
    batch = sched.schedule()  # a takes the free block; b needs one too and is preempted
    assert batch.seqs == [a] and batch.preempted == [b]
    assert list(sched.waiting) == [b, queued]  # b is not re-admitted ahead of its blocks
    engine_step(sched, batch)
    run_to_completion(sched)
    assert all(s.status is SeqStatus.FINISHED for s in (a, b, queued))


def test_preemption_can_preempt_the_sequence_itself():
    # The only running sequence cannot grow: it is preempted rather than crashing, and the
    # step schedules nothing for it.
    sched = make_scheduler(num_blocks=2, block_size=2)
    seq = make_seq(3, max_tokens=1)
    sched.add(seq)
    engine_step(sched, sched.schedule())
    assert seq.status is SeqStatus.FINISHED
    blocker = sched.pool.allocate(1)  # someone else (say a parked export) holds a block
    seq2 = make_seq(2, max_tokens=3)
    sched.add(seq2)
    engine_step(sched, sched.schedule())  # prompt fills block 0; the next token needs block 1
    batch = sched.schedule()
    assert batch.seqs == [] and batch.preempted == [seq2]
    assert sched.waiting[0] is seq2 and sched.pool.num_free == 1
    sched.pool.release(blocker)
    run_to_completion(sched)
    assert seq2.status is SeqStatus.FINISHED
