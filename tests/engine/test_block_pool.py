"""BlockPool: reference counts, the content-hash index, LRU eviction; chained, salted block hashes."""

from __future__ import annotations

import pytest

from pdserve.core.block_hash import hash_block, prompt_block_hashes
from pdserve.engine.block_pool import BlockPool, NoFreeBlocksError


def make_pool(num_blocks: int = 8) -> BlockPool:
    return BlockPool(num_blocks)


def cache_blocks(pool: BlockPool, tokens_per_block: list[list[int]], salt: str = "") -> list[int]:
    """Allocate one block per token list, register it under its chained hash, release it:
    the pool then holds these blocks as cached and evictable, as after a finished request."""
    bids = pool.allocate(len(tokens_per_block))
    parent = None
    for bid, toks in zip(bids, tokens_per_block):
        parent = hash_block(parent, toks, salt)
        pool.register(bid, parent)
    pool.release(bids)
    return bids


# ---- allocate / release / refcounts ------------------------------------------------------------

def test_allocate_and_release_track_refcounts():
    pool = make_pool(8)
    a = pool.allocate(3)
    assert len(set(a)) == 3 and pool.num_free == 5
    assert all(pool.ref[b] == 1 for b in a)
    b = pool.allocate(5)
    assert not set(a) & set(b) and pool.num_free == 0
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(1)
    pool.release(a)
    assert pool.num_free == 3 and all(pool.ref[x] == 0 for x in a)
    pool.release(b)
    assert pool.num_free == 8
    assert pool.stats().num_free == 8 and pool.stats().num_cached == 0


def test_allocate_more_than_free_takes_nothing():
    pool = make_pool(4)
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(5)
    assert pool.num_free == 4 and pool.ref == [0] * 4


def test_shared_block_is_free_only_after_last_holder_releases():
    pool = make_pool(4)
    h = hash_block(None, [1, 2, 3, 4])
    (bid,) = pool.allocate(1)
    pool.register(bid, h)
    pool.take_cached(bid)  # a second sequence shares the prefix block
    assert pool.ref[bid] == 2 and pool.num_free == 3
    pool.release([bid])
    assert pool.ref[bid] == 1 and pool.num_free == 3
    pool.release([bid])
    assert pool.ref[bid] == 0 and pool.num_free == 4


def test_double_release_asserts():
    pool = make_pool(4)
    bids = pool.allocate(2)
    pool.release(bids)
    with pytest.raises(AssertionError, match="released twice"):
        pool.release(bids[:1])
    with pytest.raises(AssertionError):
        pool.release([3])  # never allocated


# ---- the hash index and eviction ---------------------------------------------------------------

def test_cached_block_is_found_by_hash_and_reused():
    pool = make_pool(4)
    (bid,) = cache_blocks(pool, [[5, 6, 7, 8]])
    h = hash_block(None, [5, 6, 7, 8])
    # Released but still indexed: it counts as free (evictable) and is found by its hash.
    assert pool.lookup(h) == bid and pool.num_free == 4 and pool.stats().num_cached == 1
    pool.take_cached(bid)
    assert pool.ref[bid] == 1 and pool.num_free == 3
    # While held it is never handed out again, even when every other block is taken.
    others = pool.allocate(3)
    assert bid not in others and pool.lookup(h) == bid and pool.evictions == 0
    assert pool.lookup(hash_block(None, [5, 6, 7, 9])) is None


def test_cached_blocks_are_evicted_only_when_plain_free_blocks_run_out():
    pool = make_pool(4)
    (a,) = cache_blocks(pool, [[1]])
    (b,) = cache_blocks(pool, [[2]])  # released after a: a is the least recently used
    ha, hb = hash_block(None, [1]), hash_block(None, [2])
    plain = pool.allocate(2)
    assert set(plain) == set(range(4)) - {a, b}
    assert pool.evictions == 0 and pool.lookup(ha) == a and pool.lookup(hb) == b
    (first,) = pool.allocate(1)
    assert first == a and pool.lookup(ha) is None and pool.lookup(hb) == b
    assert pool.evictions == 1 and pool.block_hash[a] is None
    (second,) = pool.allocate(1)
    assert second == b and pool.lookup(hb) is None and pool.evictions == 2
    assert pool.stats().num_cached == 0


def test_eviction_is_lru_by_last_release():
    pool = make_pool(3)
    (a,) = cache_blocks(pool, [[1]])
    (b,) = cache_blocks(pool, [[2]])
    (c,) = cache_blocks(pool, [[3]])
    pool.take_cached(a)  # a is used again: now b is the oldest
    pool.release([a])
    assert pool.allocate(1) == [b]
    assert pool.allocate(1) == [c]
    assert pool.allocate(1) == [a]
    assert pool.evictions == 3


def test_a_prompts_tail_blocks_are_evicted_before_its_head():
    pool = make_pool(3)
    head, mid, tail = cache_blocks(pool, [[1], [2], [3]])  # released together, tail first
    assert pool.allocate(1) == [tail]
    assert pool.allocate(1) == [mid]
    assert pool.allocate(1) == [head]


