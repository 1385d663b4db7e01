"""The router's block index: events in, overlaps out; bounded; removed events honoured."""

from __future__ import annotations

import pytest

from pdserve.core.block_hash import prompt_block_hashes
from pdserve.router.kv_feed import store_event, worker_batch_events
from pdserve.router.kv_index import CLEARED, REMOVED, STORED, KvEvent, KvIndex, store_source
from pdserve.kvstore.client import BlockKey, Plane, format_key
from pdserve.proto import worker_pb2 as wpb

TOKENS = list(range(100, 100 + 16 * 6))
HASHES = prompt_block_hashes(TOKENS, 16)


def test_overlap_is_the_longest_cached_prefix():
    idx = KvIndex()
    idx.apply(KvEvent("w0", STORED, tuple(HASHES[:4])))
    idx.apply(KvEvent("w1", STORED, (HASHES[0], HASHES[2])))  # a hole after block 0
    assert idx.overlap("w0", HASHES) == 4
    assert idx.overlap("w1", HASHES) == 1
    assert idx.overlap("nobody", HASHES) == 0
    assert idx.overlaps(["w0", "w1"], HASHES[:2]) == [2, 1]


def test_removed_blocks_cut_the_overlap_and_cleared_forgets_a_source():
    idx = KvIndex()
    idx.apply(KvEvent("w0", STORED, tuple(HASHES)))
    idx.apply(KvEvent("w0", REMOVED, (HASHES[3],)))
    assert idx.overlap("w0", HASHES) == 3
    idx.apply(KvEvent("w0", STORED, (HASHES[3],)))
    assert idx.overlap("w0", HASHES) == 6
    idx.apply(KvEvent("w0", CLEARED))
    assert idx.overlap("w0", HASHES) == 0 and idx.size("w0") == 0


def test_a_salted_prompt_shares_nothing():
    idx = KvIndex()
    idx.apply(KvEvent("w0", STORED, tuple(HASHES)))
    assert idx.overlap("w0", prompt_block_hashes(TOKENS, 16, salt="tenant-b")) == 0


def test_bounded_per_source_drops_the_oldest_stored():
    idx = KvIndex(max_blocks_per_source=4)
    idx.apply(KvEvent("w0", STORED, tuple(HASHES)))
    assert idx.size("w0") == 4 and idx.dropped == 2
    # The two oldest (the prefix's head) are gone: the overlap is now 0, never too long.
    assert idx.overlap("w0", HASHES) == 0
    assert idx.holds("w0", HASHES[5])


def test_bounded_number_of_sources():
    idx = KvIndex(max_sources=2)
    for s in ("a", "b", "c"):
        idx.apply(KvEvent(s, STORED, (HASHES[0],)))
    assert sorted(idx.sources) == ["a", "b"] and idx.refused == 1
    with pytest.raises(ValueError):
        KvIndex(max_blocks_per_source=0)


def test_worker_batches_become_ordered_events():
    batch = wpb.KvEventBatch(snapshot=True, events=[
        wpb.KvCacheEvent(kind=wpb.KV_EVENT_KIND_STORED, block_hash=HASHES[0]),
        wpb.KvCacheEvent(kind=wpb.KV_EVENT_KIND_STORED, block_hash=HASHES[1]),
        wpb.KvCacheEvent(kind=wpb.KV_EVENT_KIND_REMOVED, block_hash=HASHES[1]),
        wpb.KvCacheEvent(kind=wpb.KV_EVENT_KIND_STORED, block_hash=HASHES[2])])
    events = worker_batch_events("w0", batch)
    assert [(e.kind, len(e.hashes)) for e in events] == [
        (CLEARED, 0), (STORED, 2), (REMOVED, 1), (STORED, 1)]
    idx = KvIndex()
    idx.apply(KvEvent("w0", STORED, (HASHES[5],)))
    idx.apply_all(events)
    assert idx.overlap("w0", HASHES) == 1 and not idx.holds("w0", HASHES[5])


def test_store_keys_map_back_to_block_hashes():
    key = format_key(BlockKey("m@float32", "", HASHES[0], 0, 2, Plane.FULL))
    assert store_event("stored", key) == KvEvent(store_source("m@float32"), STORED, (HASHES[0],))
    assert store_event("evicted", key).kind == REMOVED
    assert store_event("removed", key).kind == REMOVED
    assert store_event("replica_dropped", key) is None  # other replicas remain
    assert store_event("demoted", key) is None  # still in the store, on SSD
    assert store_event("stored", "not/a/block/key") is None
    anchor = format_key(BlockKey("m@float32", "", HASHES[0], 0, 2, Plane.ANCHOR))
    assert store_event("stored", anchor) is None  # a plane alone is not the whole block


def test_resume_point_is_read_from_the_masters_events_lost_error():
    from pdserve.kvstore.master import EventsLost, MasterCore
    from pdserve.kvstore.master.config import MasterConfig
    from pdserve.router.kv_feed import resume_after

    core = MasterCore(MasterConfig(max_events=2))
    for i in range(4):
        core.register_node(f"n{i}", "h", f"127.0.0.1:{i + 1}", [(f"s{i}", 1 << 20, "dram", "")], 0.0)
    with pytest.raises(EventsLost) as lost:
        core.events_since(0)
    after = resume_after(f"EventsLost: {lost.value}")  # as the master's service words it
    assert after is not None and core.events_since(after)  # the retained events follow
    assert resume_after("UNAVAILABLE: not the leader") is None


@pytest.mark.parametrize("by_hash,scanned", [(True, ()), (False, ()), (True, ("w1", "w4"))])
def test_holders_give_every_nonzero_overlap_as_events_change(by_hash, scanned):
    """Also with sources left out of the by-hash map (asked by a pass instead)."""
    import random

    rng = random.Random(4)
    idx = KvIndex(max_blocks_per_source=9, max_sources=5, by_hash=by_hash, scanned=scanned)
    sources = [f"w{i}" for i in range(6)]
    for _ in range(400):
        s = rng.choice(sources)
        kind = rng.choice([STORED, STORED, REMOVED, CLEARED])
        start = rng.randrange(len(HASHES))
        idx.apply(KvEvent(s, kind, tuple(HASHES[start:start + rng.randrange(1, 4)])
                          if kind != CLEARED else ()))
        want = {src: n for src, n in zip(sources, idx.overlaps(sources, HASHES)) if n}
        assert idx.holders(HASHES) == want
        assert idx.holders(HASHES[:0]) == {}


def test_bulk_changes_equal_one_event_per_block():
    import random

    rng = random.Random(8)
    one = KvIndex(max_blocks_per_source=7, max_sources=3, by_hash=True)
    bulk = KvIndex(max_blocks_per_source=7, max_sources=3, by_hash=True, scanned=("w2",))
    for _ in range(300):
        source = rng.choice(["w0", "w1", "w2", "w3"])
        changes = [(rng.choice([STORED, STORED, REMOVED]), rng.choice(HASHES))
                   for _ in range(rng.randrange(1, 12))]
        for kind, h in changes:
            one.apply(KvEvent(source, kind, (h,)))
        bulk.apply_changes(source, changes)
        for s in ["w0", "w1", "w2", "w3"]:
            assert list(bulk._blocks.get(s, ())) == list(one._blocks.get(s, ()))
        assert bulk.holders(HASHES) == one.holders(HASHES)
        assert (bulk.applied, bulk.dropped, bulk.refused) == (one.applied, one.dropped,
                                                              one.refused)
    with pytest.raises(ValueError, match="kind"):
        bulk.apply_changes("w0", [("moved", HASHES[0])])
