"""LeaderElection: one leader at a time through a Redis lease; a standby takes over."""

from __future__ import annotations

import time

import pytest

from pdserve.kvstore.master import ConfigError
from pdserve.kvstore.master.election import LeaderElection

LEASE_S = 0.3


def test_standby_takes_over_when_the_leader_stops_renewing(redis_client) -> None:
    a = LeaderElection(redis_client, "master:leader", "a", LEASE_S)
    b = LeaderElection(redis_client, "master:leader", "b", LEASE_S)
    assert a.try_acquire() and a.epoch == 1
    assert not b.try_acquire()
    assert b.current_leader() == "a" and a.is_leader() and not b.is_leader()
    assert a.try_acquire()  # already ours: a renewal
    time.sleep(LEASE_S / 2)
    assert a.renew()  # renewed: still a's after the first lease would have ended
    time.sleep(LEASE_S * 0.7)
    assert not b.try_acquire()
    # a stops renewing (it hangs or dies); once the lease runs out, b wins.
    deadline = time.monotonic() + 3
    while not b.try_acquire():
        assert time.monotonic() < deadline, "b never became leader"
        time.sleep(0.02)
    assert b.current_leader() == "b" and b.epoch == 2  # a higher fencing token
    assert not a.renew()  # the old leader finds out it must step down


def test_only_the_holder_can_release(redis_client) -> None:
    a = LeaderElection(redis_client, "lk", "a", 10)
    b = LeaderElection(redis_client, "lk", "b", 10)
    assert a.try_acquire()
    assert not b.release()
    assert a.current_leader() == "a"
    assert a.release()
    assert a.current_leader() is None
    assert b.try_acquire()


def test_bad_arguments() -> None:
    with pytest.raises(ConfigError, match="lease_s"):
        LeaderElection(None, "k", "a", 0)
    with pytest.raises(ConfigError, match="candidate_id"):
        LeaderElection(None, "k", "", 1)