def test_freed_plain_blocks_are_reused_before_cached_ones():
    pool = make_pool(3)
    (cached,) = cache_blocks(pool, [[9]])
    plain = pool.allocate(2)
    pool.release(plain)
    assert set(pool.allocate(2)) == set(plain)
    assert pool.lookup(hash_block(None, [9])) == cached and pool.evictions == 0


def test_reuse_order_is_that_of_one_ordered_free_list():
    """The pool's free blocks (a stack, the untaken ids, a linked list of cached ones) are
    reused in the order of one ordered free list where a released plain block goes first and a
    released cached one last, through random allocations, hits, registrations and releases."""
    import random
    from collections import OrderedDict

    rng = random.Random(3)
    for trial in range(40):
        n = rng.randrange(1, 24)
        pool, model = BlockPool(n, max_events=1), OrderedDict((i, None) for i in range(n))
        held: list[int] = []
        next_hash = 0
        for _ in range(200):
            op = rng.random()
            if op < 0.4 and model:
                k = rng.randrange(1, len(model) + 1)
                want = list(model)[:k]
                for bid in want:
                    del model[bid]
                assert pool.allocate(k) == want
                held += want
            elif op < 0.6 and held:
                bid = rng.choice(held)
                if pool.block_hash[bid] is None:
                    next_hash += 1
                    pool.register(bid, next_hash.to_bytes(4, "big"))
            elif op < 0.75 and pool.by_hash:
                bid = pool.by_hash[rng.choice(list(pool.by_hash))]
                if pool.ref[bid] == 0:
                    del model[bid]
                pool.take_cached(bid)
                held.append(bid)
            elif held:
                out = rng.sample(held, rng.randrange(1, len(held) + 1))
                for bid in out:
                    held.remove(bid)
                pool.release(out)
                left = {bid: held.count(bid) + out.count(bid) for bid in out}
                for bid in reversed(out):  # as released, tail first
                    left[bid] -= 1
                    if not left[bid]:  # its last hold
                        model[bid] = None
                        if pool.block_hash[bid] is None:
                            model.move_to_end(bid, last=False)
            assert pool.free_order() == list(model), trial
            assert pool.num_free == len(model)


def test_register_is_idempotent():
    pool = make_pool(4)
    h1, h2 = hash_block(None, [1, 2]), hash_block(None, [3, 4])
    a, b = pool.allocate(2)
    pool.register(a, h1)
    pool.register(a, h1)
    assert pool.lookup(h1) == a and pool.stats().num_cached == 1
    pool.register(a, h2)  # a block caches one prefix for its lifetime in the index
    assert pool.block_hash[a] == h1 and pool.lookup(h2) is None
    pool.register(b, h1)  # same content computed twice: the first block stays the cached one
    assert pool.lookup(h1) == a and pool.block_hash[b] is None
    pool.release([a, b])
    assert pool.stats().num_cached == 1 and pool.num_free == 4
    # b was never indexed, so it is a plain block again and is reused before a is evicted.
    assert pool.allocate(3)[0] == b and pool.lookup(h1) == a and pool.evictions == 0


# ---- chained, salted hashes --------------------------------------------------------------------

def test_hash_is_deterministic_and_covers_the_tokens():
    assert hash_block(None, [1, 2, 3]) == hash_block(None, (1, 2, 3))
    assert hash_block(None, [1, 2, 3]) != hash_block(None, [1, 2, 4])
    assert hash_block(None, [12, 3]) != hash_block(None, [1, 23])  # token boundaries matter
    assert len(hash_block(None, [1])) == 16


def test_hash_differs_when_the_parent_differs():
    toks = [7, 7, 7, 7]
    p1, p2 = hash_block(None, [1, 2, 3, 4]), hash_block(None, [1, 2, 3, 5])
    assert hash_block(p1, toks) != hash_block(p2, toks)
    assert hash_block(p1, toks) != hash_block(None, toks)
    # Through prompt_block_hashes: equal later blocks after a different first block never match.
    a = prompt_block_hashes([1, 2, 3, 4] + [7] * 8, 4)
    b = prompt_block_hashes([1, 2, 3, 5] + [7] * 8, 4)
    assert len(a) == len(b) == 3 and all(x != y for x, y in zip(a, b))


def test_hash_differs_when_the_salt_differs():
    toks = list(range(100, 112))
    alice = prompt_block_hashes(toks, 4, salt="tenant-a")
    bob = prompt_block_hashes(toks, 4, salt="tenant-b")
    assert alice == prompt_block_hashes(toks, 4, salt="tenant-a")
    assert not set(alice) & set(bob)
    assert not set(alice) & set(prompt_block_hashes(toks, 4))  # no salt is a tenant of its own


