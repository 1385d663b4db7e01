"""The cluster's membership table: the pure rules, then the service on a real master process.

The table takes workers' and routers' joins (a heartbeat), the controller's moves, and drops
members silent for three heartbeats. A worker's reported role wins, except within a heartbeat
after the controller moved it (a heartbeat sent before a switch may arrive after it). On a
real master (mutual TLS), the long poll answers as soon as the table changes, a standby of an
HA pair refuses and names the leader (the client follows it), and the kinds the table admits
are enforced: a worker may join but not move members.
"""

from __future__ import annotations

import os
import threading
import time

import grpc
import pytest

from pdserve import rpc
from pdserve.core.identity import MASTER, WORKER
from pdserve.core.roles import ACTIVE, DECODE, DRAINING, FAILED, PREFILL
from pdserve.kvstore.master.members import (MAX_FIELD, ROUTER_KIND, WORKER_KIND, MemberError,
                                            Members, UnknownMember)
from pdserve.kvstore.members_client import MembersClient
from pdserve.proto import cluster_pb2 as cpb
from pdserve.proto import cluster_pb2_grpc as cpb_grpc
from pdserve.security import tls
from tests.helpers import free_port
from tests.kvstore.master.test_ha_processes import is_leader, start_ha_master
from tests.kvstore.test_dist_store import start_master, stop


def test_joins_moves_and_the_version_a_follower_waits_on():
    t = Members("e1", heartbeat_s=5.0)
    t.join("w1:1", WORKER_KIND, PREFILL, now=0.0)
    t.join("r1:1", ROUTER_KIND, "", now=0.0, client_address="r1:9")
    assert t.version == 2
    t.join("w1:1", WORKER_KIND, PREFILL, now=4.0)  # a heartbeat that changes nothing
    assert t.version == 2 and t.get("w1:1").joined_s == 4.0
    e = t.set_state("w1:1", DRAINING, "", "switching to decode", now=5.0)
    assert (e.state, e.role, e.state_seq, t.version) == (DRAINING, PREFILL, 1, 3)
    # A heartbeat sent before the switch, arriving after the controller's move: role kept.
    t.join("w1:1", WORKER_KIND, PREFILL, now=5.5)
    e = t.set_state("w1:1", ACTIVE, DECODE, "switched to decode", now=6.0)
    assert (e.state, e.role, e.state_seq) == (ACTIVE, DECODE, 2)
    t.join("w1:1", WORKER_KIND, PREFILL, now=6.5)
    assert t.get("w1:1").role == DECODE
    # Long after the move, the worker's own report wins (someone switched it by hand).
    v = t.version
    t.join("w1:1", WORKER_KIND, PREFILL, now=20.0)
    assert t.get("w1:1").role == PREFILL and t.version == v + 1
    assert [x.address for x in t.entries()] == ["r1:1", "w1:1"]  # routers first, then workers


def test_silent_members_leave_after_three_heartbeats():
    t = Members("e1", heartbeat_s=1.0)
    t.join("w1:1", WORKER_KIND, DECODE, now=0.0)
    t.join("w2:1", WORKER_KIND, DECODE, now=2.5)
    v = t.version
    assert t.expire(3.0) == [] and t.version == v
    assert t.expire(3.1) == ["w1:1"] and t.version == v + 1
    assert [e.address for e in t.entries()] == ["w2:1"]


def test_bad_joins_and_moves_name_the_field():
    t = Members("e1", max_members=1)
    with pytest.raises(MemberError, match="^address: required"):
        t.join("", WORKER_KIND, PREFILL, 0.0)
    with pytest.raises(MemberError, match="^kind: "):
        t.join("a:1", "gateway", PREFILL, 0.0)
    with pytest.raises(MemberError, match="^role: "):
        t.join("a:1", WORKER_KIND, "both", 0.0)
    with pytest.raises(MemberError, match="^address: at most"):
        t.join("a" * (MAX_FIELD + 1), WORKER_KIND, PREFILL, 0.0)
    t.join("a:1", WORKER_KIND, PREFILL, 0.0)
    with pytest.raises(MemberError, match="^address: the table holds its limit of 1"):
        t.join("b:1", WORKER_KIND, PREFILL, 0.0)
    with pytest.raises(MemberError, match="^kind: a:1 joined as a worker"):
        t.join("a:1", ROUTER_KIND, "", 0.0)
    with pytest.raises(UnknownMember, match="^address: no worker b:1"):
        t.set_state("b:1", DRAINING, "", "", 0.0)
    with pytest.raises(MemberError, match="^state: "):
        t.set_state("a:1", "gone", "", "", 0.0)
    with pytest.raises(MemberError, match="^role: "):
        t.set_state("a:1", ACTIVE, "both", "", 0.0)
    with pytest.raises(MemberError, match="^reason: at most"):
        t.set_state("a:1", FAILED, "", "x" * (MAX_FIELD + 1), 0.0)


