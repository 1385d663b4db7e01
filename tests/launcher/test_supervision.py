"""The restart rule of the launcher's supervision (`pdserve.launcher.restart`): scenarios,
then properties over simulated children that die after random up-times; then the thread that
carries it out (`supervise.py`) over real short-lived processes.

Property settings are derandomized (the same examples every run) and sized to run in seconds.
"""

from __future__ import annotations

import logging
import math
import subprocess
import sys
import time
import types

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.launcher.supervision import Supervision
from pdserve.launcher.restart import (GIVE_UP, RESTART, WAIT, RestartPolicy, Run,
                                           decide)

DETERMINISTIC = settings(max_examples=200, deadline=None, derandomize=True, database=None,
                         suppress_health_check=[HealthCheck.too_slow])


def test_first_death_waits_the_initial_backoff_then_restarts():
    p = RestartPolicy(backoff_s=0.5)
    runs = [Run(0.0, 10.0, -9, restart=False)]
    d = decide(p, runs, now_s=10.2)
    assert (d.action, d.at_s, d.backoff_s) == (WAIT, 10.5, 0.5)
    assert decide(p, runs, now_s=10.5).action == RESTART


def test_quick_deaths_in_a_row_double_the_backoff_up_to_its_cap():
    p = RestartPolicy(backoff_s=0.5, backoff_factor=2.0, backoff_max_s=3.0, max_restarts=100)
    runs = [Run(0.0, 1.0, 1, restart=False)]
    waits = []
    for _ in range(6):
        d = decide(p, runs, now_s=1e9)
        waits.append(d.backoff_s)
        start = runs[-1].ended_s + d.backoff_s
        runs.append(Run(start, start + 1.0, 1, restart=True))
    assert waits == [0.5, 1.0, 2.0, 3.0, 3.0, 3.0]


def test_a_run_that_stayed_up_resets_the_backoff():
    p = RestartPolicy(backoff_s=0.5, stable_s=60.0)
    runs = [Run(0.0, 1.0, 1, False), Run(1.5, 2.5, 1, True), Run(3.5, 3.6, 1, True)]
    assert decide(p, runs, now_s=1e9).backoff_s == 2.0
    runs.append(Run(6.0, 66.0, -9, True))  # up a minute: a new fault, not the loop
    assert decide(p, runs, now_s=1e9).backoff_s == 0.5


def test_a_crash_loop_gives_up_after_max_restarts_within_the_window():
    p = RestartPolicy(backoff_s=0.5, max_restarts=3, window_s=120.0)
    runs = [Run(0.0, 0.1, 2, False)]
    actions = []
    for _ in range(5):
        d = decide(p, runs, now_s=1e9)
        actions.append(d.action)
        if d.action == GIVE_UP:
            assert "3 restarts within 120s" in d.reason
            break
        runs.append(Run(d.at_s, d.at_s + 0.1, 2, True))
    assert actions == [RESTART, RESTART, RESTART, GIVE_UP]


def test_restarts_older_than_the_window_do_not_count():
    p = RestartPolicy(backoff_s=0.5, max_restarts=2, window_s=10.0, stable_s=5.0)
    runs = [Run(0.0, 1.0, 1, False), Run(1.5, 2.0, 1, True), Run(3.0, 9.0, 1, True),
            Run(100.0, 200.0, -9, True)]
    assert decide(p, runs, now_s=1e9).action == RESTART


def test_policy_fields_are_checked_by_name():
    for field, value in (("backoff_s", 0.0), ("backoff_factor", 0.5), ("backoff_max_s", 0.1),
                         ("stable_s", 0.0), ("max_restarts", -1), ("window_s", 0.0)):
        with pytest.raises(ValueError, match=field):
            RestartPolicy(**{field: value})
    with pytest.raises(ValueError, match="runs"):
        decide(RestartPolicy(), [], now_s=0.0)


# ---- properties: a simulated child, driven the way the adapter drives the core --------------

policies = st.builds(RestartPolicy, backoff_s=st.floats(0.01, 5), backoff_factor=st.floats(1, 4),
                     backoff_max_s=st.floats(5, 60), stable_s=st.floats(1, 100),
                     max_restarts=st.integers(0, 8), window_s=st.floats(1, 300))
uptimes = st.lists(st.one_of(st.floats(0, 2), st.floats(0, 200)), min_size=1, max_size=40)


def simulate(policy: RestartPolicy, ups: list[float], poll_s: float):
    """Polls every `poll_s` as the adapter does, keeping only `history_len()` runs; the child
    dies after each up-time in turn. Returns ([(restart time, its backoff, the exit before)],
    gave up?)."""
    runs = [Run(0.0, ups[0], 1, False)]
    restarts = []
    now = ups[0]
    for up in ups[1:]:
        while True:
            d = decide(policy, runs[-policy.history_len():], now)
            if d.action == GIVE_UP:
                return restarts, True
            if d.action == RESTART:
                break
            assert d.action == WAIT and d.at_s > now
            now += poll_s * math.ceil((d.at_s - now) / poll_s)  # the first poll at or past it
        restarts.append((now, d.backoff_s, runs[-1].ended_s))
        runs.append(Run(now, now + up, 1, True))
        now += up
    return restarts, False


@DETERMINISTIC
@given(policies, uptimes, st.floats(0.01, 1))
def test_never_restarted_before_its_backoff_after_the_exit(policy, ups, poll_s):
    restarts, _ = simulate(policy, ups, poll_s)
    for at, backoff, ended in restarts:
        assert at >= ended + backoff >= ended + policy.backoff_s
    for (a, _, _), (b, _, _) in zip(restarts, restarts[1:]):
        # Never two restarts closer than the backoff (up to the float sums of the clock).
        assert b - a >= policy.backoff_s * (1 - 1e-9)


