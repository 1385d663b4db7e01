"""The simulator's parts: trace readers and transforms, the event queue, shared links and the
KV store."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from pdserve.sim.events import EventQueue
from pdserve.sim.network import KvStore, Link
from pdserve.sim.trace import (HASH_BLOCK_TOKENS, TraceError, for_cluster, load_trace, scale,
                               tile)

DATA = Path(__file__).parent / "data"


def test_mooncake_lines_become_requests():
    reqs = load_trace(DATA / "mooncake_head60.jsonl")
    assert len(reqs) == 60
    assert (reqs[0].arrival_s, reqs[0].prompt_tokens, reqs[0].output_tokens) == (0.0, 6758, 500)
    assert reqs[0].block_hashes[:2] == (0, 1)
    assert all(len(r.block_hashes) == -(-r.prompt_tokens // HASH_BLOCK_TOKENS) for r in reqs)


def test_azure_rows_become_requests_timed_from_the_first():
    reqs = load_trace(DATA / "azure_code_head40.csv")
    with open(DATA / "azure_code_head40.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(reqs) == len(rows) == 40
    assert reqs[0].arrival_s == 0.0
    assert reqs[1].arrival_s == pytest.approx(0.052)  # 18:17:04.0319600 - 18:17:03.9799600
    assert [r.prompt_tokens for r in reqs] == [int(x["ContextTokens"]) for x in rows]
    ids = [h for r in reqs for h in r.block_hashes]
    assert len(ids) == len(set(ids))  # no shared prefixes


def test_synthetic_arrivals_follow_the_rate_and_burstiness():
    poisson = load_trace("synthetic:poisson:rate=50,n=4000,in=100,out=10", seed=1)
    assert len(poisson) == 4000
    assert poisson[-1].arrival_s == pytest.approx(4000 / 50, rel=0.1)
    assert sum(r.prompt_tokens for r in poisson) / 4000 == pytest.approx(100, rel=0.1)

    def cv(reqs):
        gaps = [b.arrival_s - a.arrival_s for a, b in zip(reqs, reqs[1:])]
        mean = sum(gaps) / len(gaps)
        return (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5 / mean

    bursty = load_trace("synthetic:gamma:cv=3,rate=50,n=4000", seed=1)
    assert cv(poisson) == pytest.approx(1.0, abs=0.15)
    assert cv(bursty) > 2
    fixed = load_trace("synthetic:poisson:n=5,in=64,out=8,fixed=1")
    assert {(r.prompt_tokens, r.output_tokens) for r in fixed} == {(64, 8)}


@pytest.mark.parametrize("spec,field", [("synthetic:poisson:rate=0", "rate"),
                                        ("synthetic:poisson:speed=3", "speed"),
                                        ("synthetic:uniform:n=3", "synthetic:poisson"),
                                        ("trace.parquet", ".jsonl")])
def test_bad_specs_name_the_field(spec, field):
    with pytest.raises(TraceError, match=field):
        load_trace(spec)


def test_scaling_compresses_time_and_lengths():
    reqs = load_trace(DATA / "mooncake_head60.jsonl")
    fast = scale(reqs, rate=4, lengths=0.5)
    assert [r.arrival_s for r in fast] == [r.arrival_s / 4 for r in reqs]
    assert fast[0].prompt_tokens == 3379 and fast[0].output_tokens == 250
    assert len(fast[0].block_hashes) == -(-3379 // HASH_BLOCK_TOKENS)


def test_tiling_fills_the_duration_and_copies_get_their_own_prefixes():
    reqs = load_trace(DATA / "mooncake_head60.jsonl")  # 15 s of arrivals
    long = tile(reqs, duration_s=100)
    assert long[-1].arrival_s < 100 and long[-1].arrival_s > 80
    assert len(long) > 5 * len(reqs)
    three = tile(reqs, copies=3, seed=1)
    assert len(three) == 3 * len(reqs)
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(three, three[1:]))
    firsts = {r.block_hashes[0] for r in three}
    assert len(firsts) == 3  # the shared system prompt, once per copy
    cluster = for_cluster(reqs, workers=100, workers_per_copy=10, duration_s=15, seed=0)
    one = tile(reqs, duration_s=15)
    assert len(one) == sum(1 for r in reqs if r.arrival_s < 15)  # the end is exclusive
    assert len(cluster) == 10 * len(one)


def test_events_pop_in_time_order_and_ties_in_the_order_pushed():
    q = EventQueue()
    q.push(2.0, "b")
    q.push(1.0, "a", 1)
    q.push(2.0, "c")
    assert [q.pop()[1] for _ in range(3)] == ["a", "b", "c"]
    assert q.now == 2.0
    with pytest.raises(ValueError, match="before now"):
        q.push(1.0, "late")
    with pytest.raises(ValueError, match="before now"):
        q.push(float("nan"), "never")


def test_events_pop_as_a_heap_of_time_and_push_order_would_with_many_ties():
    import heapq
    import random

    rng = random.Random(5)
    q, ref, seq = EventQueue(), [], 0
    for _ in range(3000):
        if ref and rng.random() < 0.45:
            at, _, kind, payload = heapq.heappop(ref)
            assert q.peek_time() == at
            assert q.pop() == (at, kind, payload) and q.now == at
        else:
            at = q.now + rng.choice((0.0, 0.0, 0.5, 1.0, rng.random()))
            seq += 1
            q.push(at, "k", seq)
            heapq.heappush(ref, (at, seq, "k", seq))
        assert len(q) == len(ref)
    while ref:
        at, _, kind, payload = heapq.heappop(ref)
        assert q.pop() == (at, kind, payload)
    assert len(q) == 0 and q.peek_time() is None


def test_transfers_on_one_link_share_its_bandwidth_fairly():
    link = Link("l")
    link.add(0.0, "a", 1.0)
    link.add(0.0, "b", 1.0)
    assert link.next_done_s(0.0) == pytest.approx(2.0)  # each at half speed
    assert link.complete(1.0) == []
    link.add(1.0, "c", 0.25)  # a and b have 0.5 left; now three share
    assert link.next_done_s(1.0) == pytest.approx(1.75)
    assert link.complete(1.75) == ["c"]
    assert link.next_done_s(1.75) == pytest.approx(2.25)  # 0.25 left each, two share
    assert link.complete(2.25) == ["a", "b"]


def test_the_store_evicts_the_least_recently_used():
    store = KvStore(3)
    assert store.put([b"a", b"b", b"c"]) == ([b"a", b"b", b"c"], [])
    assert store.leading([b"a"]) == 1  # a is now the most recently used
    new, gone = store.put([b"d"])
    assert (new, gone) == ([b"d"], [b"b"])
    assert store.leading([b"a", b"b", b"c"]) == 1
    assert KvStore(0).put([b"a"]) == ([], [])


def test_a_fetch_after_the_routers_question_answers_for_the_store_as_it_is_then():
    store = KvStore(4)
    store.put([b"a", b"b"])
    chain = [b"a", b"b", b"c"]
    assert store.overlap(chain) == 2  # the router asks; the fetch reuses the answer
    assert store.leading(chain) == 2
    assert list(store.blocks) == [b"a", b"b"]
    assert store.overlap(chain) == 2
    store.put([b"c"])  # stored in between: the fetch walks the chain again
    assert store.leading(chain) == 3
    assert store.overlap(chain) == 3
    store.put([b"d", b"e"])  # evicts a: the chain's first block is gone
    assert store.leading(chain) == 0
    assert store.leading([b"b", b"c"]) == 2  # another chain is walked, not answered from memo


def test_trace_derived_hashes_name_blocks_as_hashing_their_tokens_would():
    """Blocks named from the trace's ids are equal exactly when the synthesized tokens' hashes
    are (shared ids, a prompt cut inside a trace block, the unique tail, block sizes that do
    and do not divide the trace's 512), and the scheduler registers them as given."""
    from pdserve.core.block_hash import prompt_block_hashes
    from pdserve.sim.engine_model import EngineModel
    from pdserve.sim.prompts import prompt_hashes_of, prompt_tokens_of

    prompts = [((3, 9, 4), 1300, 1), ((3, 9, 5), 1400, 2), ((3, 9), 1100, 3), ((3, 3), 900, 4),
               ((3,), 512, 5), ((), 700, 6), ((7, 9, 4), 1300, 7), ((3, 9, 4), 1200, 8)]
    for bs in (16, 48, 512, 1000):
        by_tokens: dict[bytes, bytes] = {}
        by_ids: dict[bytes, bytes] = {}
        for ids, n, unique in prompts:
            old = prompt_block_hashes(prompt_tokens_of(ids, n, unique), bs)
            new = prompt_hashes_of(ids, n, unique, bs)
            assert len(new) == len(old) == n // bs
            for a, b in zip(old, new):
                assert by_tokens.setdefault(a, b) == b and by_ids.setdefault(b, a) == a
        assert len(by_ids) < sum(n // bs for _, n, _ in prompts)  # some blocks are shared
    prompt = prompt_tokens_of((3, 9, 4), 1300, unique=1)
    known = prompt_hashes_of((3, 9, 4), 1300, 1, 16)
    engine = EngineModel(128, 16, 8, 2048, 16)
    engine.add("a", prompt, 1, prefill_only=True, known_hashes=known)
    while not engine.parked:
        engine.complete(engine.plan())
    assert engine.take_parked("a") == known


def test_run_tokens_read_and_change_as_the_list_they_stand_for():
    """The compact token ids the simulator hands the scheduler behave as a plain list under
    every operation the scheduler uses: length, indexing, slices, append, extend, cuts, and
    the text a block is hashed from."""
    import random

    from pdserve.core.block_hash import iter_block_hashes
    from pdserve.sim.prompts import prompt_tokens_of
    from pdserve.sim.tokens import RunTokens

    rng = random.Random(3)
    for trial in range(200):
        runs = [(rng.randrange(-3, 5), rng.randrange(0, 40)) for _ in range(rng.randrange(6))]
        plain = [v for v, c in runs for _ in range(c)]
        kept = [(v, c) for v, c in runs if c]
        ends = [sum(c for _, c in kept[:j + 1]) for j in range(len(kept))]
        toks = RunTokens.from_ends([v for v, _ in kept], ends) if trial % 2 else RunTokens(runs)
        for _ in range(30):
            assert len(toks) == len(plain) and list(toks) == plain and toks == plain, trial
            n = len(plain)
            a, b = rng.randrange(-5, n + 5), rng.randrange(-5, n + 5)
            assert toks[a:b] == plain[a:b] and toks[a:] == plain[a:] and toks[::2] == plain[::2]
            if n:
                i = rng.randrange(-n, n)
                assert toks[i] == plain[i]
            op = rng.randrange(4)
            if op == 0:
                toks.append(op), plain.append(op)
            elif op == 1:
                more = [rng.randrange(9)] * rng.randrange(5)
                toks.extend(more), plain.extend(more)
            elif op == 2 and n:
                cut = rng.randrange(n)
                del toks[cut:], plain[cut:]
            else:
                copy = toks.copy()
                copy.append(7)
                assert toks == plain and copy == plain + [7]
            a, b = sorted((rng.randrange(0, len(plain) + 1), rng.randrange(0, len(plain) + 1)))
            assert toks.block_text(a, b) == ",".join(map(str, plain[a:b])).encode()
        with pytest.raises(IndexError):
            toks[len(plain)]
        # Blocks are named alike whichever way the ids are held.
        assert list(iter_block_hashes(toks, 4, "t")) == list(iter_block_hashes(plain, 4, "t"))
    assert prompt_tokens_of((3, 9), 1100, 4) == [5] * 512 + [11] * 512 + [-4] * 76


def test_a_prompt_chunk_one_token_short_is_not_taken_for_a_decode_run():
    """A request prefilling in chunks (an offload's chunk cap) can stop one token before its
    prompt's end; its next step makes the first token, so no bulk decode run may take it."""
    from pdserve.sim.engine_model import EngineModel

    engine = EngineModel(64, 16, 8, 2048, 16)
    engine.add("a", list(range(2, 35)), 5, max_chunk_tokens=32)  # 33 prompt tokens
    assert engine.complete(engine.plan()) == []  # 32 of 33 computed
    assert engine.decode_run(1 << 20)[0] < 2
    assert engine.complete(engine.plan()) == [("a", "first")]
    assert engine.decode_run(1 << 20)[0] == 4  # now a pure decode: 4 more tokens


def test_a_planned_decode_step_completes_as_the_scheduler_would():
    """`complete` applies a step in which every entry decodes one token in bulk: the
    scheduler, the block pool and the block events end as `update_from_output` leaves them,
    including sequences that complete a block or end at this step."""
    from pdserve.engine.scheduler import simulated_output
    from pdserve.sim.engine_model import SAMPLED_TOKEN, EngineModel

    def state(e):
        seqs = {rid: (s.num_computed, list(s.token_ids), list(s.block_table),
                      list(s.block_hashes), s.status) for rid, s in e.seqs.items()}
        return (seqs, e.pool.free_order(), dict(e.pool.by_hash), list(e.pool.ref),
                [s.request_id for s in e.sched.running], e.sched.prompt_tokens_computed)

    engines = [EngineModel(40, 4, 8, 64, 16, record_events=True) for _ in range(2)]
    for e in engines:
        for j, (prompt_len, out) in enumerate([(7, 2), (8, 5), (11, 3), (3, 9)]):
            prompt = list(range(10 * j + 2, 10 * j + 2 + prompt_len))
            hashes = [bytes([j, b]) for b in range(prompt_len // 4)]
            assert e.add_prefilled(f"r{j}", prompt, hashes, out)
    for _ in range(4):  # the first step admits them; "r0" ends at the second
        steps = [e.plan() for e in engines]
        assert steps[0].prefill_tokens == 0 and steps[0].decode_batch == len(steps[0].batch.seqs)
        bulk = engines[0].complete(steps[0])
        ref_engine, batch = engines[1], steps[1].batch
        ref = []
        for out in ref_engine.sched.update_from_output(batch, simulated_output(batch,
                                                                                SAMPLED_TOKEN)):
            if out.finished:
                del ref_engine.seqs[out.request_id]
                ref.append((out.request_id, "done"))
        assert bulk == ref
        assert state(engines[0]) == state(engines[1])
        assert engines[0].block_events() == engines[1].block_events()
    assert "r0" not in engines[0].seqs and "r2" not in engines[0].seqs
