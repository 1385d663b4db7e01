"""The scheduler driven alone through its seam, as a simulator drives it: `schedule()` plans a
step, `simulated_output` stands in for the model, `update_from_output` applies the result.

No torch and no model: continuous batching, chunked prefill, preemption in a tiny block pool,
prefix hits, speculation, prefill-only requests and the stop rules are checked on plain data, and
every token run is accounted for.
"""

from __future__ import annotations

import random

import pytest

from pdserve.core import finish
from pdserve.core.block_hash import prompt_block_hashes
from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.block_pool import BlockPool
from pdserve.engine.config import SchedulerConfig
from pdserve.engine.scheduler import (ModelRunnerOutput, QueueFullError, Scheduler, SeqStatus,
                                      Sequence, StopRules, simulated_output)

BS = 4  # tokens per block


def make_scheduler(num_blocks: int = 64, budget: int = 64, max_seqs: int = 8) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget)
    return Scheduler(cfg, BlockPool(num_blocks), BS, enable_prefix_caching=True)


def make_seq(rid: str, prompt: list[int], max_tokens: int, **kw) -> Sequence:
    return Sequence(rid, list(prompt), SamplingParams(max_tokens=max_tokens), **kw)


def check_pool(sched: Scheduler, parked: list[Sequence] = ()) -> None:
    """Every hold on a block belongs to a live (or parked) sequence's block table."""
    held = [0] * sched.pool.num_blocks
    for seq in [*sched.running, *sched.waiting, *parked]:
        for b in seq.block_table:
            held[b] += 1
    assert held == sched.pool.ref


def test_many_steps_of_continuous_batching_account_for_every_token():
    """A stream of requests through a pool too small for them all: prompts are chunked,
    running requests are preempted and recomputed, repeated prefixes hit the cache, and in the
    end every request emitted exactly max_tokens tokens and every token run is accounted for:
    tokens run = KV held at the end + KV dropped by preemption - KV served from the cache."""
    rng = random.Random(7)
    sched = make_scheduler(num_blocks=14, budget=12, max_seqs=4)
    shared = list(range(900, 912))  # three full blocks several prompts start with
    arrivals: dict[int, list[Sequence]] = {}
    for i in range(24):
        head = shared if i % 3 == 0 else []
        body = [rng.randrange(1, 800) for _ in range(rng.randrange(2, 14))]
        seq = make_seq(f"r{i}", head + body, max_tokens=rng.randrange(1, 9))
        arrivals.setdefault(rng.randrange(0, 40), []).append(seq)
    every = [s for group in arrivals.values() for s in group]
    emitted: dict[str, list[int]] = {s.request_id: [] for s in every}
    reasons: dict[str, str] = {}
    steps_with_prompt: dict[str, int] = {s.request_id: 0 for s in every}
    run = dropped = cached = 0
    preemptions = 0
    step = 0
    while step < 40 or sched.has_work():
        for seq in arrivals.get(step, []):
            sched.add(seq)
        step += 1
        assert step < 2000, "did not finish"
        before = {id(s): s.num_computed for s in sched.running}
        batch = sched.schedule()
        if batch.empty:
            continue
        assert sum(batch.num_new) <= 12 and len(batch.seqs) <= 4
        for v in batch.preempted:
            dropped += before[id(v)]
            preemptions += 1
        for seq, n in zip(batch.seqs, batch.num_new):
            if id(seq) not in before:  # admitted this step: what it starts with came cached
                cached += seq.num_computed
            assert len(seq.block_table) * BS >= seq.num_computed + n
            if seq.num_computed < len(seq.prompt_ids):
                steps_with_prompt[seq.request_id] += 1
            run += n
        for out in sched.update_from_output(batch, simulated_output(batch, token_id=5)):
            emitted[out.request_id] += out.new_token_ids
            if out.finished:
                reasons[out.request_id] = out.finish_reason
        check_pool(sched)
    for seq in every:
        assert seq.status is SeqStatus.FINISHED
        assert emitted[seq.request_id] == seq.output_ids == [5] * seq.params.max_tokens
        assert reasons[seq.request_id] == finish.LENGTH
    # KV held at the end: all but each sequence's last token, which is never run.
    held = sum(s.num_computed for s in every)
    assert held == sum(s.num_tokens - 1 for s in every)
    assert run == held + dropped - cached
    assert preemptions > 0 and dropped > 0  # the pool was too small
    assert cached > 0 and any(s.num_cached_tokens for s in every)  # the shared prefix hit
    assert max(steps_with_prompt.values()) > 1  # some prompt took several chunks
    assert sched.pool.num_free == sched.pool.num_blocks  # everything freed