@DETERMINISTIC
@given(policies, uptimes, st.floats(0.01, 1))
def test_never_more_than_max_restarts_in_any_window(policy, ups, poll_s):
    restarts, _ = simulate(policy, ups, poll_s)
    times = [at for at, _, _ in restarts]
    for i, t in enumerate(times):
        assert sum(1 for u in times[i:] if u < t + policy.window_s) <= policy.max_restarts


@DETERMINISTIC
@given(policies, st.floats(0, 0.5), st.floats(0.01, 1))
def test_a_crash_loop_that_fits_in_the_window_ends_in_a_give_up(policy, up, poll_s):
    restarts, gave_up = simulate(policy, [up] * 60, poll_s)
    n = policy.max_restarts
    waits = [min(policy.backoff_max_s, policy.backoff_s * policy.backoff_factor ** i)
             for i in range(n + 1)]
    # From the first restart to the one that would exceed the bound: n up-times, the waits
    # after the 1st..n-th death, and up to one poll of lateness per restart.
    if n * (up + poll_s) + sum(waits[1:]) < policy.window_s:
        assert gave_up and len(restarts) == n
    else:  # too slow to be a loop by the window's measure: restarted every time
        assert gave_up == (len(restarts) < 59)


@DETERMINISTIC
@given(policies, uptimes, st.floats(0, 1e6))
def test_the_decision_depends_only_on_the_kept_history(policy, ups, t0):
    runs, now = [], t0
    for i, up in enumerate(ups):
        runs.append(Run(now, now + up, 1, i > 0))
        now += up + policy.backoff_max_s
    kept = runs[-policy.history_len():]
    for t in (now, runs[-1].ended_s):
        assert decide(policy, kept, t) == decide(policy, runs, t)


# ---- the adapter (supervise.py) over real short-lived processes ------------------------------

class ProcCluster:
    """Children that are real processes (`python -c CODE`), respawned with the same code."""

    def __init__(self, tmp_path, code: str, n: int = 1) -> None:
        self.code = code
        self.spawns: list[float] = []
        self.children = []
        for i in range(n):
            c = types.SimpleNamespace(name=f"w-{i}", kind="worker", started_s=time.monotonic(),
                                      log_path=str(tmp_path / f"w-{i}.log"), stopping=False)
            c.proc = self._popen(c, "w")
            self.children.append(c)

    def _popen(self, child, mode: str) -> subprocess.Popen:
        with open(child.log_path, mode) as log:
            return subprocess.Popen([sys.executable, "-c", self.code], stdout=log,
                                    stderr=subprocess.STDOUT)

    def supervised(self):
        return [c for c in self.children if not c.stopping]

    def respawn(self, child, exit_code: int, attempt: int) -> bool:
        with open(child.log_path, "a") as log:
            log.write(f"restarting {child.name} (exit {exit_code}), attempt {attempt}\n")
        child.proc = self._popen(child, "a")
        self.spawns.append(time.monotonic())
        return True


def wait_until(cond, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_a_child_that_always_dies_is_restarted_with_backoff_then_given_up_on(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="pdserve.launcher.supervision")
    cluster = ProcCluster(tmp_path, "print('boom: no such device'); raise SystemExit(3)")
    policy = RestartPolicy(backoff_s=0.1, max_restarts=3, window_s=60.0)
    sup = Supervision(cluster, policy, poll_s=0.01).start()
    try:
        wait_until(lambda: sup.counts()["gave_up"].get("worker") == 1)
    finally:
        sup.close()
    assert sup.counts() == {"restarts": {"worker": 3}, "gave_up": {"worker": 1}}
    gaps = [b - a for a, b in zip(cluster.spawns, cluster.spawns[1:])]
    assert all(g >= 0.1 for g in gaps) and gaps[-1] >= 0.4  # 0.2 then 0.4 after quick deaths
    log = (tmp_path / "w-0.log").read_text()
    assert [f"attempt {n}" in log for n in (1, 2, 3, 4)] == [True, True, True, False]
    assert "giving up on w-0 (exit 3): crash loop: 3 restarts within 60s" in log
    [report] = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert "giving up on w-0 (exit 3)" in report.getMessage()
    assert "boom: no such device" in report.getMessage()  # the tail of its log


def test_paused_supervision_restarts_nothing(tmp_path):
    cluster = ProcCluster(tmp_path, "import time; time.sleep(60)", n=2)
    sup = Supervision(cluster, RestartPolicy(backoff_s=0.05), poll_s=0.01).start()
    try:
        cluster.children[0].proc.kill()
        wait_until(lambda: sup.counts()["restarts"].get("worker") == 1)
        sup.pause()  # what stop() does first
        for c in cluster.children:
            c.proc.kill()
            c.proc.wait()
        time.sleep(0.5)
        assert sup.counts()["restarts"] == {"worker": 1}
        assert all(c.proc.poll() is not None for c in cluster.children)
    finally:
        sup.close()
        for c in cluster.children:
            if c.proc.poll() is None:
                c.proc.kill()


class _SameDraw:
    """An rng whose every draw is one port: what two unlucky separate draws look like."""

    def __init__(self, port: int) -> None:
        self.port = port

    def randrange(self, low: int, high: int) -> int:
        return self.port


def test_a_port_handed_out_is_not_handed_out_again_by_a_later_call():
    from pdserve.launcher.cluster_spec import free_ports

    first = free_ports(2)
    # A later call drawing only the first call's port (not yet bound by anyone) gets another.
    again = free_ports(1, rng=_SameDraw(first[0]))
    assert again[0] not in first
    assert len(set(free_ports(3) + first + again)) == 6
