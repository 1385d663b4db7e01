"""MasterCore eviction: watermarks, LRU order, leases, pins, demotion to SSD."""

from __future__ import annotations

from pdserve.kvstore.master import MasterCore
from tests.kvstore.master.factories import PAGE, keys_of, make_core, put, used_pages

KEYS = [f"k{i:03d}" for i in range(100)]


def fill(core: MasterCore, count: int, start_s: float = 0.0) -> None:
    """Puts KEYS[:count], one page each, touched at start_s, start_s + 1, ..."""
    for i in range(count):
        put(core, KEYS[i], now_s=start_s + i)


def test_eviction_starts_past_the_high_watermark_and_stops_at_the_low_one() -> None:
    core = make_core(dram_pages=100)
    fill(core, 90)
    assert used_pages(core) == 90  # exactly 90%: not past it
    put(core, "new", now_s=100)
    # 91% -> down to 85%: the 6 least recently touched go.
    assert used_pages(core) == 85
    assert keys_of(core, KEYS[:90]) == KEYS[6:90]
    assert core.exists(["new"]) == [True]
    assert core.stats()["dram"].evictions == 6
    evicted = [e for e in core.events_since(0) if e.kind == "evicted"]
    assert [e.key for e in evicted] == KEYS[:6] and {e.reason for e in evicted} == {"lru"}
    core.check_invariants()


def test_a_get_makes_an_object_recent() -> None:
    core = make_core(dram_pages=100)
    fill(core, 90)
    core.get(KEYS[0], now_s=200)
    core.get(KEYS[2], now_s=201)
    put(core, "new", now_s=202)
    assert keys_of(core, KEYS[:10]) == [KEYS[0], KEYS[2], KEYS[8], KEYS[9]]


def test_leased_objects_are_skipped_until_their_lease_ends() -> None:
    core = make_core(dram_pages=100, lease_s=5)
    fill(core, 90)
    # longest_prefix leases without refreshing LRU: the six oldest stay oldest, but leased.
    assert core.longest_prefix(KEYS[:6], now_s=50)[0] == 6
    put(core, "new", now_s=51)
    assert keys_of(core, KEYS[:12]) == KEYS[:6]  # the next six oldest went instead
    for i in range(5):
        put(core, f"more{i}", now_s=52)  # back to exactly 90%
    put(core, "last", now_s=55)  # leases end at 55: now the oldest go first
    assert keys_of(core, KEYS[:6]) == []
    core.check_invariants()


def test_pins_keep_objects_until_their_ttl() -> None:
    core = make_core(dram_pages=100)
    fill(core, 90)
    assert core.pin(KEYS[0], ttl_s=10, now_s=95) == 105
    assert core.pin(KEYS[0], ttl_s=1, now_s=95) == 105  # pins only extend
    put(core, "a", now_s=100)
    assert KEYS[0] in keys_of(core, KEYS[:1]) and keys_of(core, KEYS[1:8]) == [KEYS[7]]
    for i in range(6):
        put(core, f"b{i}", now_s=101)
    core.evict(now_s=104.9)
    assert core.exists([KEYS[0]]) == [True]
    for i in range(6):
        put(core, f"c{i}", now_s=105)  # pin over: it is the oldest now
    assert core.exists([KEYS[0]]) == [False]
    core.check_invariants()


def test_a_put_into_full_dram_evicts_just_enough_below_the_watermark() -> None:
    # high_watermark = 1.0: only a put that does not fit evicts.
    core = make_core(dram_pages=4, high_watermark=1.0, low_watermark=0.5)
    fill(core, 4)
    core.get(KEYS[0], now_s=10)
    put(core, "new", pages=2, now_s=11)
    assert keys_of(core, KEYS[:4]) == [KEYS[0], KEYS[3]]


def test_sampled_eviction_takes_the_oldest_of_each_window() -> None:
    core = make_core(dram_pages=10, eviction_sample=2, high_watermark=0.8, low_watermark=0.7)
    for i, t in enumerate([5, 1, 2, 0, 9, 9, 9, 9]):
        put(core, KEYS[i], now_s=t)
    put(core, "new", now_s=10)  # 9/10 > 0.8: evict 2, window [0,1] then [2,3] of the rest
    assert keys_of(core, KEYS[:8]) == [KEYS[0], KEYS[2]] + KEYS[4:8]


