"""The simulator's entry: `simulate(cfg, requests, profile) -> SimReport`.

Owns one run: build the cluster, run its event loop to the last request, and stamp the report
with the configuration and the wall time. Must not print; `progress(now_s, done, total)` is
called now and then for whoever shows it.

While the loop runs, the cyclic garbage collector is told to look less often: a run allocates
millions of short-lived objects that reference counting frees (nothing it builds is a cycle
that must be reclaimed early), and the cluster's long-lived state (a thousand block pools, the
trace) is frozen out of its scans. Both are restored when the run ends.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from collections.abc import Callable

from pdserve.sim.cluster import Cluster
from pdserve.sim.config import SimConfig
from pdserve.sim.report import SimReport
from pdserve.sim.trace import SimRequest


def simulate(cfg: SimConfig, requests: list[SimRequest], profile,
             progress: Callable[[float, int, int], None] | None = None) -> SimReport:
    started = time.perf_counter()
    cluster = Cluster(cfg, requests, profile, progress)
    threshold = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(max(threshold[0], 50_000), *threshold[1:])
    try:
        report = cluster.run()
    finally:
        gc.set_threshold(*threshold)
        gc.unfreeze()
    report.config = dataclasses.asdict(cfg)
    report.wall_s = time.perf_counter() - started
    return report
