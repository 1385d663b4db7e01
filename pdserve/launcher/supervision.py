"""Supervision of the launcher's children: a thread that restarts the dead ones, and its metrics.

Owns the I/O around the pure restart rule (`restart.decide`): polling each child's process,
keeping its last few runs (`RestartPolicy.history_len()`), asking the cluster to respawn it when
the rule says so, and reporting: a warning per restart, an error naming the child, its exit code
and the tail of its log when it is given up on (also written into that log), and the counts
behind `pdserve:process_restarts_total{kind}`, `pdserve:process_gave_up_total{kind}` and
`pdserve:process_up{name,kind}`.

Must not decide when to restart (the core does) nor know how a child is started (the cluster's
`respawn` does), and must never restart a child the cluster is stopping on purpose: `pause()`
comes first in every stop, and the cluster marks children it stops itself.

The thread lives until `close()`, after the cluster's children are stopped: Linux sends a
child's parent-death signal (`pdserve.lifecycle`) when the *thread* that spawned it exits, so
ending this thread first would kill every child it restarted out of the stop order.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import Any, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pdserve.launcher.restart import GIVE_UP, RESTART, RestartPolicy, Run, decide

log = logging.getLogger(__name__)

KINDS = ("master", "node", "worker", "router", "controller")


class Supervised(Protocol):
    """What supervision needs of a child (the launcher's `Child`)."""

    name: str
    kind: str
    log_path: str
    started_s: float  # on supervision's clock
    proc: Any  # a subprocess.Popen


class Cluster(Protocol):
    def supervised(self) -> list[Supervised]: ...  # children not being stopped on purpose

    def respawn(self, child: Supervised, exit_code: int, attempt: int) -> bool: ...
    # False: not respawned, the cluster is stopping it meanwhile


class Supervision:
    def __init__(self, cluster: Cluster, policy: RestartPolicy, poll_s: float = 0.2,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not poll_s > 0:
            raise ValueError(f"poll_s must be > 0, got {poll_s}")
        self.cluster = cluster
        self.policy = policy
        self.poll_s = poll_s
        self.clock = clock
        self._runs: dict[str, deque[Run]] = {}
        self._restarts_of: Counter[str] = Counter()  # by child name
        self._gave_up: set[str] = set()
        self._lock = threading.Lock()  # counts, read by scrapes and tests
        self._tick_lock = threading.Lock()  # held through one round of polls and restarts
        self._paused = False
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="supervision", daemon=True)
        self.restarts: Counter[str] = Counter()  # by kind
        self.gave_up: Counter[str] = Counter()  # by kind

    def start(self) -> "Supervision":
        self._thread.start()
        return self

    def pause(self) -> None:
        """No restart from now on; returns once a round in progress has finished."""
        with self._tick_lock:
            self._paused = True

    def close(self) -> None:
        self.pause()
        self._closed.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def counts(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return {"restarts": dict(self.restarts), "gave_up": dict(self.gave_up)}

    def _run(self) -> None:
        while not self._closed.wait(self.poll_s):
            with self._tick_lock:
                if self._paused:
                    continue
                try:
                    self.tick()
                except Exception:  # one bad round must not end supervision for good
                    log.exception("supervision round failed; the next one retries")

    def tick(self) -> None:
        """One round: every dead child is recorded, then restarted, left to wait, or given up."""
        for child in self.cluster.supervised():
            code = child.proc.poll()
            if code is None or child.name in self._gave_up:
                continue
            now = self.clock()
            runs = self._runs.setdefault(child.name, deque(maxlen=self.policy.history_len()))
            if not runs or runs[-1].started_s != child.started_s:  # a death not yet recorded
                runs.append(Run(child.started_s, now, code,
                                restart=self._restarts_of[child.name] > 0))
                log.warning("%s exited with %s after %.1fs", child.name, code,
                            now - child.started_s)
            d = decide(self.policy, list(runs), now)
            if d.action == RESTART:
                attempt = self._restarts_of[child.name] + 1
                log.warning("restarting %s (exit %s), attempt %d", child.name, code, attempt)
                try:
                    if not self.cluster.respawn(child, code, attempt):
                        continue
                except OSError as e:  # counted as a run that died at once: backoff grows
                    log.error("could not restart %s: %s", child.name, e)
                child.started_s = self.clock()
                self._restarts_of[child.name] = attempt
                with self._lock:
                    self.restarts[child.kind] += 1
            elif d.action == GIVE_UP:
                self._give_up(child, code, d.reason)

    def _give_up(self, child: Supervised, code: int, reason: str) -> None:
        self._gave_up.add(child.name)
        with self._lock:
            self.gave_up[child.kind] += 1
        line = (f"giving up on {child.name} (exit {code}): {reason}; it stays down until "
                f"the cluster is restarted")
        try:
            with open(child.log_path, "a", encoding="utf-8") as f:
                f.write(f"[pdserve serve] {line}\n")
        except OSError as e:
            line += f" (could not append to its log: {e})"
        log.error("%s; its log (%s) ends:\n%s", line, child.log_path, tail(child.log_path))


class SupervisionCollector:
    """The supervision counts and each child's liveness, read at scrape time."""

    def __init__(self, counts: Callable[[], dict[str, dict[str, int]]],
                 processes: Callable[[], list[tuple[str, str, bool]]]) -> None:
        self.counts = counts
        self.processes = processes  # (name, kind, up) per child

    def collect(self):
        c = self.counts()
        for key, name, doc in (
                ("restarts", "process_restarts", "Children restarted after they died, by kind."),
                ("gave_up", "process_gave_up",
                 "Children left down after a crash loop, by kind.")):
            family = CounterMetricFamily(f"pdserve:{name}", doc, labels=["kind"])
            for kind in KINDS:
                family.add_metric([kind], c[key].get(kind, 0))
            yield family
        up = GaugeMetricFamily("pdserve:process_up", "1 while the child process runs.",
                               labels=["name", "kind"])
        for name, kind, alive in self.processes():
            up.add_metric([name, kind], 1.0 if alive else 0.0)
        yield up


def tail(path: str, n: int = 20) -> str:
    """The last `n` lines of a log file (for error messages)."""
    try:
        with open(path, errors="replace") as f:
            return "".join(deque(f, maxlen=n))
    except OSError:
        return "(no log)"