def test_dram_eviction_demotes_to_ssd_on_the_same_node() -> None:
    # Promotion on read is tested on its own below; here reads must not move anything back.
    core = make_core(nodes=2, dram_pages=10, ssd_pages=100, high_watermark=0.8,
                     low_watermark=0.6, promote_on_read=False)
    for i in range(16):
        put(core, KEYS[i], now_s=i)  # 16/20 pages: at, not past, 80%
    put(core, "new", now_s=20)  # 17/20: demote down to 12/20, the five oldest
    orders = core.take_demotions()
    assert [d.key for d in orders] == KEYS[:5] and core.take_demotions() == []
    oldest = orders[0]
    assert oldest.source.tier == "dram" and oldest.target.tier == "ssd"
    assert oldest.source.node_id == oldest.target.node_id
    # Still readable from its DRAM copy while the copy to SSD runs.
    assert core.get(oldest.key, now_s=21).replicas == (oldest.source,)
    assert core.stats()["ssd"].used_bytes == len(orders) * PAGE
    core.check_invariants()
    assert core.demote_done(oldest.key, oldest.source.node_id, now_s=22)
    assert core.get(oldest.key, now_s=30).replicas == (oldest.target,)
    assert core.events_since(0)[-1].kind == "demoted"
    assert any(r.op == "demote" for r in core.take_journal())
    core.check_invariants()
    assert core.stats()["dram"].used_bytes == 17 * PAGE  # the get's lease holds the DRAM copy
    core.reclaim_pending(now_s=30)
    assert core.stats()["dram"].used_bytes == 16 * PAGE
    for d in orders[1:]:
        core.demote_done(d.key, d.source.node_id, now_s=31)
    assert core.stats()["dram"].used_bytes == 12 * PAGE
    assert core.stats()["dram"].evictions == 5
    core.check_invariants()


def test_demote_abort_keeps_the_dram_copy_and_frees_the_ssd_space() -> None:
    core = make_core(dram_pages=10, ssd_pages=10, high_watermark=0.8, low_watermark=0.6)
    for i in range(9):
        put(core, KEYS[i], now_s=i)
    [d, *_] = core.take_demotions()
    assert core.demote_abort(d.key, d.source.node_id)
    assert core.get(d.key, now_s=20).replicas == (d.source,)
    assert not core.demote_done(d.key, d.source.node_id, now_s=20)
    core.check_invariants()


def test_demotion_not_reported_in_time_is_aborted() -> None:
    core = make_core(dram_pages=10, ssd_pages=10, high_watermark=0.8, low_watermark=0.6,
                     put_timeout_s=30)
    for i in range(9):
        put(core, KEYS[i], now_s=i)
    orders = core.take_demotions()
    core.reclaim_pending(now_s=100)
    assert core.stats()["ssd"].used_bytes == 0
    assert not core.demote_done(orders[0].key, "n0", now_s=100)
    assert core.exists([d.key for d in orders]) == [True] * len(orders)


def test_removing_an_object_mid_demotion_frees_the_target_after_the_copier_times_out() -> None:
    core = make_core(dram_pages=10, ssd_pages=10, high_watermark=0.8, low_watermark=0.7,
                     put_timeout_s=30)
    for i in range(9):
        put(core, KEYS[i], now_s=i)
    d, other = core.take_demotions()  # 9/10 pages: two go, both ordered at t=8
    assert core.demote_done(other.key, "n0", now_s=9)
    core.remove(d.key, now_s=10)
    assert not core.demote_done(d.key, "n0", now_s=11)
    assert core.stats()["ssd"].used_bytes == 2 * PAGE  # d's copier may still be writing
    core.check_invariants()
    core.reclaim_pending(now_s=8 + 30)
    assert core.stats()["ssd"].used_bytes == PAGE
    core.check_invariants()


def test_ssd_past_its_watermark_drops_replicas() -> None:
    core = make_core(dram_pages=4, ssd_pages=4, high_watermark=0.8, low_watermark=0.5)
    for i in range(4):
        put(core, KEYS[i], now_s=i)  # DRAM 4/4: demote down to 2 -> SSD 2/4
    for d in core.take_demotions():
        core.demote_done(d.key, "n0", now_s=5)
    for i in range(4, 6):
        put(core, KEYS[i], now_s=i + 10)  # DRAM full again: 2 more demoted, SSD 4/4
    for d in core.take_demotions():
        core.demote_done(d.key, "n0", now_s=20)
    core.evict(now_s=21)
    assert core.stats()["ssd"].used_bytes <= 2 * PAGE
    assert core.stats()["ssd"].evictions >= 2
    core.check_invariants()