def test_prompt_block_hashes_chain_full_blocks_and_optionally_the_partial_one():
    toks = list(range(10))
    hashes = prompt_block_hashes(toks, 4, salt="s")
    h0 = hash_block(None, toks[0:4], "s")
    h1 = hash_block(h0, toks[4:8], "s")
    assert hashes == [h0, h1]
    with_partial = prompt_block_hashes(toks, 4, salt="s", include_partial=True)
    assert with_partial == [h0, h1, hash_block(h1, toks[8:10], "s")]
    assert prompt_block_hashes(toks[:3], 4) == []
    assert prompt_block_hashes(toks[:8], 4, include_partial=True) == prompt_block_hashes(toks[:8], 4)


def test_one_tenant_never_hits_anothers_cached_blocks():
    pool = make_pool(4)
    toks = [[1, 2], [3, 4]]
    cache_blocks(pool, toks, salt="tenant-a")
    mine = prompt_block_hashes([1, 2, 3, 4], 2, salt="tenant-a")
    theirs = prompt_block_hashes([1, 2, 3, 4], 2, salt="tenant-b")
    assert [pool.lookup(h) is not None for h in mine] == [True, True]
    assert [pool.lookup(h) for h in theirs] == [None, None]


# ---- prefix-cache events (KV-aware routing) ------------------------------------------------------

def test_register_emits_stored_and_eviction_emits_removed():
    from pdserve.engine.block_pool import REMOVED, STORED

    pool = make_pool(2)
    cache_blocks(pool, [[1, 2], [3, 4]])
    h1 = hash_block(None, [1, 2])
    h2 = hash_block(h1, [3, 4])
    events, lost = pool.events.since(0)
    assert not lost and [(e.kind, e.block_hash) for e in events] == [(STORED, h1), (STORED, h2)]
    assert sorted(pool.cached_hashes()) == sorted([h1, h2])
    # Taking a cached block for other content removes its hash (tail released first, so the
    # prefix's last block goes first).
    pool.allocate(1)
    events, lost = pool.events.since(2)
    assert not lost and [(e.seq, e.kind, e.block_hash) for e in events] == [(3, REMOVED, h2)]
    assert pool.events.since(3) == ([], False)


def test_registering_a_cached_hash_again_emits_nothing():
    pool = make_pool(4)
    cache_blocks(pool, [[1, 2]])
    bid = pool.allocate(1)[0]
    pool.register(bid, hash_block(None, [1, 2]))  # same content in another block: not indexed
    assert pool.events.last_seq == 1


def test_event_log_is_bounded_and_asks_for_a_resync_when_events_were_lost():
    pool = BlockPool(16, max_events=3)
    cache_blocks(pool, [[i] for i in range(5)])
    assert pool.events.dropped == 2
    events, lost = pool.events.since(0)
    assert lost and events == []  # seq 1 and 2 are gone: snapshot (cached_hashes) instead
    events, lost = pool.events.since(2)
    assert not lost and [e.seq for e in events] == [3, 4, 5]
    assert pool.events.wait(4, timeout_s=0.01) and not pool.events.wait(5, timeout_s=0.01)


def test_placing_a_prompts_blocks_in_one_call_matches_placing_them_one_by_one():
    """`place` (the hand-over's loop inside the pool) leaves the pool, the blocks held, the
    blocks to write and the event log exactly as the per-block calls would, through hits,
    evictions, blocks without data and a pool that runs dry."""
    import random

    def one_by_one(pool, hashes, has_data, n_full, cache):
        table, writes = [], []
        for i, (h, data) in enumerate(zip(hashes, has_data)):
            bid = pool.lookup(h) if i < n_full else None
            if bid is not None:
                pool.take_cached(bid)
            elif data and pool.num_free > 0:
                bid = pool.allocate_one()
                writes.append((i, bid))
                if i < n_full and cache:
                    pool.register(bid, h)
            else:
                break
            table.append(bid)
        return table, writes

    def state(pool):
        return (pool.ref, pool.block_hash, pool.by_hash, pool.free_order(), pool.evictions,
                [(e.kind, e.block_hash) for e in pool.events.since(0)[0]])

    BS = 4
    rng = random.Random(5)
    evictions = hits = 0
    bases = [[rng.randrange(4) for _ in range(6 * BS + 2)] for _ in range(5)]
    for trial in range(60):
        a, b = BlockPool(12), BlockPool(12)
        held_a, held_b = [], []
        for _ in range(25):
            base = bases[rng.randrange(len(bases))]  # a few shared prompts, cut anywhere
            prompt = base[:rng.randrange(1, len(base) + 1)]
            hashes = prompt_block_hashes(prompt, BS, include_partial=True)
            has_data = [rng.random() < 0.9 for _ in hashes]
            n_full, cache = len(prompt) // BS, rng.random() < 0.8
            got = a.place(hashes, has_data, n_full, cache)
            want = one_by_one(b, hashes, has_data, n_full, cache)
            assert got == want and state(a) == state(b), trial
            hits += len(got[0]) - len(got[1])
            held_a.append(got[0])
            held_b.append(want[0])
            while held_a and (rng.random() < 0.5 or a.num_free < 3):
                k = rng.randrange(len(held_a))
                a.release(held_a.pop(k))
                b.release(held_b.pop(k))
        evictions += a.evictions
    assert hits > 100 and evictions > 100  # the cases that differ from a plain allocation ran
