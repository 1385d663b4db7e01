"""A router following the cluster's membership table: which moves it makes of its own pools.

A worker it does not know joins in the table's role; a controller's move it has not applied
(a new state_seq) is applied once; routers' own entries and joins it already knows are left
alone (liveness is the router's own polls). Applied through the real `WorkerSet`: a draining
worker leaves the pools of the router that follows, and comes back in its new role.
"""

from __future__ import annotations

from pdserve.core.roles import ACTIVE, DECODE, DRAINING, PREFILL
from pdserve.proto import cluster_pb2 as cpb
from pdserve.router.cluster_feed import Change, ClusterFeed, changes
from pdserve.router.policy import make_policy
from pdserve.router.pool import WorkerSet


def member(address, role=PREFILL, state=ACTIVE, seq=0, kind="worker", reason=""):
    return cpb.ClusterMember(address=address, kind=kind, role=role, state=state,
                             state_seq=seq, reason=reason)


def test_unknown_workers_join_and_new_moves_apply_once():
    entries = [member("r:1", "", kind="router"), member("w1:1"), member("w2:1", DECODE),
               member("w3:1", PREFILL, DRAINING, seq=2, reason="switching")]
    got = changes(entries, known={"w2:1"}, applied={})
    assert got == [Change("w1:1", True, PREFILL), Change("w3:1", True, PREFILL),
                   Change("w3:1", False, PREFILL, DRAINING, "switching")]
    assert changes(entries, known={"w1:1", "w2:1", "w3:1"}, applied={"w3:1": 2}) == []
    moved = [member("w3:1", DECODE, ACTIVE, seq=3, reason="switched")]
    assert changes(moved, known={"w3:1"}, applied={"w3:1": 2}) == [
        Change("w3:1", False, DECODE, ACTIVE, "switched")]


class _NoTable:
    def close(self):
        pass


def test_the_follower_moves_its_own_pools_and_a_new_epoch_reapplies():
    ws = WorkerSet([], [], prefill_policy=make_policy("round_robin"),
                   decode_policy=make_policy("least_loaded"), stats_interval_s=3600)
    try:
        feed = ClusterFeed(_NoTable(), ws, "me:1")
        feed.apply(cpb.MembersView(epoch="a", version=1, members=[
            member("w1:1"), member("w2:1", DECODE)]))
        assert {(m.address, m.role, m.state) for m in ws.members()} == {
            ("w1:1", PREFILL, ACTIVE), ("w2:1", DECODE, ACTIVE)}
        feed.apply(cpb.MembersView(epoch="a", version=2, members=[
            member("w1:1", PREFILL, DRAINING, seq=1, reason="switching to decode"),
            member("w2:1", DECODE)]))
        assert ws.get("w1:1").state == DRAINING
        feed.apply(cpb.MembersView(epoch="a", version=3, members=[
            member("w1:1", DECODE, ACTIVE, seq=2, reason="switched"), member("w2:1", DECODE)]))
        assert (ws.get("w1:1").state, ws.get("w1:1").role) == (ACTIVE, DECODE)
        # A restarted master: seqs count from 0 again; the next move (seq 1) still applies.
        feed.apply(cpb.MembersView(epoch="b", version=1, members=[
            member("w1:1", DECODE, DRAINING, seq=1, reason="again")]))
        assert ws.get("w1:1").state == DRAINING and feed.epoch == "b"
    finally:
        ws.close()