def test_default_eviction_is_exact_lru_over_many_objects() -> None:
    import random

    core = make_core(dram_pages=100, eviction_sample=0, high_watermark=0.9, low_watermark=0.5,
                     lease_s=0.001)
    for i in range(90):
        put(core, KEYS[i], now_s=i)
    order = list(range(90))
    random.Random(0).shuffle(order)
    for t, i in enumerate(order):  # every object read once, in a shuffled order
        core.get(KEYS[i], now_s=100 + t)
    put(core, "new", pages=1, now_s=1000)  # 91 > 90 pages: evict down to 50
    kept = set(keys_of(core, KEYS[:90]))
    expected = {KEYS[i] for i in order[-49:]}  # the 49 most recently read (+ "new" = 50)
    assert kept == expected


def _demote_everything_but(core, keep: int, now_s: float) -> list:
    orders = core.take_demotions()
    for d in orders:
        assert core.demote_done(d.key, d.source.node_id, now_s=now_s)
    core.reclaim_pending(now_s=now_s + 100)  # leases over: demoted DRAM extents freed
    return orders


def test_reading_an_object_that_lives_only_on_ssd_promotes_it_back_to_dram() -> None:
    core = make_core(dram_pages=10, ssd_pages=100, high_watermark=0.8, low_watermark=0.6)
    for i in range(9):
        put(core, KEYS[i], now_s=i)  # 9/10 pages: the three oldest are demoted
    demoted = _demote_everything_but(core, 6, now_s=10)
    cold = demoted[0].key
    assert [p.tier for p in core.get(cold, now_s=200).replicas] == ["ssd"]  # served from SSD
    [promo] = core.take_demotions()
    assert promo.key == cold and promo.source.tier == "ssd" and promo.target.tier == "dram"
    assert promo.source.node_id == promo.target.node_id
    core.check_invariants()
    # A second read while the copy runs orders nothing more and still reads the SSD copy.
    assert [p.tier for p in core.get(cold, now_s=201).replicas] == ["ssd"]
    assert core.take_demotions() == []
    assert core.demote_done(cold, promo.source.node_id, now_s=202)
    assert core.get(cold, now_s=203).replicas == (promo.target,)
    assert core.events_since(0)[-1].kind == "promoted"
    core.reclaim_pending(now_s=400)
    assert core.stats()["ssd"].used_bytes == (len(demoted) - 1) * PAGE  # the SSD copy freed
    core.check_invariants()
    # The journal replays to the same placement.
    restored = core.restore(core.config, None, core.take_journal(), now_s=500)
    assert restored.get(cold, now_s=500).replicas == (promo.target,)


def test_promotion_makes_room_by_demoting_colder_objects_and_can_be_turned_off() -> None:
    core = make_core(dram_pages=10, ssd_pages=100, high_watermark=1.0, low_watermark=0.9)
    for i in range(10):
        put(core, KEYS[i], now_s=i)  # DRAM exactly full
    [hot] = put(core, "hot", now_s=10)  # no room: k000's demotion starts, "hot" lands on SSD
    assert hot.tier == "ssd"
    [first] = core.take_demotions()
    assert first.key == KEYS[0]
    core.get("hot", now_s=11)  # DRAM full (k000's copy still running): demote a colder one
    [second] = core.take_demotions()
    assert second.key == KEYS[1] and second.source.tier == "dram"
    for d in (first, second):
        core.demote_done(d.key, "n0", now_s=12)
    core.reclaim_pending(now_s=200)
    core.get("hot", now_s=201)  # now there is room: "hot" comes back
    [promo] = core.take_demotions()
    assert promo.key == "hot" and promo.target.tier == "dram"
    core.check_invariants()

    off = make_core(dram_pages=10, ssd_pages=100, high_watermark=0.8, low_watermark=0.6,
                    promote_on_read=False)
    for i in range(9):
        put(off, KEYS[i], now_s=i)
    demoted = _demote_everything_but(off, 6, now_s=10)
    off.get(demoted[0].key, now_s=200)
    assert off.take_demotions() == []
