"""MasterCore: two-phase puts, placement, reads with leases, remove, argument checks."""

from __future__ import annotations

import pytest

from pdserve.kvstore.master import (
    AlreadyExists, InvalidArgument, NoSpace, NotFound, PutInProgress, SegmentSpec,
)
from tests.kvstore.master.factories import PAGE, add_node, make_core, put, used_pages


def test_pending_put_is_invisible_until_commit() -> None:
    core = make_core()
    [p] = core.put_start("k", 3 * PAGE, 7, 1, now_s=0)
    assert (p.node_id, p.tier, p.offset, p.size, p.shm_path) == ("n0", "dram", 0, 3 * PAGE,
                                                                 "/dev/shm/n0")
    assert core.exists(["k"]) == [False]
    with pytest.raises(NotFound):
        core.get("k", now_s=0)
    assert core.longest_prefix(["k"], now_s=0) == (0, [])
    assert core.stats()["dram"].pending == 1 and used_pages(core) == 3
    core.put_commit("k", now_s=1)
    info = core.get("k", now_s=2)
    assert (info.size, info.checksum, info.replicas) == (3 * PAGE, 7, (p,))
    assert [e.kind for e in core.events_since(0)][-1] == "stored"
    core.check_invariants()


def test_replicas_land_on_distinct_nodes_and_at_most_one_per_node() -> None:
    core = make_core(nodes=3)
    placements = core.put_start("k", PAGE, 0, 3, now_s=0)
    assert sorted(p.node_id for p in placements) == ["n0", "n1", "n2"]
    # More replicas than nodes: as many as there are nodes.
    assert len(core.put_start("k2", PAGE, 0, 5, now_s=0)) == 3
    core.check_invariants()


def test_placement_prefers_the_node_with_most_free_dram() -> None:
    core = make_core(nodes=0)
    add_node(core, "small", dram_pages=10)
    add_node(core, "big", dram_pages=50)
    assert put(core, "a")[0].node_id == "big"
    assert [p.node_id for p in core.put_start("b", PAGE, 0, 2, now_s=0)] == ["big", "small"]


def test_full_node_is_skipped_and_fewer_replicas_are_placed() -> None:
    core = make_core(nodes=2, dram_pages=4, high_watermark=1.0, low_watermark=0.5)
    assert put(core, "big", pages=4)[0].node_id == "n0"
    core.get("big", now_s=0)  # n0 is full of a leased object
    placements = core.put_start("k", PAGE, 0, 2, now_s=1)
    assert [p.node_id for p in placements] == ["n1"]


def test_committed_key_answers_already_exists_and_pending_key_put_in_progress() -> None:
    core = make_core()
    put(core, "done")
    core.put_start("busy", PAGE, 0, 1, now_s=0)
    with pytest.raises(AlreadyExists):
        core.put_start("done", PAGE, 0, 1, now_s=1)
    with pytest.raises(PutInProgress):
        core.put_start("busy", PAGE, 0, 1, now_s=1)


def test_abort_frees_the_space_and_a_later_commit_fails() -> None:
    core = make_core()
    core.put_start("k", 2 * PAGE, 0, 1, now_s=0)
    assert core.put_abort("k") and not core.put_abort("k")
    assert used_pages(core) == 0
    with pytest.raises(NotFound):
        core.put_commit("k", now_s=1)
    core.check_invariants()


def test_commit_is_idempotent() -> None:
    core = make_core()
    put(core, "k")
    core.put_commit("k", now_s=1)
    assert len([r for r in core.take_journal() if r.op == "commit"]) == 1


def test_uncommitted_put_is_reclaimed_after_put_timeout() -> None:
    core = make_core(put_timeout_s=30)
    core.put_start("k", PAGE, 0, 1, now_s=0)
    assert core.reclaim_pending(now_s=29.9) == []
    assert used_pages(core) == 1
    assert core.reclaim_pending(now_s=30) == ["k"]
    assert used_pages(core) == 0
    with pytest.raises(NotFound):
        core.put_commit("k", now_s=31)
    put(core, "k", now_s=32)  # the key is free again
    assert core.exists(["k"]) == [True]


def test_get_grants_a_lease_and_refreshes_lru() -> None:
    core = make_core(lease_s=5)
    put(core, "k")
    assert core.get("k", now_s=10).lease_until_s == 15
    assert core.get("k", now_s=11).lease_until_s == 16
    with pytest.raises(NotFound):
        core.get("nope", now_s=11)


def test_remove_unleased_frees_at_once() -> None:
    core = make_core()
    put(core, "k", pages=2)
    core.remove("k", now_s=1)
    assert core.exists(["k"]) == [False] and used_pages(core) == 0
    assert core.events_since(0)[-1].kind == "removed"
    with pytest.raises(NotFound):
        core.remove("k", now_s=1)


def test_remove_of_a_leased_object_hides_it_now_and_frees_bytes_when_the_lease_ends() -> None:
    core = make_core(lease_s=5)
    put(core, "k", pages=2)
    core.get("k", now_s=10)  # leased until 15
    core.remove("k", now_s=11)
    assert core.exists(["k"]) == [False]
    core.check_invariants()
    core.reclaim_pending(now_s=14.9)
    assert used_pages(core) == 2  # a reader may still be copying out of it
    core.reclaim_pending(now_s=15)
    assert used_pages(core) == 0
    core.check_invariants()


def test_no_space_when_nothing_fits() -> None:
    core = make_core(nodes=0)
    with pytest.raises(NoSpace, match="no storage nodes"):
        core.put_start("k", PAGE, 0, 1, now_s=0)
    add_node(core, "n0", dram_pages=4)
    with pytest.raises(NoSpace, match="exceed every segment"):
        core.put_start("k", 5 * PAGE, 0, 1, now_s=0)
    put(core, "a", pages=4)
    core.get("a", now_s=0)  # leased: not evictable
    with pytest.raises(NoSpace, match="even after eviction"):
        core.put_start("k", PAGE, 0, 1, now_s=1)
    assert core.exists(["a"]) == [True]
    core.check_invariants()


def test_full_dram_of_leased_objects_falls_back_to_ssd() -> None:
    core = make_core(dram_pages=2, ssd_pages=10, high_watermark=1.0, low_watermark=0.5)
    put(core, "a", pages=2)
    core.get("a", now_s=0)
    [p] = core.put_start("b", PAGE, 0, 1, now_s=1)
    assert p.tier == "ssd" and p.segment_id == "n0-ssd"


@pytest.mark.parametrize("kwargs,field", [
    (dict(key=""), "key"), (dict(size=0), "size"), (dict(replicas=0), "replicas"),
    (dict(checksum=-1), "checksum"), (dict(size=1.5), "size"), (dict(now_s=float("nan")), "now_s"),
])
def test_put_start_rejects_bad_arguments_naming_them(kwargs, field) -> None:
    args = dict(key="k", size=PAGE, checksum=0, replicas=1, now_s=0.0) | kwargs
    with pytest.raises(InvalidArgument, match=field):
        make_core().put_start(**args)


def test_register_node_rejects_bad_segments() -> None:
    core = make_core(nodes=0)
    with pytest.raises(InvalidArgument, match="tier"):
        core.register_node("n", "h", "a:1", [SegmentSpec("s", PAGE, "tape")], 0)
    with pytest.raises(InvalidArgument, match="distinct"):
        core.register_node("n", "h", "a:1", [("s", PAGE, "dram", ""), ("s", PAGE, "ssd", "")], 0)
    with pytest.raises(InvalidArgument, match="empty"):
        core.register_node("n", "h", "a:1", [], 0)