@pytest.fixture
def master(tmp_path):
    address = f"127.0.0.1:{free_port()}"
    proc = start_master(address, str(tmp_path / "journal"))
    yield address
    stop(proc)


def test_the_long_poll_answers_when_the_table_changes(master):
    client = MembersClient(master)
    try:
        client.join("w1:1", WORKER_KIND, PREFILL)
        view = client.watch()
        assert [(m.address, m.kind, m.role, m.state) for m in view.members] == [
            ("w1:1", WORKER_KIND, PREFILL, ACTIVE)]
        got: list = []
        waiter = threading.Thread(target=lambda: got.append(
            client.watch(view.version, view.epoch, wait_s=20.0)))
        t0 = time.monotonic()
        waiter.start()
        time.sleep(0.3)
        assert not got  # nothing changed yet: still waiting
        client.set_state("w1:1", DRAINING, reason="switching")
        waiter.join(timeout=10)
        assert got and time.monotonic() - t0 < 5.0
        [m] = got[0].members
        assert (m.state, m.reason, m.state_seq) == (DRAINING, "switching", 1)
        assert got[0].version > view.version and got[0].epoch == view.epoch
        # Bad input names the field; the table keeps serving.
        with pytest.raises(grpc.RpcError) as e:
            client.set_state("nobody:1", DRAINING)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        assert e.value.details().startswith("address: no worker nobody:1")
        with pytest.raises(grpc.RpcError) as e:
            client.watch(wait_s=31.0)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details().startswith("wait_s:")
        assert len(client.watch().members) == 1
    finally:
        client.close()


def test_a_worker_may_join_but_not_move_members(master):
    as_worker = tls.MutualTls(tls.TlsFolder(os.environ[tls.TLS_DIR_ENV]), WORKER)
    with rpc.make_channel(master, MASTER, security_=as_worker) as ch:
        stub = cpb_grpc.ClusterMembersStub(ch)
        stub.Join(cpb.JoinRequest(address="w1:1", kind=WORKER_KIND, role=DECODE), timeout=5)
        with pytest.raises(grpc.RpcError) as e:
            stub.SetMemberState(cpb.SetMemberStateRequest(address="w1:1", state=FAILED),
                                timeout=5)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_a_standby_names_the_leader_and_the_client_follows_it(redis_server, tmp_path):
    addrs = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    masters = [start_ha_master(addrs[0], redis_server, tmp_path)]
    try:
        deadline = time.monotonic() + 10
        while not is_leader(addrs[0]):
            assert time.monotonic() < deadline, "the first master never became leader"
            time.sleep(0.05)
        masters.append(start_ha_master(addrs[1], redis_server, tmp_path))
        # The standby listed first: the client is refused there, told the leader, and asks it.
        client = MembersClient(f"{addrs[1]},{addrs[0]}")
        try:
            client.join("w1:1", WORKER_KIND, PREFILL)
            assert [m.address for m in client.watch().members] == ["w1:1"]
        finally:
            client.close()
        # After a failover the table is rebuilt from heartbeats, in a new epoch.
        old = MembersClient(addrs[0])
        epoch = old.watch().epoch
        old.close()
        masters[0].kill()
        masters[0].wait()
        client = MembersClient(",".join(addrs))
        try:
            deadline = time.monotonic() + 20
            while True:
                try:
                    client.join("w1:1", WORKER_KIND, PREFILL)
                    break
                except grpc.RpcError:
                    assert time.monotonic() < deadline, "the standby never took over"
                    time.sleep(0.2)
            view = client.watch()
            assert view.epoch != epoch and [m.address for m in view.members] == ["w1:1"]
        finally:
            client.close()
    finally:
        for m in masters:
            stop(m)
