"""FileJournal and RedisJournal: a restored master equals the live one's committed state."""

from __future__ import annotations

import json

import pytest

from pdserve.kvstore.master import MasterCore, Record
from pdserve.kvstore.master.journal import FileJournal, JournalError, RedisJournal
from tests.kvstore.master.factories import PAGE, add_node, make_core, put


def busy_core() -> MasterCore:
    """A core whose history has every record kind: nodes, commits, pins, demotions,
    evictions, corruption, removal, a dead node."""
    core = make_core(nodes=2, dram_pages=8, ssd_pages=8, high_watermark=0.8, low_watermark=0.6)
    add_node(core, "n2", dram_pages=8)  # no SSD: its evicted replicas are dropped
    for i in range(10):
        put(core, f"a{i}", replicas=2, now_s=i)
    for d in core.take_demotions():
        core.demote_done(d.key, d.source.node_id, now_s=10)
    core.pin("a9", ttl_s=100, now_s=10)
    core.report_corrupt("a9", core.get("a9", now_s=10).replicas[0].node_id, now_s=10)
    core.remove("a8", now_s=11)
    core.heartbeat("n0", now_s=15)
    core.heartbeat("n1", now_s=15)
    core.expire_nodes(now_s=15)  # n2 is dead
    return core


def journal_roundtrip(journal) -> None:
    core = busy_core()
    ops = {r.op for r in core._outbox}
    assert {"register_node", "commit", "pin", "demote", "evict", "corrupt", "remove",
            "node_dead"} <= ops
    journal.append(core.take_journal())
    snap = core.snapshot()
    journal.write_snapshot(snap, snap["journal_seq"])
    # After the snapshot: more committed work, appended but never snapshotted (then a crash),
    # and a put that was started but not committed (never journaled).
    put(core, "late", now_s=20)
    core.remove("a5", now_s=20)
    core.put_start("uncommitted", PAGE, 0, 1, now_s=21)
    tail = core.take_journal()
    journal.append(tail)
    loaded_snapshot, records = journal.load()
    assert [r.seq for r in records] == [r.seq for r in tail]
    restored = MasterCore.restore(core.config, loaded_snapshot, records, now_s=30)
    assert restored.committed_state() == core.committed_state()
    assert restored.exists(["late", "a5", "uncommitted"]) == [True, False, False]
    restored.check_invariants()
    # The restored master carries on numbering where the old one stopped.
    put(restored, "next", now_s=31)
    journal.append(restored.take_journal())
    assert MasterCore.restore(core.config, *journal.load(), now_s=32).exists(["next"]) == [True]


def test_file_journal_roundtrip(tmp_path) -> None:
    journal_roundtrip(FileJournal(tmp_path / "j", fsync=False))


def test_file_journal_from_log_only_and_after_reopen(tmp_path) -> None:
    core = busy_core()
    FileJournal(tmp_path, fsync=True).append(core.take_journal())
    snapshot, records = FileJournal(tmp_path).load()
    assert snapshot is None
    assert MasterCore.restore(core.config, None, records, 0).committed_state() == \
        core.committed_state()


def test_file_journal_snapshot_truncates_the_log(tmp_path) -> None:
    journal = FileJournal(tmp_path, fsync=False)
    core = busy_core()
    records = core.take_journal()
    journal.append(records)
    snap = core.snapshot()
    journal.write_snapshot(snap, snap["journal_seq"])
    assert journal.log_path.read_text() == ""
    assert not list(tmp_path.glob("*.tmp"))
    # A crash after the snapshot but before the log was rewritten: covered records skipped.
    journal.log_path.write_text("".join(
        json.dumps(r.to_dict()) + "\n" for r in records))
    loaded, tail = FileJournal(tmp_path).load()
    assert loaded == snap and tail == []


def test_file_journal_drops_a_torn_last_line_and_appends_cleanly_after_it(tmp_path) -> None:
    journal = FileJournal(tmp_path, fsync=False)
    journal.append([Record(1, "pin", {"key": "a", "pin_until_s": 1.0})])
    with open(journal.log_path, "a") as f:
        f.write('{"seq": 2, "op": "pi')  # the process died mid-write
    assert [r.seq for r in FileJournal(tmp_path).load()[1]] == [1]
    reopened = FileJournal(tmp_path, fsync=False)
    reopened.append([Record(2, "pin", {"key": "a", "pin_until_s": 2.0})])
    assert [r.seq for r in reopened.load()[1]] == [1, 2]


def test_journals_refuse_records_out_of_sequence(tmp_path) -> None:
    journal = FileJournal(tmp_path, fsync=False)
    journal.append([Record(1, "x"), Record(2, "x")])
    with pytest.raises(JournalError, match="seq 2"):
        journal.append([Record(2, "x")])
    (tmp_path / "journal.log").write_text("not json\n{}\n")
    with pytest.raises(JournalError, match="unreadable"):
        FileJournal(tmp_path).load()


def test_redis_journal_roundtrip(redis_client) -> None:
    journal_roundtrip(RedisJournal(redis_client, prefix="t1"))


def test_redis_journal_snapshot_trims_covered_records_atomically(redis_client) -> None:
    journal = RedisJournal(redis_client, prefix="t2")
    core = busy_core()
    records = core.take_journal()
    journal.append(records[:5])
    snap = core.snapshot()
    journal.append(records[5:])
    journal.write_snapshot(snap, upto_seq=records[3].seq)  # covers the first four only
    assert redis_client.llen("t2:log") == len(records) - 4
    loaded, tail = RedisJournal(redis_client, prefix="t2").load()
    assert loaded == snap and [r.seq for r in tail] == [r.seq for r in records[4:]]
    # A new journal object on the same keys continues the sequence check.
    with pytest.raises(JournalError):
        RedisJournal(redis_client, prefix="t2").append(records[-1:])


def test_redis_journal_empty(redis_client) -> None:
    assert RedisJournal(redis_client, prefix="none").load() == (None, [])


def test_a_fenced_redis_journal_refuses_writes_after_the_lease_moves(redis_client) -> None:
    from pdserve.kvstore.master.election import LeaderElection
    from pdserve.kvstore.master.journal import JournalFenced, RedisJournal
    from pdserve.kvstore.master.model import Record

    old = LeaderElection(redis_client, "fence:leader", "old", lease_s=30)
    assert old.try_acquire()
    journal = RedisJournal(redis_client, prefix="fence", fence=("fence:leader", "old"))
    journal.append([Record(1, "remove", {"key": "a", "now_s": 0.0})])
    old.release()
    new = LeaderElection(redis_client, "fence:leader", "new", lease_s=30)
    assert new.try_acquire()
    with pytest.raises(JournalFenced):
        journal.append([Record(2, "remove", {"key": "b", "now_s": 0.0})])
    assert [r.seq for r in RedisJournal(redis_client, prefix="fence").load()[1]] == [1]