def test_prefix_hit_runs_only_the_uncached_tail():
    sched = make_scheduler()
    prompt = list(range(100, 110))  # two full blocks and a partial one
    first = make_seq("a", prompt, max_tokens=1)
    sched.add(first)
    batch = sched.schedule()
    assert sched.update_from_output(batch, simulated_output(batch))[0].finished
    second = make_seq("b", prompt, max_tokens=2)
    sched.add(second)
    batch = sched.schedule()
    assert batch.num_new == [len(prompt) - 2 * BS]
    out = sched.update_from_output(batch, simulated_output(batch))
    assert out[0].num_cached_tokens == 2 * BS and not out[0].finished


def test_accepted_drafts_advance_and_rejected_slots_are_given_back():
    sched = make_scheduler()
    seq = make_seq("s", list(range(10, 17)), max_tokens=20)
    sched.add(seq)
    batch = sched.schedule()
    sched.update_from_output(batch, simulated_output(batch, token_id=1))  # prefill: 7 + 1 token
    seq.spec_token_ids = [2, 3, 4, 5, 6]
    batch = sched.schedule()
    assert batch.num_new == [6]  # its own token and five drafts
    outs = sched.update_from_output(batch, simulated_output(batch, token_id=9, accepted_drafts=2))
    assert outs[0].new_token_ids == [2, 3, 9]
    assert seq.output_ids == [1, 2, 3, 9] and seq.spec_token_ids == []
    assert seq.num_computed == seq.num_tokens - 1  # the own token and two drafts have KV
    assert len(seq.block_table) == -(-seq.num_computed // BS)  # rejected drafts' slots freed
    check_pool(sched)


def test_a_stop_rule_cuts_accepted_drafts():
    sched = make_scheduler()
    rules = StopRules(eos_ids=frozenset({50}))
    seq = make_seq("s", list(range(10, 15)), max_tokens=20, stop_rules=rules)
    sched.add(seq)
    batch = sched.schedule()
    sched.update_from_output(batch, simulated_output(batch, token_id=1))
    seq.spec_token_ids = [2, 50, 4]
    batch = sched.schedule()
    outs = sched.update_from_output(batch, ModelRunnerOutput([[2, 50, 4, 8]]))
    assert outs[0].new_token_ids == [2, 50]
    assert outs[0].finished and outs[0].finish_reason == finish.STOP
    assert seq.status is SeqStatus.FINISHED and not seq.block_table
    assert sched.pool.num_free == sched.pool.num_blocks


def test_max_tokens_and_context_length_end_a_request():
    sched = make_scheduler()
    a = make_seq("a", [1, 2, 3], max_tokens=2)
    b = make_seq("b", [1, 2, 3, 4], max_tokens=50, stop_rules=StopRules(max_model_len=6))
    for s in (a, b):
        sched.add(s)
    reasons = {}
    while sched.has_work():
        batch = sched.schedule()
        for out in sched.update_from_output(batch, simulated_output(batch, token_id=7)):
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    assert reasons == {"a": finish.LENGTH, "b": finish.LENGTH}
    assert a.output_ids == [7, 7] and b.num_tokens == 6


def test_prefill_only_request_stops_after_its_first_token_and_keeps_its_blocks():
    sched = make_scheduler(budget=4)
    seq = make_seq("p", list(range(30, 40)), max_tokens=8, prefill_only=True)
    sched.add(seq)
    outs = []
    while sched.has_work():
        batch = sched.schedule()
        outs += sched.update_from_output(batch, simulated_output(batch, token_id=3))
    assert len(outs) == 1 and outs[0].prefill_done and outs[0].new_token_ids == [3]
    assert not outs[0].finished  # it goes on elsewhere
    assert seq.status is SeqStatus.FINISHED and seq.block_table  # held for export
    check_pool(sched, parked=[seq])
    sched.free(seq)
    assert sched.pool.num_free == sched.pool.num_blocks


def test_drafts_on_anchor_kv_are_kept_not_emitted_and_pause_the_request():
    sched = make_scheduler()
    seq = make_seq("d", list(range(60, 66)), max_tokens=30,
                   stop_rules=StopRules(max_anchor_drafts=3))
    sched.add(seq)
    batch = sched.schedule()
    sched.update_from_output(batch, simulated_output(batch, token_id=1))
    seq.anchor_from = seq.num_tokens  # decoding on approximate KV from here
    emitted = []
    for _ in range(5):
        batch = sched.schedule()
        if batch.empty:
            break
        emitted += sched.update_from_output(batch, simulated_output(batch, token_id=2))
    assert emitted == [] and seq.paused
    assert seq.token_ids[seq.anchor_from:] == [2, 2, 2]


def test_an_output_that_does_not_fit_the_batch_names_the_field():
    sched = make_scheduler()
    sched.add(make_seq("x", [1, 2, 3], max_tokens=4))
    batch = sched.schedule()
    with pytest.raises(ValueError, match="sampled_token_ids"):
        sched.update_from_output(batch, ModelRunnerOutput([]))
    with pytest.raises(ValueError, match="sampled_token_ids"):
        sched.update_from_output(batch, ModelRunnerOutput([[1, 2]]))  # two tokens, no drafts


def test_a_request_aborted_mid_step_is_skipped():
    sched = make_scheduler()
    a, b = make_seq("a", [1, 2, 3], max_tokens=4), make_seq("b", [4, 5, 6], max_tokens=4)
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    sched.finish(a, finish.ABORT)
    sched.free(a)
    outs = sched.update_from_output(batch, simulated_output(batch))
    assert [o.request_id for o in outs] == ["b"]
    check_pool(sched)


def test_a_prefilled_request_joins_with_the_blocks_it_can_place_and_recomputes_the_rest():
    """The decode side of a hand-over: a full block the pool caches is reused, one with data
    is placed (the caller writes it), the first one without either ends the run, and what was
    not placed is computed here before the request decodes."""
    sched = make_scheduler()
    prompt = list(range(200, 214))  # three full blocks and a partial one
    donor = make_seq("donor", prompt[:BS] + [1], max_tokens=1)  # caches block 0
    sched.add(donor)
    batch = sched.schedule()
    sched.update_from_output(batch, simulated_output(batch))
    hashes = prompt_block_hashes(prompt, BS, include_partial=True)
    seq = make_seq("joined", prompt, max_tokens=3)
    seq.token_ids.append(42)  # the first token, sampled by the prefill side
    writes = sched.add_prefilled(seq, hashes, [False, True, False, True])
    assert [i for i, _ in writes] == [1]  # block 0 cached here; block 2 missing ends the run
    assert seq.num_computed == seq.num_cached_tokens == 2 * BS
    batch = sched.schedule()
    assert batch.num_new == [len(prompt) + 1 - 2 * BS]  # the prompt's rest and the first token
    outs = sched.update_from_output(batch, simulated_output(batch, token_id=8))
    assert outs[0].new_token_ids == [8] and seq.output_ids == [42, 8]
    check_pool(sched)


def test_a_prefilled_request_refused_by_a_full_queue_holds_no_blocks():
    cfg = SchedulerConfig(max_waiting=1)
    sched = Scheduler(cfg, BlockPool(16), BS)
    sched.add(make_seq("first", [1, 2, 3], max_tokens=2))
    seq = make_seq("late", list(range(8)), max_tokens=2)
    seq.token_ids.append(9)
    with pytest.raises(QueueFullError):
        sched.add_prefilled(seq, prompt_block_hashes(list(range(8)), BS), [True, True])
    assert sched.pool.num_free == 16 and not seq.block_table


def test_a_prefilled_request_whose_first_token_ends_it_never_runs():
    sched = make_scheduler()
    seq = make_seq("one", list(range(8)), max_tokens=1)
    seq.token_ids.append(9)
    sched.add_prefilled(seq, prompt_block_hashes(list(range(8)), BS), [True, True])
    assert seq.finish_reason == finish.LENGTH and seq.status is SeqStatus.FINISHED
    assert not sched.has_work() and sched.pool.num_free == sched.pool.num_blocks


def test_a_request_joined_on_approximate_kv_drafts_without_sharing_its_blocks():
    sched = make_scheduler()
    prompt = list(range(300, 308))
    seq = make_seq("anchor", prompt, max_tokens=8, stop_rules=StopRules(max_anchor_drafts=2))
    seq.token_ids.append(9)
    sched.add_prefilled(seq, prompt_block_hashes(prompt, BS), [True, True], approximate=True)
    assert seq.anchor_from == seq.num_tokens
    assert all(sched.pool.lookup(h) is None for h in prompt_block_hashes(prompt, BS))
    for _ in range(3):
        batch = sched.schedule()
        if batch.empty:
            break
        assert sched.update_from_output(batch, simulated_output(batch, token_id=4)) == []
    assert seq.paused and seq.token_ids[seq.anchor_from:] == [4, 4]


def test_hand_overs_that_fill_the_pool_while_nothing_runs_still_all_finish():
    """Three hand-overs take every block of the pool before any of them runs, and the first
    needs one more block for its next token: those queued behind it give theirs back and
    recompute, so every request still ends with all its tokens instead of waiting forever."""
    sched = make_scheduler(num_blocks=6, budget=64)
    seqs = []
    for i in range(3):
        prompt = list(range(100 * (i + 1), 100 * (i + 1) + 2 * BS))  # two full blocks each
        seq = make_seq(f"h{i}", prompt, max_tokens=4)
        seq.token_ids.append(7)
        sched.add_prefilled(seq, prompt_block_hashes(prompt, BS), [True, True])
        seqs.append(seq)
    assert sched.pool.num_free == 0
    for _ in range(40):
        if not sched.has_work():
            break
        batch = sched.schedule()
        assert not batch.empty, "the queue stalled with blocks held by waiting requests"
        sched.update_from_output(batch, simulated_output(batch, token_id=5))
        check_pool(sched)
    assert all(s.status is SeqStatus.FINISHED and len(s.output_ids) == 4 for s in seqs)
    assert sched.pool.num_free == 6 - sum(len(s.block_table) for s in seqs)


def _drive_stream(known: bool) -> list:
    """A stream with shared prefixes and preemption through a small pool; each prompt's full
    blocks' hashes given by the caller (`known`) or hashed by the scheduler. The trace of what
    every step did."""
    rng = random.Random(11)
    sched = make_scheduler(num_blocks=9, budget=10, max_seqs=4)
    shared = list(range(500, 512))
    trace = []
    pending = []
    for i in range(30):
        prompt = (shared[:rng.choice([0, 4, 8, 12])]
                  + [rng.randrange(1, 400) for _ in range(rng.randrange(1, 9))])
        kw = {"known_hashes": prompt_block_hashes(prompt, BS)} if known else {}
        pending.append(make_seq(f"r{i}", prompt, max_tokens=rng.randrange(1, 14), **kw))
    for step in range(600):
        if pending and step % 2 == 0:
            sched.add(pending.pop(0))
        batch = sched.schedule()
        if batch.empty and not pending:
            break
        outs = sched.update_from_output(batch, simulated_output(batch, 7))
        trace.append(([(s.request_id, n, list(s.block_table), list(s.block_hashes))
                       for s, n in zip(batch.seqs, batch.num_new)],
                      [s.request_id for s in batch.preempted],
                      [(o.request_id, o.new_token_ids, o.num_cached_tokens) for o in outs]))
    assert sched.prefix_hits_tokens > 0 and any(t[1] for t in trace)  # hits and preemption
    return trace


def test_known_prompt_hashes_schedule_exactly_as_hashing_the_tokens():
    """A caller that already has the prompt's block hashes (the router, the prefill role, a
    simulator) gets the same steps, blocks, prefix hits and block names as one that has not."""
    assert _drive_stream(known=True) == _drive_stream(known=False)


def test_known_hashes_longer_than_the_prompt_are_refused():
    sched = make_scheduler()
    prompt = list(range(1, 10))
    with pytest.raises(ValueError, match="known_hashes"):
        sched.add(make_seq("r", prompt, 2,
                           known_hashes=prompt_block_hashes(prompt + [1, 2, 3], BS)))
