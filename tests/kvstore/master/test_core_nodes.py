"""MasterCore: prefix queries, node liveness, corruption reports, events, stats, restore."""

from __future__ import annotations

import json

import pytest

from pdserve.kvstore.master import (
    EventsLost, MasterCore, NotFound, Record, RestoreError, UnknownNode,
)
from tests.kvstore.master.factories import PAGE, add_node, make_core, put, used_pages


def test_longest_prefix_counts_leading_committed_keys_and_says_where_they_are() -> None:
    core = make_core(nodes=2)
    a = put(core, "a", replicas=2)
    b = put(core, "b")
    put(core, "d")
    core.put_start("c", PAGE, 0, 1, now_s=0)  # pending: not cached yet
    assert core.longest_prefix(["a", "b", "c", "d"], now_s=1) == (2, [a, b])
    assert core.longest_prefix(["x", "a"], now_s=1) == (0, [])
    assert core.longest_prefix([], now_s=1) == (0, [])
    assert core.exists(["a", "c", "d", "x"]) == [True, False, True, False]


def test_silent_node_is_declared_dead_and_its_replicas_dropped() -> None:
    core = make_core(nodes=2, node_timeout_s=10)
    put(core, "only_n0", replicas=1)  # n0: both empty, tie broken by node id
    put(core, "both", replicas=2)
    core.put_start("pending", PAGE, 0, 1, now_s=0)  # n1 now has more free DRAM
    core.heartbeat("n1", now_s=8)
    assert core.expire_nodes(now_s=10) == []
    seq = core.events_since(0)[-1].seq
    assert core.expire_nodes(now_s=10.5) == ["n0"]
    assert core.exists(["only_n0", "both"]) == [False, True]
    assert [p.node_id for p in core.get("both", now_s=11).replicas] == ["n1"]
    events = [(e.kind, e.key, e.node_ids, e.reason) for e in core.events_since(seq)]
    assert events == [("evicted", "only_n0", ("n0",), "node_lost"),
                      ("replica_dropped", "both", ("n0",), "node_lost"),
                      ("node_dead", "", ("n0",), "")]
    assert core.stats()["dram"].capacity_bytes == 100 * PAGE
    with pytest.raises(UnknownNode):
        core.heartbeat("n0", now_s=11)
    core.put_commit("pending", now_s=11)  # it was on n1, which lives
    core.check_invariants()


def test_pending_put_whose_only_node_dies_cannot_commit() -> None:
    core = make_core(nodes=1)
    core.put_start("k", PAGE, 0, 1, now_s=0)
    core.expire_nodes(now_s=100)
    with pytest.raises(NotFound):
        core.put_commit("k", now_s=100)
    core.check_invariants()


def test_a_node_that_registers_again_is_treated_as_restarted() -> None:
    core = make_core(nodes=1)
    put(core, "k")
    add_node(core, "n0", now_s=5)
    assert core.exists(["k"]) == [False] and used_pages(core) == 0
    assert [r.op for r in core.take_journal()][-2:] == ["node_dead", "register_node"]


def test_corrupt_replica_is_dropped_and_the_last_one_removes_the_object() -> None:
    core = make_core(nodes=2)
    put(core, "k", replicas=2)
    assert core.report_corrupt("k", "n0", now_s=1)
    assert not core.report_corrupt("k", "n0", now_s=1)
    assert [p.node_id for p in core.get("k", now_s=1).replicas] == ["n1"]
    assert core.report_corrupt("k", "n1", now_s=2)
    assert core.exists(["k"]) == [False]
    assert core.events_since(0)[-1].reason == "corrupt"
    assert not core.report_corrupt("nope", "n1", now_s=2)
    core.check_invariants()  # the lease from the get defers the free; still consistent


def test_event_log_is_bounded_and_says_when_events_were_lost() -> None:
    core = make_core(nodes=1, max_events=3)
    for k in "abcd":
        put(core, k)
    # 5 events so far (node_joined + 4 stored); only seqs 3..5 are kept.
    assert [e.key for e in core.events_since(2)] == ["b", "c", "d"]
    assert core.events_since(5) == [] and core.events_since(99) == []
    with pytest.raises(EventsLost):
        core.events_since(1)


def test_stats_per_tier() -> None:
    core = make_core(nodes=2, dram_pages=10, ssd_pages=20)
    put(core, "a", pages=2, replicas=2)
    core.put_start("b", 3 * PAGE - 1, 0, 1, now_s=0)
    dram, ssd = core.stats()["dram"], core.stats()["ssd"]
    assert (dram.capacity_bytes, dram.used_bytes, dram.objects, dram.pending) == (
        20 * PAGE, 7 * PAGE, 1, 1)
    assert (ssd.capacity_bytes, ssd.used_bytes, ssd.objects, ssd.evictions) == (40 * PAGE, 0, 0, 0)


def test_snapshot_due_after_snapshot_every_ops_records() -> None:
    core = make_core(nodes=1, snapshot_every_ops=3)  # register_node is record 1
    put(core, "a")
    assert not core.snapshot_due()
    put(core, "b")
    assert core.snapshot_due()
    core.snapshot()
    assert not core.snapshot_due()


def test_restore_rebuilds_committed_state_and_skips_pending_puts() -> None:
    core = make_core(nodes=2, dram_pages=10, ssd_pages=10)
    put(core, "a", replicas=2)
    snap = json.loads(json.dumps(core.snapshot()))
    core.take_journal()
    put(core, "b", now_s=1)
    core.pin("a", ttl_s=50, now_s=1)
    core.put_start("pending", PAGE, 0, 1, now_s=2)
    records = core.take_journal()
    restored = MasterCore.restore(core.config, snap, records, now_s=3)
    assert restored.committed_state() == core.committed_state()
    assert restored.exists(["a", "b", "pending"]) == [True, True, False]
    restored.check_invariants()
    # Records the snapshot already covers are skipped; a gap is refused.
    again = MasterCore.restore(core.config, restored.snapshot(), records, now_s=3)
    assert again.committed_state() == core.committed_state()
    with pytest.raises(RestoreError, match="gap"):
        MasterCore.restore(core.config, snap, records[1:], now_s=3)
    # Restored nodes count as seen at restore time.
    assert restored.expire_nodes(now_s=3 + core.config.node_timeout_s) == []


def test_a_standby_following_the_journal_stays_equal_and_rejects_bad_records() -> None:
    leader = make_core(nodes=2, dram_pages=10, ssd_pages=10)
    standby = MasterCore(leader.config)
    ops = set()
    for i in range(20):
        put(leader, f"k{i}", now_s=i)
        for d in leader.take_demotions():
            leader.demote_done(d.key, d.source.node_id, now_s=i)
        records = leader.take_journal()
        ops |= {r.op for r in records}
        standby.replay(records, now_s=i)
        assert standby.committed_state() == leader.committed_state()
    assert "demote" in ops
    standby.check_invariants()
    with pytest.raises(RestoreError, match="unknown op"):
        standby.replay([Record(standby.committed_state()["journal_seq"] + 1, "explode")], 20)
    with pytest.raises(RestoreError, match="no replica"):
        standby.replay([Record(standby.committed_state()["journal_seq"] + 1, "evict",
                               {"key": "k19", "node_id": "nowhere"})], 20)
