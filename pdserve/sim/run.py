"""The simulator's entry: `simulate(cfg, requests, profile) -> SimReport`.

Owns one run: build the cluster, run its event loop to the last request, and stamp the report
with the configuration and the wall time. Must not print; `progress(now_s, done, total)` is
called now and then for whoever shows it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from pdserve.sim.cluster import Cluster
from pdserve.sim.config import SimConfig
from pdserve.sim.report import SimReport
from pdserve.sim.trace import SimRequest


def simulate(cfg: SimConfig, requests: list[SimRequest], profile,
             progress: Callable[[float, int, int], None] | None = None) -> SimReport:
    started = time.perf_counter()
    report = Cluster(cfg, requests, profile, progress).run()
    report.config = dataclasses.asdict(cfg)
    report.wall_s = time.perf_counter() - started
    return report
